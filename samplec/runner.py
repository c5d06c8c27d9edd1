"""What `samplec run` is made of: reading arrays and --param values, repeated draws, and output formatting."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from samplec.api import _integer
from samplec.diagnostics import SamplecError
from samplec.files import check_regular
from samplec.ir.graph import Graph
from samplec.ir.types import U64
from samplec.program import Outputs, Program

DRAW_CHUNK_FLOATS = 1 << 23   # logits entries per batched call during --draws


def load_array(path: Path, flag: str) -> mx.array:
    """A .npy, .npz or .safetensors file holding one array (or one named 'logits')."""
    path = Path(path)
    suffix = path.suffix.lower()                # (X.NPY is a .npy file)
    if suffix not in (".npy", ".npz", ".safetensors"):
        raise SamplecError(f"{flag}: {path}: expected a .npy, .npz or .safetensors file")
    try:
        check_regular(path)                 # (a FIFO would block the reader)
    except SamplecError as e:
        raise SamplecError(f"{flag}: {e}") from None
    try:
        data = mx.load(str(path), format=suffix[1:])
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
        raise SamplecError(f"{flag}: cannot read {path}: {_reader_error(e, path)}") from None
    if isinstance(data, dict):
        if not data:
            raise SamplecError(f"{flag}: {path} holds no array")
        if len(data) > 1 and "logits" not in data:
            raise SamplecError(f"{flag}: {path} holds several arrays ({', '.join(sorted(data))}); "
                               "name the one to use 'logits'")
        data = data.get("logits", next(iter(data.values())))
    try:
        mx.eval(data)                       # (MLX reads a .npy lazily: a short file fails here, not in the program)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
        raise SamplecError(f"{flag}: cannot read {path}: {_reader_error(e, path)}") from None
    return data


def _reader_error(e: Exception, path: Path) -> str:
    """MLX's reader message, or what it means where the message is a bare C++ exception name or MLX's inside."""
    text = str(e)
    if text in ("stoi", "stol", "stoll", "stoul", "stoull") or not text:
        return "a malformed header"
    kind = text.removeprefix("[from_str] Unsupported array protocol type-string: ")
    if kind != text:
        kind = kind.strip("'\"|<>=")
        what = "Python objects (dtype object)" if kind == "O" else f"items of dtype {kind!r}"
        return f"its array holds {what}; numbers are needed (float32, float16, bfloat16, integers, bool)"
    magic = {".npy": b"\x93NUMPY", ".npz": b"PK", }.get(path.suffix.lower())
    if magic is not None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(magic))
        except OSError:
            head = magic
        if head != magic:
            return f"not a {path.suffix} file (it does not start as one)"
    if "python stream" in text or "python file object" in text:   # (MLX's words for an .npz member that is no .npy)
        return "an array in it is not a .npy array (a damaged or hand-made .npz?)"
    if text.startswith("Unable to read") or text.startswith("[read] Unable to read"):
        return "the file ends before its data does (truncated?)"
    return text.removeprefix("[read] ").removeprefix("[load] ")


def param_of_kind(prog: Program, kind: str, flag: str) -> str:
    """The sampler's one parameter of `kind`, which --seed/--history/--mask/--bias give (spec §5); none, or more than
    one, is an error naming the --param of each (the seed `sample()` draws from the OS is one of the seeds)."""
    from samplec.frontend.lower import OS_SEED
    names = [p.name for p in prog.params if p.kind == kind]
    if len(names) != 1:
        value = "N" if kind == "seed" else "FILE.npy"
        each = ", ".join(f"--param {n}={value}" + (" for the seed of sample()" if n == OS_SEED else "")
                         for n in names)
        what = f"no parameter of type {kind}" if not names else f"{len(names)} parameters of type {kind}: pass " \
               f"each by name ({each})"
        raise SamplecError(f"{flag}: the sampler has {what}" + ("; use --param NAME=VALUE" if not names else ""))
    return names[0]


def parse_value(prog: Program, name: str, text: str, flag: str | None = None):
    """A --param value: a number or a comma-separated list (one per row), typed by the parameter. `flag`: how the
    value was given, for the error messages (default `--param NAME`)."""
    label = flag or f"--param {name}"
    params = {p.name: p for p in prog.params}
    if name not in params:
        raise SamplecError(f"{label}: no such parameter (parameters: {', '.join(params) or 'none'})")
    p = params[name]
    if p.kind not in ("float", "int", "seed", "state"):
        raise SamplecError(f"{label}: a {p.kind} parameter takes a .npy file (--history/--mask/--bias)")
    items = [t.strip() for t in str(text).split(",")]
    try:
        vals = [float(t) if p.kind in ("float", "state") else _integer(t) for t in items]
    except ValueError:
        raise SamplecError(f"{label}: expected {'numbers' if p.kind in ('float', 'state') else 'integers'}, "
                           f"got {text!r}") from None
    return vals[0] if len(vals) == 1 else vals


def os_seed_drawn(prog: Program, values: dict, B: int) -> tuple[str, str] | None:
    """Where `prog` draws from `sample()` without a seed and `values` gives none: seeds drawn from the OS now, one a
    row, put into `values`, and the flag and text that give them again (`--seed`, or `--param _os_seed=` beside
    another seed parameter); else None."""
    from samplec.frontend.lower import OS_SEED
    from samplec.program import _os_seeds
    if OS_SEED not in {p.name for p in prog.params} or OS_SEED in values:
        return None
    seeds = [int(s) for s in _os_seeds(B)]
    values[OS_SEED] = seeds[0] if B == 1 else seeds
    flag = "--seed" if [p.kind for p in prog.params].count("seed") == 1 else f"--param {OS_SEED}="
    return flag, ",".join(map(str, seeds))


def parse_params(prog: Program, pairs: dict[str, str]) -> dict:
    return {name: parse_value(prog, name, value) for name, value in pairs.items()}


def _strict(v) -> list:
    """An array as JSON lists; -inf (a removed token's log-probability) as null: strict JSON has no infinities."""
    a = np.array(v)
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        return np.where(np.isfinite(a), a.astype(np.float64), None).tolist()
    return a.tolist()


def to_json(out: Outputs, strict: bool = True) -> dict:
    """The outputs as lists by name (`top_logprobs`, `candidates`: {"ids", "values"}); `strict`: JSON values,
    which `json.dumps(..., allow_nan=False)` writes (-inf as null)."""
    listed = _strict if strict else (lambda v: np.array(v).tolist())
    res = {}
    for name in out.names():
        v = getattr(out, name)
        if name in ("top_logprobs", "candidates"):
            res[name] = {"ids": listed(v.ids), "values": listed(v.values)}
        else:
            res[name] = listed(v)
    return res


def format_outputs(out: Outputs) -> str:
    lines = []
    data = to_json(out, strict=False)
    rows = len(next(iter(data.values()))["ids"] if isinstance(next(iter(data.values())), dict)
               else next(iter(data.values())))
    for r in range(rows):
        lines.append(f"row {r}:")
        for name, v in data.items():
            if isinstance(v, dict):
                pairs = ", ".join(f"{i}:{x:.6g}" for i, x in zip(v["ids"][r], v["values"][r]))
                lines.append(f"  {name:12} {pairs}")
            elif name == "probs":
                p = np.array(v[r])
                top = [i for i in np.argsort(-p, kind="stable")[:8] if p[i] > 0]   # (the 8 most probable kept)
                lines.append(f"  {name:12} " + ", ".join(f"{i}:{p[i]:.6g}" for i in top)
                             + f"  ({int((p > 0).sum())} tokens > 0)")
            else:
                lines.append(f"  {name:12} {v[r]}")
    return "\n".join(lines)


# ---- repeated draws --------------------------------------------------------------------------------------------

def _token_distribution(graph: Graph) -> Graph:
    """The program with its token output replaced by the exact final distribution the token is drawn from."""
    from samplec.frontend.lower import softmax
    from samplec.ir.graph import make
    token = dict(graph.outputs).get("token")
    if token is None:
        raise SamplecError("--draws needs a sampler with a 'token' output")
    am = token.inputs[0]                      # squeeze(sample | greedy | argmax(...))
    arg = am.inputs[0]
    if am.op == "sample":
        dist = softmax(arg, "probs")
    elif am.op == "greedy":
        dist = make("cast", make("eq", make("iota", arg), make("argmax", arg)), dtype="f32")
    elif arg.op == "add" and any(_is_noise(i) for i in arg.inputs):
        x = next(i for i in arg.inputs if not _is_noise(i))
        dist = softmax(x, "probs")
    else:                                     # greedy: all the mass on the argmax
        dist = make("cast", make("eq", make("iota", arg), am), dtype="f32")
    states = tuple((k, n) for k, n in graph.outputs if k in {p.name for p in graph.params if p.kind == "state"})
    return Graph(graph.name, graph.params, (("token", token), ("probs", dist)) + states, graph.checks)


def _is_noise(n) -> bool:
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m.op == "random_bits":
            return True
        if id(m) not in seen:
            seen.add(id(m))
            stack.extend(m.inputs)
    return False


def draws(prog: Program, logits: mx.array, values: dict, n: int) -> dict:
    """Sample n times with seeds seed..seed+n-1 (every seed parameter advanced together). A sampler with a state
    output (mirostat's mu) draws step after step, each draw's state feeding the next; its exact probability is
    then the mean over the steps of each step's distribution (what the frequencies converge to)."""
    from samplec.program import _scalar_param
    dist_prog = Program(_token_distribution(prog.stage_graph), target=prog.target)
    x = logits if logits.ndim == 2 else logits[None, :]
    B, V = x.shape
    seeds = [p for p in prog.params if p.kind == "seed"]
    if any(n.op == "const" and n.type.dtype == U64 for n in prog.stage_graph.nodes()):
        raise SamplecError("--draws advances the sampler's seed parameters, and a seed of this program is a constant "
                           "(a literal seed, or one bound with --set): its draws would repeat one another, not "
                           "sample the distribution; make every seed a `seed` parameter passed at run time")
    # (a sampler without randomness -- greedy, temperature 0 -- gives the same token every draw: that is its answer)
    base = {p.name: _scalar_param(p, values.get(p.name, 0 if p.default in (None, "os") else p.default), B)
            for p in seeds}
    threaded = [k for k, _ in dist_prog.graph.outputs if k not in ("token", "probs")]
    state: dict = {}
    chunk = 1 if threaded else max(1, min(n, DRAW_CHUNK_FLOATS // max(1, B * V)))
    counts = np.zeros((B, V), dtype=np.int64)
    probs = None
    from rich.console import Console
    from rich.progress import Progress
    console = Console(stderr=True)      # (a progress display only on a terminal: elsewhere it leaves a blank line)
    with Progress(transient=True, disable=n <= chunk or not console.is_terminal, console=console) as bar:
        task = bar.add_task("drawing", total=n)
        for start in range(0, n, chunk):
            c = min(chunk, n - start)
            call = {}
            for name, v in values.items():
                if name in base:
                    continue
                arr = v if isinstance(v, mx.array) else np.asarray(v)
                call[name] = _repeat_rows(arr, B, c)
            for name, b in base.items():
                offs = np.arange(start, start + c, dtype=np.uint64)
                call[name] = (b[:, None] + offs[None, :]).reshape(-1)
            call.update(state)
            out = dist_prog(_repeat_rows(x, B, c), **call)
            state = {k: getattr(out, k) for k in threaded}
            toks = np.array(out.token).reshape(B, c)
            for r in range(B):
                np.add.at(counts[r], toks[r], 1)
            if threaded:
                probs = (0 if probs is None else probs) + np.array(out.probs, dtype=np.float64) / n
            elif probs is None:
                probs = np.array(out.probs).reshape(B, c, V)[:, 0, :]
            bar.advance(task, c)
    rows = []
    for r in range(B):
        drawn = np.nonzero(counts[r])[0]
        likely = np.argsort(-probs[r], kind="stable")[:10]
        ids = sorted(set(drawn.tolist()) | {int(i) for i in likely if probs[r, i] > 0},
                     key=lambda i: (-counts[r, i], -probs[r, i], i))
        rows.append({"tokens": ids, "counts": [int(counts[r, i]) for i in ids],
                     "frequency": [counts[r, i] / n for i in ids],
                     "probability": [float(probs[r, i]) for i in ids]})
    return {"draws": n, "rows": rows}


def _repeat_rows(arr, B: int, c: int):
    """Repeat each row c times (row r becomes rows r*c .. r*c+c-1); scalars pass through."""
    if isinstance(arr, mx.array):
        if arr.ndim == 0:
            return arr
        if arr.ndim == 1 and arr.shape[0] != B:
            arr = mx.broadcast_to(arr[None], (B, arr.shape[0]))
        return mx.repeat(arr, c, axis=0)
    arr = np.asarray(arr)
    if arr.ndim == 0:
        return arr
    if arr.ndim == 1 and arr.shape[0] != B:
        arr = np.broadcast_to(arr[None], (B, arr.shape[0]))
    return np.repeat(arr, c, axis=0)


def format_draws(result: dict) -> str:
    n = result["draws"]
    lines = []
    for r, row in enumerate(result["rows"]):
        lines.append(f"row {r}: {n} draws")
        lines.append(f"  {'token':>8} {'count':>8} {'frequency':>10} {'probability':>12}")
        for t, c, f, p in zip(row["tokens"], row["counts"], row["frequency"], row["probability"]):
            lines.append(f"  {t:>8} {c:>8} {f:>10.4f} {p:>12.4f}")
        lines.append(f"  chi-square vs probability over drawn tokens: {_chi2(row, n):.2f}")
    return "\n".join(lines)


def _chi2(row: dict, n: int) -> float:
    return float(sum((c - n * p) ** 2 / (n * p) for c, p in zip(row["counts"], row["probability"]) if p > 0))


__all__ = ["load_array", "parse_params", "parse_value", "param_of_kind", "draws", "format_draws",
           "to_json", "format_outputs"]
