"""The .smpb file format: a Graph as a flatbuffer (schema/samplec.fbs), written deterministically and read defensively.

A file is the flatbuffer followed by a 40-byte seal: the 8 bytes `SMPBSHA2` and the SHA-256 of the flatbuffer. The
seal catches any accident to the bytes (a flipped bit in a constant would otherwise load as another sampler); what
a crafted file with a valid seal can do is bounded by the checks below and by the kernels, which never index
outside their operands.

Values are numbered: 0..P-1 are the params in order, then the nodes in topological order; a node may only use
smaller numbers, so the loader is one linear pass and a cycle cannot even be written down. `from_bytes` checks
everything (seal, identifier, version, sizes, every index, attribute kinds and ranges, every recorded type against
the op table, names) before it returns, and turns any problem with the bytes into
`SamplecError("invalid .smpb: ...")`. The per-op tables are reached through the op table (`<CamelName>Node`),
never through a list of op names.
"""
from __future__ import annotations

import hashlib
import importlib
import re
import struct

import flatbuffers

from samplec.diagnostics import SamplecError
from samplec.files import read_file, write_atomic
from samplec.ir.graph import INPUT, Check, Graph, Node, Param, VerifyError, verify
from samplec.ir.ops import OPS
from samplec.ir.types import DTYPES, Type
from samplec.stages import OUTPUTS, Range
from samplec.schema_gen import CheckEntry as fb_check
from samplec.schema_gen import Node as fb_node
from samplec.schema_gen import Output as fb_output
from samplec.schema_gen import Param as fb_param
from samplec.schema_gen import Program as fb_program
from samplec.schema_gen import Scalar as fb_scalar
from samplec.schema_gen.ScalarKind import ScalarKind

FORMAT_VERSION = 4               # 2: the SHA-256 seal; no -O2 plans. 3: mass_threshold, no cumsum (ops renumbered).
#                                  4: the penalties stage op and its check op (ops renumbered)
FILE_IDENTIFIER = b"SMPB"
SEAL_MAGIC = b"SMPBSHA2"
SEAL_SIZE = len(SEAL_MAGIC) + 32
MAX_ITEMS = 1_000_000            # params, nodes, outputs, checks, operands or attribute entries in one list
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

OP_NAMES = list(OPS)              # union type i+1 <-> OP_NAMES[i]  (0 is NONE)
OP_INDEX = {name: i + 1 for i, name in enumerate(OP_NAMES)}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _op_module(op: str):
    """The generated module of an op's table: `random_bits` -> samplec.schema_gen.RandomBitsNode."""
    return importlib.import_module(f"samplec.schema_gen.{_camel(op)}Node")


OP_MODULES = {name: _op_module(name) for name in OP_NAMES}
_DIM = re.compile(r"0|[1-9][0-9]{0,17}|[A-Za-z_][A-Za-z0-9_]{0,63}")
_DECODE_ERRORS = (IndexError, KeyError, struct.error, UnicodeError, ValueError, TypeError, AttributeError,
                  OverflowError, RecursionError, MemoryError, AssertionError)


# ---- writing -----------------------------------------------------------------------------------------------------

class _Writer:
    def __init__(self):
        self.b = flatbuffers.Builder(1024)
        self.b.ForceDefaults(True)    # write every field, so -0.0 and other default-equal values survive exactly

    def string(self, s: str) -> int:
        try:
            return self.b.CreateString(s)
        except UnicodeError:
            raise SamplecError(f"cannot serialize: {s!r} is not valid UTF-8 text") from None

    def offsets(self, offs: list[int]) -> int:
        self.b.StartVector(4, len(offs), 4)
        for off in reversed(offs):
            self.b.PrependUOffsetTRelative(off)
        return self.b.EndVector()

    def numbers(self, prepend, size: int, values) -> int:
        self.b.StartVector(size, len(values), size)
        for v in reversed(values):
            prepend(v)
        return self.b.EndVector()

    def strings(self, items) -> int:
        return self.offsets([self.string(s) for s in items])

    def shape(self, t: Type) -> int:
        dims = [str(d) for d in t.shape]
        for d in dims:
            if not _DIM.fullmatch(d):
                raise SamplecError(f"cannot serialize: dimension {d!r} of {t} is not a symbol or a small integer")
        return self.string(",".join(dims))

    def scalar(self, v) -> int:
        b, m = self.b, fb_scalar
        if isinstance(v, bool):
            kind, negative, magnitude, f = ScalarKind.Bool, False, int(v), 0.0
        elif isinstance(v, int):
            if abs(v) > U64_MAX:
                raise SamplecError(f"cannot serialize: integer {v} does not fit in 64 bits")
            kind, negative, magnitude, f = ScalarKind.Int, v < 0, abs(v), 0.0
        elif isinstance(v, float):
            kind, negative, magnitude, f = ScalarKind.Float, False, 0, v
        else:
            raise SamplecError(f"cannot serialize: {v!r} is not a number")
        m.Start(b)
        m.AddKind(b, kind)
        m.AddNegative(b, negative)
        m.AddMagnitude(b, magnitude)
        m.AddF(b, f)
        return m.End(b)


def _dtype_index(dtype: str) -> int:
    if dtype not in DTYPES:
        raise SamplecError(f"cannot serialize: unknown dtype {dtype!r}")
    return DTYPES.index(dtype)


def _write_op(w: _Writer, n: Node) -> int:
    """The `<Op>Node` table of one node, its fields being the op's attributes in declaration order."""
    m, b, attrs = OP_MODULES[n.op], w.b, n.attr_dict
    values = {}
    for name, kind in OPS[n.op].attrs:           # children (vectors, tables, strings) go before the table
        if name not in attrs:
            raise SamplecError(f"cannot serialize: {n.op} lacks attribute {name}")
        v = attrs[name]
        if kind in ("int", "ints"):
            for x in (v if kind == "ints" else (v,)):
                if not isinstance(x, int) or not I64_MIN <= x <= I64_MAX:
                    raise SamplecError(f"cannot serialize: {n.op} attribute {name} = {v!r} is not a 64-bit int")
        if kind == "ints":
            values[name] = w.numbers(b.PrependInt64, 8, v)
        elif kind == "floats":
            values[name] = w.numbers(b.PrependFloat64, 8, [float(x) for x in v])
        elif kind == "scalar":
            values[name] = w.scalar(v)
        elif kind == "str":
            values[name] = w.string(v)
        elif kind == "dtype":
            values[name] = _dtype_index(v)
        else:
            values[name] = v
    m.Start(b)
    for name, _ in OPS[n.op].attrs:
        getattr(m, "Add" + _camel(name))(b, values[name])
    return m.End(b)


def to_bytes(g: Graph, target: str = "auto") -> bytes:
    """The .smpb bytes of `g` (a stage-level graph; `target`, the target it was compiled for, is recorded beside
    it): params in order, then the reachable nodes in `g.toposort()` order, sealed."""
    w = _Writer()
    w.b.Finish(_write_program(w, g, target), file_identifier=FILE_IDENTIFIER)
    return seal(bytes(w.b.Output()))


def seal(flatbuffer: bytes) -> bytes:
    """The flatbuffer followed by its seal (SEAL_MAGIC and its SHA-256)."""
    return flatbuffer + SEAL_MAGIC + hashlib.sha256(flatbuffer).digest()


def _unseal(data: bytes) -> bytes:
    """The flatbuffer of a sealed file, or _Invalid."""
    if len(data) < SEAL_SIZE + 8 or data[-SEAL_SIZE:-32] != SEAL_MAGIC:
        if len(data) >= 8 and data[4:8] == FILE_IDENTIFIER:
            raise _Invalid("no SHA-256 seal at the end: truncated, or written by an older samplec (recompile it)")
        raise _Invalid(f"not a .smpb file ({len(data)} bytes, no seal)")
    body = bytes(data[:-SEAL_SIZE])
    if hashlib.sha256(body).digest() != bytes(data[-32:]):
        raise _Invalid("SHA-256 mismatch: the file is corrupted")
    return body


def _write_program(w: "_Writer", g: Graph, target: str = "auto") -> int:
    try:
        verify(g)      # never write a file that from_bytes would reject
    except VerifyError as e:
        raise SamplecError(f"cannot serialize: {e}") from None
    index = {id(p.node): i for i, p in enumerate(g.params)}
    if len(index) != len(g.params):
        raise SamplecError("cannot serialize: two parameters share a node")
    nodes = [n for n in g.toposort() if id(n) not in index]
    for n in nodes:
        if n.op == INPUT:
            raise SamplecError(f"cannot serialize: input {n.name!r} is not a declared parameter")
        if n.op not in OPS:
            raise SamplecError(f"cannot serialize: unknown op {n.op!r}")
        index[id(n)] = len(index)
    b = w.b

    params = []
    for p in g.params:
        name, kind, shape = w.string(p.name), w.string(p.kind), w.shape(p.node.type)
        rng = None if p.range is None else w.string(p.range)
        default = None if p.default is None or p.default == "os" else w.scalar(p.default)
        m = fb_param
        m.Start(b)
        m.AddName(b, name)
        m.AddKind(b, kind)
        m.AddDtype(b, _dtype_index(p.node.type.dtype))
        m.AddShape(b, shape)
        if default is not None:
            m.AddDefault(b, default)
        m.AddDefaultOs(b, isinstance(p.default, str) and p.default == "os")
        if rng is not None:
            m.AddRange(b, rng)
        params.append(m.End(b))

    fb_nodes = []
    for n in nodes:
        op = _write_op(w, n)
        inputs = w.numbers(b.PrependUint32, 4, [index[id(i)] for i in n.inputs])
        shape = w.shape(n.type)
        name = None if n.name is None else w.string(n.name)
        m = fb_node
        m.Start(b)
        m.AddOpType(b, OP_INDEX[n.op])
        m.AddOp(b, op)
        m.AddInputs(b, inputs)
        m.AddDtype(b, _dtype_index(n.type.dtype))
        m.AddShape(b, shape)
        if name is not None:
            m.AddName(b, name)
        fb_nodes.append(m.End(b))

    outputs = []
    for key, n in g.outputs:
        if id(n) not in index:
            raise SamplecError(f"cannot serialize: output {key!r} is an undeclared input")
        name = w.string(key)
        fb_output.Start(b)
        fb_output.AddName(b, name)
        fb_output.AddValue(b, index[id(n)])
        outputs.append(fb_output.End(b))

    checks = []
    for c in g.checks:
        if id(c.flag) not in index:
            raise SamplecError(f"cannot serialize: check {c.message!r} is on an undeclared input")
        msg = w.string(c.message)
        fb_check.Start(b)
        fb_check.AddValue(b, index[id(c.flag)])
        fb_check.AddMessage(b, msg)
        checks.append(fb_check.End(b))

    name, params_v, nodes_v = w.string(g.name), w.offsets(params), w.offsets(fb_nodes)
    target_s = w.string(target)
    outputs_v, checks_v = w.offsets(outputs), w.offsets(checks)
    m = fb_program
    m.Start(b)
    m.AddFormatVersion(b, FORMAT_VERSION)
    m.AddName(b, name)
    m.AddParams(b, params_v)
    m.AddNodes(b, nodes_v)
    m.AddOutputs(b, outputs_v)
    m.AddChecks(b, checks_v)
    m.AddTarget(b, target_s)
    return m.End(b)


def save(g: Graph, path, not_over=None, target: str = "auto") -> int:
    """Write `g` to `path` atomically (samplec.files.write_atomic); the number of bytes written."""
    data = to_bytes(g, target)
    write_atomic(path, data, not_over=not_over)
    return len(data)


# ---- reading -----------------------------------------------------------------------------------------------------

class _Invalid(Exception):
    """A problem with the bytes; from_bytes reports it as SamplecError("invalid .smpb: ...")."""


_U32, _I32, _VT = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<HH")
_U8, _U64, _I64, _F64 = struct.Struct("<B"), struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<d")
_ATTR_NUMBER = {"int": (_I64, 0), "float": (_F64, 0.0), "bool": (struct.Struct("<?"), False), "dtype": (_U8, 0)}
NODE_FIELDS = ("OpType", "Op", "Inputs", "Dtype", "Shape", "Name")   # the Node table's fields, in vtable order
_PROGRAM_PARAMS, _PROGRAM_NODES = 2, 3   # Program.params and .nodes: its 3rd and 4th fields (tests check these
PARAM_FIELDS = ("Name", "Kind", "Dtype", "Shape", "Default", "DefaultOs", "Range")   # against the generated code)


class _CheckedBytes(bytes):
    """The file's bytes, but a slice that runs outside them raises instead of quietly coming back short.

    flatbuffers reads a string as `Bytes[start:start + length]`; with plain bytes a corrupt length or offset
    would give a truncated or wrapped-around string rather than an error.
    """

    def __getitem__(self, key):
        if isinstance(key, slice) and not (0 <= (key.start or 0) <= (len(self) if key.stop is None else key.stop)
                                           <= len(self)):
            raise IndexError(f"bytes {key.start}..{key.stop} lie outside the {len(self)}-byte file")
        return super().__getitem__(key)


class _Reader:
    """Checked access to the generated flatbuffer classes.

    The flatbuffers runtime bounds-checks single reads (they raise), but a vector's length or a string's offset
    is whatever the bytes say, and tables may alias one another. Every vector and string read is charged to a
    budget of the buffer's length (an honest file never reads a byte twice), so a malicious file that points
    many nodes at one huge vector is rejected instead of taking quadratic time.
    """

    def __init__(self, data: bytes):
        self.buf = bytes(data)       # plain bytes for the direct reads below, which check every position
        self.size = len(data)
        self.budget = len(data)
        self.shapes: dict[str, tuple] = {}      # shape text -> dims (most values share a handful of shapes)
        self.types: dict[tuple, Type] = {}      # (dtype number, shape text) -> Type

    def charge(self, nbytes: int, what: str) -> None:
        self.budget -= nbytes
        if nbytes > self.size or self.budget < 0:
            raise _Invalid(f"{what} runs past the end of the file or overlaps other data")

    def length(self, obj, field: str, elem_size: int, what: str) -> int:
        n = getattr(obj, field + "Length")()
        if n > MAX_ITEMS:
            raise _Invalid(f"{what} has {n} entries (more than {MAX_ITEMS})")
        self.charge(4 + n * elem_size, what)
        return n

    def text(self, raw, what: str, required: bool = True) -> str | None:
        if raw is None:
            if required:
                raise _Invalid(f"{what} is missing")
            return None
        self.charge(4 + len(raw) + 1, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Invalid(f"{what} is not valid UTF-8") from None

    # -- the node table, read directly: the generated accessors look the vtable up again for every field and
    # -- cost ~35 us a node; one vtable read and a few unpacks do the same checks (this is what makes loading
    # -- a program take ~1-3 ms instead of ~10)
    def u32(self, pos: int, what: str) -> int:
        if not 0 <= pos <= self.size - 4:
            raise _Invalid(f"{what} points outside the file")
        return _U32.unpack_from(self.buf, pos)[0]

    def fields(self, pos: int, n: int, what: str) -> tuple:
        """Absolute positions of a table's first n fields (0 where absent), from its vtable."""
        if not 0 <= pos <= self.size - 4:
            raise _Invalid(f"{what} points outside the file")
        vt = pos - _I32.unpack_from(self.buf, pos)[0]
        if not 0 <= vt <= self.size - 4:
            raise _Invalid(f"{what} has a vtable outside the file")
        vsize, tsize = _VT.unpack_from(self.buf, vt)
        k = min(n, max(0, (vsize - 4) // 2))
        if vt + 4 + 2 * k > self.size:
            raise _Invalid(f"{what} has a vtable outside the file")
        offs = struct.unpack_from(f"<{k}H", self.buf, vt + 4)
        return [pos + o if o else 0 for o in offs] + [0] * (n - k)

    def ref(self, field: int, what: str) -> int:
        """The absolute position a uoffset field points at."""
        return field + self.u32(field, what)

    def vector_u32(self, field: int, what: str) -> tuple:
        return self.vector(field, _U32, what)

    def vector(self, field: int, elem: struct.Struct, what: str) -> tuple:
        """The numbers of a vector field (elements as `elem`), bounds-checked and charged to the budget."""
        if not field:
            return ()
        start = self.ref(field, what)
        n = self.u32(start, what)
        if n > MAX_ITEMS:
            raise _Invalid(f"{what} has {n} entries (more than {MAX_ITEMS})")
        self.charge(4 + elem.size * n, what)
        if start + 4 + elem.size * n > self.size:
            raise _Invalid(f"{what} runs past the end of the file")
        return struct.unpack_from(f"<{n}{elem.format[-1]}", self.buf, start + 4)

    def tables(self, field: int, what: str) -> list[int]:
        """Absolute positions of the tables of a vector of tables (each entry is an offset from itself)."""
        if not field:
            return []
        start = self.ref(field, what) + 4
        offsets = self.vector_u32(field, what)
        return [start + 4 * k + o for k, o in enumerate(offsets)]

    def string(self, field: int, what: str, required: bool = True) -> str | None:
        if not field:
            return self.text(None, what, required)
        start = self.ref(field, what)
        n = self.u32(start, what)
        if start + 4 + n > self.size:
            raise _Invalid(f"{what} runs past the end of the file")
        return self.text(self.buf[start + 4:start + 4 + n], what, required)

    def node(self, pos: int, what: str):
        """(op tag, op table position, operands, dtype number, shape text, name) of the Node table at pos.
        (The hot loop of loading: positions are checked inline, messages are only formatted on failure.)"""
        f_tag, f_op, f_inputs, f_dtype, f_shape, f_name = self.fields(pos, 6, what)
        buf, end = self.buf, self.size
        if f_tag >= end or f_dtype >= end:
            raise _Invalid(f"{what} points outside the file")
        tag = buf[f_tag] if f_tag else 0
        dtype_number = buf[f_dtype] if f_dtype else 0
        return (tag, self.ref(f_op, what) if f_op else 0, self.vector_u32(f_inputs, what),
                dtype_number, self.string(f_shape, what), self.string(f_name, what, required=False))

    def dtype(self, i: int, what: str) -> str:
        if not 0 <= i < len(DTYPES):
            raise _Invalid(f"{what} has unknown dtype number {i}")
        return DTYPES[i]

    def make_type(self, dtype_number: int, text: str, what: str) -> Type:
        t = self.types.get((dtype_number, text))
        if t is None:
            t = self.types[(dtype_number, text)] = self._make_type(dtype_number, text, what)
        return t

    def _make_type(self, dtype_number: int, text: str, what: str) -> Type:
        dtype = self.dtype(dtype_number, what)
        dims = self.shapes.get(text)
        if dims is None:
            parts = text.split(",") if text else []
            for d in parts:
                if not _DIM.fullmatch(d):
                    raise _Invalid(f"{what} has a bad dimension {d!r}")
            dims = self.shapes[text] = tuple(int(d) if d[0].isdigit() else d for d in parts)
        return Type(dtype, dims)

    def scalar_value(self, kind: int, negative: bool, magnitude: int, f: float, what: str):
        if kind == ScalarKind.Float:
            return f
        if kind == ScalarKind.Int:
            if negative and magnitude == 0:
                raise _Invalid(f"{what} is a negative zero integer")
            return -magnitude if negative else magnitude
        if kind == ScalarKind.Bool and magnitude in (0, 1) and not negative:
            return bool(magnitude)
        raise _Invalid(f"{what} is a malformed scalar (kind {kind})")

    def scalar_table(self, field: int, what: str):
        """The value of the Scalar table a field points at."""
        kind_f, neg_f, mag_f, f_f = self.fields(self.ref(field, what), 4, what)
        return self.scalar_value(self.at(kind_f, _U8, what) if kind_f else 0,
                                 bool(self.at(neg_f, _U8, what)) if neg_f else False,
                                 self.at(mag_f, _U64, what) if mag_f else 0,
                                 self.at(f_f, _F64, what) if f_f else 0.0, what)

    def at(self, pos: int, fmt: struct.Struct, what: str):
        if not 0 <= pos <= self.size - fmt.size:
            raise _Invalid(f"{what} lies outside the file")
        return fmt.unpack_from(self.buf, pos)[0]

    def attrs(self, op: str, table_pos: int, what: str) -> dict:
        """The op's attributes from its per-op table, read straight from the table's vtable (field i of the table
        is attribute i of the op; absent fields take flatbuffers' defaults, as the generated accessors do)."""
        spec = OPS[op].attrs
        if not spec:
            return {}
        if not table_pos:
            raise _Invalid(f"{what} has no op table")
        out = {}
        for (name, kind), pos in zip(spec, self.fields(table_pos, len(spec), f"{what} op table")):
            where = f"{what} attribute {name}"
            if kind in _ATTR_NUMBER:
                fmt, default = _ATTR_NUMBER[kind]
                v = self.at(pos, fmt, where) if pos else default
                out[name] = self.dtype(v, where) if kind == "dtype" else v
            elif kind == "str":
                out[name] = self.string(pos, where)
            elif kind == "scalar":
                if not pos:
                    raise _Invalid(f"{where} is missing")
                out[name] = self.scalar_table(pos, where)
            elif kind in ("ints", "floats"):
                out[name] = self.vector(pos, _I64 if kind == "ints" else _F64, where)
            else:
                raise _Invalid(f"{where} has kind {kind!r}, which the format does not know")
            if kind == "scalar" and isinstance(out[name], bool):
                raise _Invalid(f"{where} = {out[name]!r} is not a scalar")
        return out


def _read(data: bytes) -> Graph:
    if len(data) < 8:
        raise _Invalid(f"{len(data)} bytes is too short for a .smpb file")
    if data[4:8] != FILE_IDENTIFIER:
        raise _Invalid(f"file identifier is {data[4:8]!r}, expected {FILE_IDENTIFIER!r} (not a .smpb file)")
    r = _Reader(data)
    prog = fb_program.Program.GetRootAs(data, 0)
    version = prog.FormatVersion()
    if version != FORMAT_VERSION:
        raise _Invalid(f"format version {version} is not supported (this samplec reads version {FORMAT_VERSION}): "
                       f"recompile the program from its .smp source")
    return _read_program(r, prog), _read_target(r, prog)


def _read_target(r: "_Reader", prog) -> str:
    """The recorded target ("auto" in a file that records none)."""
    from samplec.passes.target import TARGETS
    raw = prog.Target()
    if raw is None:
        return "auto"
    try:
        target = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Invalid("the target is not UTF-8 text") from None
    if target not in TARGETS:
        raise _Invalid(f"target {target[:40]!r} is not one of {', '.join(TARGETS)}")
    return target


def _check_output_names(keys: list[str]) -> None:
    """A dotted output name is half of a counted output's pair (`top_logprobs.ids` and `.values`): both halves,
    of an output that has them. (Other names are free: a graph built in Python may name its outputs.)"""
    for key in keys:
        base, dot, part = key.partition(".")
        if not dot:
            continue
        if not (base in OUTPUTS and OUTPUTS[base][0] and part in ("ids", "values")):
            raise _Invalid(f"output {key!r}: only top_logprobs and candidates have .ids and .values")
        if f"{base}.{'values' if part == 'ids' else 'ids'}" not in keys:
            raise _Invalid(f"output {key!r} comes without its pair")


def _read_program(r: "_Reader", prog) -> Graph:
    gname = r.text(prog.Name(), "program name")

    values: list[Node] = []
    params: list[Param] = []
    fields = r.fields(prog._tab.Pos, 7, "program")
    for i, pos in enumerate(r.tables(fields[_PROGRAM_PARAMS], "params")):
        what = f"param {i}"
        f_name, f_kind, f_dtype, f_shape, f_default, f_os, f_range = r.fields(pos, 7, what)
        name = r.string(f_name, f"{what} name")
        what = f"param {i} ({name!r})"
        kind = r.string(f_kind, f"{what} kind")
        t = r.make_type(r.at(f_dtype, _U8, what) if f_dtype else 0, r.string(f_shape, f"{what} shape"), what)
        default = r.scalar_table(f_default, f"{what} default") if f_default else None
        if f_os and r.at(f_os, _U8, what):
            if default is not None:
                raise _Invalid(f"{what} has both a default value and the 'os' default")
            default = "os"
        rng = r.string(f_range, f"{what} range", required=False)
        if rng is not None:
            try:
                Range.parse(rng)
            except (ValueError, IndexError):
                raise _Invalid(f"{what} has the range {rng!r}, not an interval like (0.0, 1.0]") from None
        node = Node(INPUT, (), (), t, name)
        params.append(Param(name, kind, node, default, rng))
        values.append(node)
    if not params or params[0].kind != "logits":
        raise _Invalid("the first parameter must be the logits")
    names = [p.name for p in params]
    if len(set(names)) != len(names) or "" in names:
        raise _Invalid("parameter names must be distinct and non-empty")

    tables = r.tables(fields[_PROGRAM_NODES], "nodes")
    n_nodes = len(tables)
    used = [False] * (len(params) + n_nodes)
    for k in range(n_nodes):
        me = len(values)
        what = f"node {k} (value {me})"
        tag, op_table, inputs, dtype_number, shape, hint = r.node(tables[k], what)
        if not 1 <= tag <= len(OP_NAMES):
            raise _Invalid(f"{what} has unknown op number {tag}")
        op = OP_NAMES[tag - 1]
        what = f"node {k} (value {me}, {op})"
        if len(inputs) != OPS[op].arity:
            raise _Invalid(f"{what} has {len(inputs)} operands, {op} takes {OPS[op].arity}")
        for j in inputs:
            if j >= me:
                raise _Invalid(f"{what} uses value {j}, which is not defined before it (forward reference or cycle)")
            used[j] = True
        attrs = r.attrs(op, op_table, what)
        recorded = r.make_type(dtype_number, shape, what)
        operands = tuple(values[j] for j in inputs)
        try:   # (`make` without its generic checks: the reader gave every attribute, each of its declared kind)
            node = Node(op, operands, tuple(attrs.items()), OPS[op].infer([i.type for i in operands], attrs), hint)
        except Exception as e:  # TypeError_ from the op table, or anything odd the attributes provoke
            raise _Invalid(f"{what}: {e}") from None
        if node.type != recorded:
            raise _Invalid(f"{what} records type {recorded} but its operands give {node.type}")
        values.append(node)

    def value(j: int, what: str) -> Node:
        if not 0 <= j < len(values):
            raise _Invalid(f"{what} refers to value {j}, but there are only {len(values)}")
        used[j] = True
        return values[j]

    outputs = []
    for i in range(r.length(prog, "Outputs", 4, "outputs")):
        o = prog.Outputs(i)
        key = r.text(o.Name(), f"output {i} name")
        if not key:
            raise _Invalid(f"output {i} has an empty name")
        outputs.append((key, value(o.Value(), f"output {key!r}")))
    if len({k for k, _ in outputs}) != len(outputs):
        raise _Invalid("output names must be distinct")
    _check_output_names([k for k, _ in outputs])
    checks = []
    for i in range(r.length(prog, "Checks", 4, "checks")):
        c = prog.Checks(i)
        checks.append(Check(value(c.Value(), f"check {i}"), r.text(c.Message(), f"check {i} message")))
    unused = [j for j in range(len(params), len(values)) if not used[j]]
    if unused:
        raise _Invalid(f"value {unused[0]} ({values[unused[0]].op}) is computed but never used")
    return Graph(gname, tuple(params), tuple(outputs), tuple(checks))


def from_bytes(data: bytes, sealed: bool = True) -> Graph:
    """The Graph in `data`, checked completely; any problem raises SamplecError("invalid .smpb: ...").
    (`sealed=False` reads a bare flatbuffer: for tests that build files the writer never would.)"""
    return read_program(data, sealed)[0]


def read_program(data: bytes, sealed: bool = True) -> tuple[Graph, str]:
    """(the Graph in `data`, the target it was compiled for), checked as from_bytes checks."""
    try:
        body = _CheckedBytes(_unseal(data) if sealed else data)
        g, target = _read(body)
    except _Invalid as e:
        raise SamplecError(f"invalid .smpb: {e}") from None
    except (struct.error, IndexError, TypeError) as e:   # flatbuffers raises TypeError for a negative offset
        raise SamplecError(f"invalid .smpb: corrupt flatbuffer: an offset or length points outside the file ({e})") \
            from None
    except _DECODE_ERRORS as e:
        raise SamplecError(f"invalid .smpb: corrupt flatbuffer ({type(e).__name__}: {e})") from None
    try:       # (the reader built every node with `make`, which inferred and checked its type)
        verify(g, infer=False)
    except VerifyError as e:
        raise SamplecError(f"invalid .smpb: {e}") from None
    return g, target


def load(path) -> Graph:
    return load_program(path)[0]


def load_program(path) -> tuple[Graph, str]:
    data = read_file(path)
    try:
        return read_program(data)
    except SamplecError as e:
        raise SamplecError(f"{path}: {e}") from None


__all__ = ["FORMAT_VERSION", "to_bytes", "from_bytes", "read_program", "seal", "save", "load", "load_program"]
