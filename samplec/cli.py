"""The `samplec` command line (docs/cli.md): compile, run, inspect, import, passes, doctor, --version.

Every user error is printed as a diagnostic (`file:line:col: error: ...` with a caret for source errors) and
exits with status 1; nothing is written on failure and no traceback is shown (set SAMPLEC_DEBUG=1 to see one).
Exit status: 0 done, 1 an error in what was given (source, program, values, files), 2 a usage error (unknown
flag, missing argument: click's convention), 3 an internal error (a bug: please report it).
"""
from __future__ import annotations

import errno
import json
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer

from samplec.diagnostics import SamplecError, SamplecWarning
from samplec.files import compiled, read_file, read_source, write_atomic

# (rich_markup_mode=None: plain help -- typer's rich panels list every flag as taking a `<bool>`)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="samplec: compile LLM sampler chains (.smp) into optimized MLX programs (.smpb).")


def _echo(message: str = "", nl: bool = True, err: bool = False):
    """Write a line to standard output (or error). Not click's echo: its stream wrapper swallows a broken pipe, so
    `samplec run ... | head -1` ended with exit 0 and its output cut; here the reader leaving raises
    BrokenPipeError, which ends samplec with SIGPIPE's status (141)."""
    stream = sys.stderr if err else sys.stdout
    text = message + ("\n" if nl else "")
    for at in range(0, len(text) or 1, 1 << 16):  # (in pieces: one large write that the pipe takes in part and
        stream.write(text[at:at + (1 << 16)])     # then refuses ends without an error in CPython)
        stream.flush()


_python_showwarning = warnings.showwarning
_shown_warnings: set[str] = set()


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """warnings.showwarning for the CLI: a source warning prints as it renders (file:line:col and its caret), once
    (--emit dot and --print-after-all compile twice); any other warning as Python prints it."""
    if not issubclass(category, SamplecWarning):
        return _python_showwarning(message, category, filename, lineno, file, line)
    if str(message) not in _shown_warnings:
        _shown_warnings.add(str(message))
        _echo(str(message), err=True)


def _fail(message: str, code: int = 1):
    _echo(message, err=True)
    raise typer.Exit(code)


def _guard(fn):
    """Turn every error into a message and an exit status; never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except SamplecError as e:
            _fail(e.render())
        except SamplecWarning as w:         # (python -W error: the warning is the error)
            _fail(str(w))
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except BrokenPipeError:             # (`samplec run ... | head -1`: the reader left; so does samplec, quietly)
            _reader_left()
        except OSError as e:                # (the output could not be written: a full disk, /dev/full; a port in use)
            if os.environ.get("SAMPLEC_DEBUG"):
                raise
            _fail(_os_error(e))
        except Exception as e:  # noqa: BLE001 - the CLI promises no tracebacks
            if os.environ.get("SAMPLEC_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set SAMPLEC_DEBUG=1 for a traceback)", 3)
    return wrapper


def _reader_left():
    """The reader of standard output went away: exit quietly with SIGPIPE's status (no flush error at exit)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(141)


def _os_error(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        return f"error: cannot write the output: {e.strerror or e}"
    return f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def _out_file(value: str | None) -> Path | None:
    """An -o value as a path: an empty one is an error of its own (a Path would read it as '.')."""
    if value == "":
        raise SamplecError("-o: an empty file name")
    return None if value is None else Path(value)


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SamplecError(f"{flag} expects NAME=VALUE, got {item!r}")
        if name.strip() in out:
            raise SamplecError(f"{flag} {name.strip()}: given twice ({out[name.strip()]!r} and {value.strip()!r})")
        out[name.strip()] = value.strip()
    return out


def _load_program(path: Path, sampler: str | None, opt: int | None, bindings: dict | None = None,
                  target: str | None = None):
    """A .smp source compiled at `opt` (None: -O2), or a compiled .smpb (which takes no --sampler, --set or -O),
    for `target`."""
    import samplec
    if not path.exists():
        raise SamplecError(f"{path}: no such file")
    if _is_compiled(path):
        if sampler or bindings or opt is not None:
            given = "--sampler" if sampler else "--set" if bindings else "-O"
            raise SamplecError(f"{given} applies to a .smp source; {path} is a compiled program (.smpb): its "
                               "sampler, bindings and optimization level were chosen when it was compiled")
        return samplec.load(path, target=target)
    return samplec.compile_file(path, sampler=sampler, opt_level=2 if opt is None else opt, bindings=bindings,
                                target=target)


def _is_compiled(path: Path) -> bool:
    """A compiled program: a .smpb, or a file of another name that starts as one (`files.compiled`)."""
    if path.suffix == ".smpb":
        return True
    try:
        if not path.is_file():          # (a FIFO or a device is never opened here)
            return False
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return False
    return compiled(head)


@app.command("compile")
@_guard
def compile_cmd(
    file: Path = typer.Argument(..., metavar="FILE", help="the .smp source"),
    more_sets: Optional[List[str]] = typer.Argument(None, metavar="[NAME=VALUE]...",
                                                     help="more --set bindings: --set a=1 b=2"),
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="FILE", help="where to write the .smpb "
                                          "(default: FILE with the suffix .smpb); with --emit, where to write what "
                                          "it emits (default: standard output)"),
    sampler: Optional[str] = typer.Option(None, "--sampler", help="which sampler of the file (default: the first)"),
    opt: int = typer.Option(2, "-O", help="optimization level: -O0, -O1 or -O2", min=0, max=2),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="bind a parameter at compile time: NAME=VALUE"),
    emit: Optional[str] = typer.Option(None, "--emit", help="emit ir | ir-unopt | dot | svg | png instead of the "
                                       ".smpb (svg/png need graphviz's dot)"),
    print_after_all: bool = typer.Option(False, "--print-after-all",
                                         help="print the IR after each pass that changed it"),
    print_diff: bool = typer.Option(False, "--print-diff",
                                    help="like --print-after-all, as a unified diff against the IR before the pass"),
    target: Optional[str] = typer.Option(None, "--target", help="auto | cpu | cuda | metal | portable: the device "
                                         "whose kernels run the program (default: SAMPLEC_TARGET, else auto)"),
):
    """Compile a .smp sampler into a .smpb program."""
    import samplec.api as api
    from samplec.ir.printer import print_graph
    output = _out_file(output)
    if emit not in (None, "ir", "ir-unopt", "dot", "svg", "png"):
        raise SamplecError(f"--emit must be ir, ir-unopt, dot, svg or png, got {emit!r}")
    bindings = _pairs(list(set_ or []) + list(more_sets or []), "--set")
    after = None
    if print_after_all and print_diff:
        raise SamplecError("--print-after-all and --print-diff: pass one (--print-diff prints each pass as a diff)")
    if print_after_all or print_diff:
        source = read_source(file)
        after = _PassPrinter(print_graph(api.lower_source(source, sampler, bindings, filename=str(file))[0]),
                             print_diff, err=emit is None)
    if emit == "ir-unopt":
        source = read_source(file)
        graph, _ = api.lower_source(source, sampler, bindings, filename=str(file))
        return _emit_text(print_graph(graph), output, file)
    prog = api.compile_file(file, sampler=sampler, opt_level=opt, bindings=bindings, after_pass=after, target=target)
    if after is not None:
        after.finish()
    if emit == "ir":
        _emit_text(prog.ir(), output, file)
    elif emit in ("dot", "svg", "png"):
        _emit_picture(file, sampler, opt, bindings, emit, output)
    else:
        out = output or file.with_suffix(".smpb")
        from samplec.serialize import save
        size = save(prog.stage_graph, out, not_over=file, target=prog.target)
        _echo(f"wrote {out} ({size} bytes, {len(prog.stage_graph.toposort())} nodes, target {prog.target})", err=True)


def _emit_text(text: str, output: Path | None, source: Path) -> None:
    """What --emit gives as text: to `output` (written whole, or not at all), else standard output."""
    if output is None:
        _echo(text, nl=False)
        return
    write_atomic(output, text.encode(), not_over=source)
    _echo(f"wrote {output}", err=True)


class _PassPrinter:
    """The `after` hook of --print-after-all / --print-diff: prints the IR (or its diff) after each pass that changed
    it, and at the end one line naming the passes that changed nothing."""

    def __init__(self, initial: str, diff: bool, err: bool):
        self.text, self.diff, self.err, self.unchanged = initial, diff, err, []

    def __call__(self, name: str, graph) -> None:
        import difflib
        from samplec.ir.printer import print_graph
        text = print_graph(graph)
        if text == self.text:
            self.unchanged.append(name)
            return
        if self.diff:
            body = "".join(difflib.unified_diff(self.text.splitlines(keepends=True), text.splitlines(keepends=True),
                                                fromfile=f"before {name}", tofile=f"after {name}"))
            _echo(body, nl=False, err=self.err)
        else:
            _echo(f"// ---- after {name} ----\n{text}", nl=False, err=self.err)
        self.text = text

    def finish(self) -> None:
        _echo(f"// ---- passes that changed nothing: {' '.join(self.unchanged) or '(none)'}", err=self.err)


def _emit_picture(file: Path, sampler, opt: int, bindings: dict, emit: str, output: Path | None) -> None:
    """--emit dot|svg|png: the graph clustered by source stage (samplec/explain.py), to `output` or standard
    output (png only to a file or a pipe)."""
    from samplec import explain as ex
    source = _read_source(file)
    dot = ex.render_dot(ex.explain(source, sampler, opt, bindings, filename=str(file)))
    data = dot.encode() if emit == "dot" else ex.render_image(dot, emit)
    if output is not None:
        write_atomic(output, data, not_over=file)
        _echo(f"wrote {output}", err=True)
    elif emit == "png" and sys.stdout.isatty():
        raise SamplecError("--emit png writes binary data: redirect it to a file (> graph.png) or give -o FILE.png")
    elif emit == "png":
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        _echo(data.decode(), nl=False)


def _read_source(file: Path) -> str:
    if file.suffix == ".smpb":
        raise SamplecError(f"{file} is a compiled program; explain reads the .smp source it was compiled from")
    return read_source(file)


@app.command()
@_guard
def explain(
    file: Path = typer.Argument(..., metavar="FILE", help="the .smp source"),
    sampler: Optional[str] = typer.Option(None, "--sampler", help="which sampler of the file (default: the first)"),
    opt: int = typer.Option(2, "-O", help="optimization level: -O0, -O1 or -O2", min=0, max=2),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="bind a parameter at compile time: NAME=VALUE"),
    native: str = typer.Option("auto", "--native", help="the kernels on the CPU: with the native primitives "
                               "(on), without (off), or as installed here (auto)"),
    emit: str = typer.Option("text", "--emit", help="text | dot | svg | png (svg/png need graphviz's dot)"),
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="FILE",
                                         help="write the text or picture to this file"),
    target: Optional[str] = typer.Option(None, "--target", help="auto | cpu | cuda | metal | portable: the device "
                                         "whose kernels run the program (default: SAMPLEC_TARGET, else auto)"),
):
    """Show what the optimizer did to each stage as written, and which kernels run it."""
    from samplec import explain as ex
    output = _out_file(output)
    if emit not in ("text", "dot", "svg", "png"):
        raise SamplecError(f"--emit must be text, dot, svg or png, got {emit!r}")
    if native not in ("auto", "on", "off"):
        raise SamplecError(f"--native must be auto, on or off, got {native!r}")
    bindings = _pairs(set_, "--set")
    if emit != "text":
        _emit_picture(file, sampler, opt, bindings, emit, output)
        return
    source = _read_source(file)
    text = ex.render_text(ex.explain(source, sampler, opt, bindings, filename=str(file),
                                     native=None if native == "auto" else native == "on", target=target))
    if output is not None:
        write_atomic(output, text.encode(), not_over=file)
    else:
        _echo(text, nl=False)


@app.command()
@_guard
def inspect(file: Path = typer.Argument(..., metavar="FILE", help="a compiled .smpb program"),
            target: Optional[str] = typer.Option(None, "--target", help="lower for this target (default: the "
                                                 "recorded one where it runs here, else auto)")):
    """Print the IR of a compiled program, as lowered for the target it runs on."""
    import samplec
    data = read_file(file)
    if file.suffix == ".smp" or b"sampler " in data[:4096] and not compiled(data):
        raise SamplecError(f"{file} is a .smp source; `inspect` reads compiled .smpb programs. To see its IR, "
                           f"run `samplec compile {file} --emit ir`")
    prog = samplec.load(file, target=target)
    _echo(prog.ir(), nl=False)


@app.command("import", context_settings={"ignore_unknown_options": True})
@_guard
def import_cmd(
    inputs: Optional[List[str]] = typer.Argument(None, metavar="FILE | - | -- FLAGS...",
                                                  help="the settings file, - for standard input, or (llama-cpp) "
                                                       "the flags themselves after --"),
    source: str = typer.Option(..., "--from", help="hf | llama-cpp | openai | mlx-lm | vllm"),
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="FILE",
                                          help="write the .smp to this file (atomically) instead of printing it"),
):
    """Print an equivalent .smp sampler for another system's sampling settings.

    samplec import --from hf generation_config.json; samplec import --from vllm - < params.json;
    samplec import --from llama-cpp -- --top-k 40 --temp 0.7
    """
    from samplec.importers import KINDS, _kind, from_llama_cpp, import_source
    output = _out_file(output)
    kind = _kind(source)
    items = list(inputs or [])
    if not items:
        raise SamplecError(f"import --from {kind}: give a FILE ({KINDS[kind]}) or - for standard input"
                           + (", or the flags after --: samplec import --from llama-cpp -- --top-k 40"
                              if kind == "llama-cpp" else ""))
    if kind == "llama-cpp" and (len(items) > 1 or items[0].startswith("-") and items[0] != "-"):
        try:
            text = from_llama_cpp(items)
        except SamplecError as e:
            raise SamplecError(f"<command line>: {e}") from None
    elif len(items) != 1:
        raise SamplecError(f"import --from {kind}: expected one FILE (or -), got {len(items)} arguments: "
                           + " ".join(items))
    else:
        text = import_source(kind, items[0])
    if output is None:
        _echo(text, nl=False)
        return
    source = Path(items[0]) if len(items) == 1 and items[0] != "-" and Path(items[0]).exists() else None
    write_atomic(output, text.encode(), not_over=source)
    _echo(f"wrote {output}", err=True)


@app.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@_guard
def serve(
    mlx_lm_args: Optional[List[str]] = typer.Argument(None, metavar="[SERVER FLAGS]...",
                                                       help="server flags: --model, --host, --port, --max-batch, "
                                                            "--draft-model, --num-draft, --rank-timeout, "
                                                            "--chat-template, --chat-template-args, "
                                                            "--tool-call-parser, --responses-store"),
    sampler: Optional[List[str]] = typer.Option(None, "--sampler", help="a chain FILE.smp[:NAME] (repeatable; the "
                                                "first is the default, a request names another with "
                                                "\"samplec_sampler\")"),
    demo: bool = typer.Option(False, "--demo", help="serve samplec's small random model (no download)"),
):
    """Run an OpenAI-compatible server sampling with samplec: one program call per step for the whole batch,
    per-request values and seeds, seeded and structured requests batched (docs/serve.md)."""
    from samplec.serve import serve as run_server
    run_server(list(mlx_lm_args or []), list(sampler or []), demo,
               ready=lambda httpd, _: _echo(f"samplec serve: listening on http://{httpd.server_address[0]}:"
                                            f"{httpd.server_address[1]}" if httpd is not None else
                                            "samplec serve: following rank 0's steps", err=True))


def _version_text() -> str:
    import samplec
    try:
        import mlx.core as mx
        mlx_version = getattr(mx, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - a broken MLX is reported, not raised
        mlx_version = f"not available ({type(e).__name__}: {e})"
    return f"samplec {samplec.__version__} (MLX {mlx_version})"


def _version_callback(value: bool):
    if value:
        _echo(_version_text())
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="print samplec's and MLX's versions and exit")):
    """samplec: compile LLM sampler chains (.smp) into optimized MLX programs (.smpb)."""
    warnings.showwarning = _show_warning


@app.command()
def doctor():
    """Report the installation: versions, MLX's default device, the native primitives and the settings."""
    for line in doctor_report():
        _echo(line)


def doctor_report() -> list[str]:
    """What `samplec doctor` prints. Never raises: whatever is missing or broken is reported as such."""
    import platform
    lines = []
    try:
        import samplec
        lines.append(f"samplec         {samplec.__version__} ({Path(samplec.__file__).parent})")
    except Exception as e:  # noqa: BLE001 - the report goes on
        lines.append(f"samplec         cannot import: {type(e).__name__}: {e}")
    lines.append(f"python          {platform.python_version()} ({sys.executable})")
    mx = None
    try:
        import mlx.core as mx
        lines.append(f"mlx             {getattr(mx, '__version__', 'unknown')}")
        lines.append(f"default device  {mx.default_device()}")
        try:
            from samplec.passes.target import resolve
            env_target = os.environ.get("SAMPLEC_TARGET")
            lines.append(f"target          {resolve('auto')} (auto{': SAMPLEC_TARGET=' + env_target if env_target else ''}"
                         "; compile --target or samplec.compile(..., target=) to choose)")
        except Exception as e:  # noqa: BLE001
            lines.append(f"target          {e}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"mlx             not available ({type(e).__name__}: {e}); samplec needs it to run programs")
    env_native, env_spin = os.environ.get("SAMPLEC_NATIVE"), os.environ.get("SAMPLEC_SPIN")
    if mx is not None:
        try:
            from samplec.backend_mlx import native
            mod = native._native
            if mod is None:
                lines.append("native          not installed (optional: pip install --no-build-isolation ./native); "
                             "the MLX-ops kernels serve")
            else:
                prims = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))
                if native.enabled():
                    state = "active: these primitives serve the CPU kernels"
                elif native.switched_off("SAMPLEC_NATIVE"):
                    state = f"loaded but off (SAMPLEC_NATIVE={env_native})"
                else:
                    state = f"loaded but off (the default device is {mx.default_device()}, not the CPU)"
                lines.append(f"native          {state} ({getattr(mod, '__file__', '?')})")
                lines.append(f"  primitives    {', '.join(prims)}")
                lines.append(f"  spin-wait     {'on' if native._polling() else 'off'} (off on one core, off the "
                             "CPU, or with SAMPLEC_SPIN=0); while it waits the caller takes parts of the kernels' "
                             f"work ({native.helped()} so far in this process)")
            from samplec.passes.target import partitions, resolve
            if native.enabled():
                chains = "the native chain kernel (sample_chain), per row"
                unknown = [s for s in native.CHAIN_STAGES if not native.knows_stages([s])]
                chains += f" (this build predates {', '.join(unknown)}: those run by their dense definitions; " \
                          "rebuild samplec-native)" if unknown else f" ({', '.join(native.CHAIN_STAGES)})"
            elif resolve() == "portable" and partitions():
                chains = "the portable lowering in MLX ops: on this CPU a chain of top_k, top_p, min_p and " \
                         "temperature and its draw on the row's 4096 largest values (a partition; a row they may " \
                         "not hold runs again sorted), any other chain one sort of its row"
            else:
                chains = "the portable lowering in MLX ops: one sort of values a chain, every cut a threshold on it"
            lines.append(f"stage chains    {chains}; at -O1, top_k/top_p/typical_p/top_logprobs select without a "
                         "sort (kth_largest, mass_threshold: rounds of a comparison and a reduction in MLX ops, one "
                         "key bit a round on the CPU, several on a GPU)")
        except Exception as e:  # noqa: BLE001
            lines.append(f"native          cannot check: {type(e).__name__}: {e}")
        try:
            from samplec.backend_mlx import gpu
            lines.append(f"cuda kernels    {gpu.path_report()}")
        except Exception as e:  # noqa: BLE001
            lines.append(f"cuda kernels    cannot check: {type(e).__name__}: {e}")
    lines.append(f"SAMPLEC_NATIVE  {env_native if env_native is not None else '(unset: on)'}")
    lines.append(f"SAMPLEC_SPIN    {env_spin if env_spin is not None else '(unset: on)'}")
    env_gpu = os.environ.get("SAMPLEC_GPU_KERNELS")
    lines.append(f"SAMPLEC_GPU_KERNELS {env_gpu if env_gpu is not None else '(unset: on)'}")
    env_chain = os.environ.get("SAMPLEC_GPU_CHAIN")
    lines.append(f"SAMPLEC_GPU_CHAIN {env_chain if env_chain is not None else '(unset: on)'}")
    return lines


@app.command()
@_guard
def passes():
    """List the passes, the -O pipelines and the target passes that follow them."""
    from samplec.passes import PASSES, PIPELINES, TARGET_PASSES
    from samplec.passes.target import resolve
    for p in [*PASSES.values(), *TARGET_PASSES.values()]:
        _echo(f"{p.name:16} {p.doc}")
    for level, names in PIPELINES.items():
        _echo(f"-O{level}: {' '.join(names) or '(none)'}, then target-{{cpu|cuda|metal|portable}}")
    _echo(f"target here (auto): {resolve('auto')}")


@app.command()
@_guard
def run(
    file: Path = typer.Argument(..., metavar="FILE", help="a .smp source or a compiled .smpb"),
    more_params: Optional[List[str]] = typer.Argument(None, metavar="[NAME=VALUE]...",
                                                       help="more --param values: --param a=1 b=2"),
    logits: Path = typer.Option(..., "--logits", help=".npy, .npz or .safetensors; shape [V] or [B, V]"),
    sampler: Optional[str] = typer.Option(None, "--sampler"),
    opt: Optional[int] = typer.Option(None, "-O", min=0, max=2, help="optimization level for a .smp source (default 2)"),
    param: Optional[List[str]] = typer.Option(None, "--param", help="NAME=VALUE, or NAME=V1,V2,... per row"),
    seed: Optional[str] = typer.Option(None, "--seed", help="the sampler's seed parameter"),
    history: Optional[Path] = typer.Option(None, "--history", help=".npy int token history [B, H]"),
    mask: Optional[Path] = typer.Option(None, "--mask", help=".npy bool mask [B, V] or packed int32 bitmask"),
    bias: Optional[Path] = typer.Option(None, "--bias", help=".npy float32 bias [B, V]"),
    draws: Optional[int] = typer.Option(None, "--draws", min=1, help="sample N times with seeds seed..seed+N-1"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    target: Optional[str] = typer.Option(None, "--target", help="auto | cpu | cuda | metal | portable (default: "
                                         "SAMPLEC_TARGET, else auto; a .smpb: its recorded target where it runs)"),
):
    """Run a sampler on a logits file."""
    from samplec import runner
    prog = _load_program(file, sampler, opt, target=target)
    import mlx.core as mx
    x = runner.load_array(logits, "--logits")
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16, mx.float64):
        raise SamplecError(f"--logits {logits}: expected float32, float16 or bfloat16 logits (or float64), got "
                           f"{str(x.dtype).removeprefix('mlx.core.')}")
    pairs = _pairs(list(param or []) + list(more_params or []), "--param")
    arrays = {n: v for n, v in pairs.items() if n in _array_params(prog)}   # --param NAME=FILE.npy
    values = runner.parse_params(prog, {n: v for n, v in pairs.items() if n not in arrays})
    values.update({n: runner.load_array(Path(v), f"--param {n}") for n, v in arrays.items()})
    for flag, kind, value in (("--seed", "seed", seed), ("--history", "tokens", history),
                              ("--mask", "mask", mask), ("--bias", "bias", bias)):
        if value is not None:
            name = runner.param_of_kind(prog, kind, flag)
            if name in values:
                raise SamplecError(f"{flag} and --param {name} give the same parameter: pass one")
            values[name] = runner.parse_value(prog, name, value, flag=flag) if kind == "seed" else \
                runner.load_array(value, flag)
    _check_required(prog, values, seeds_given_by_draws=bool(draws))
    if draws:
        result = runner.draws(prog, x, values, draws)
        _echo(json.dumps(result, allow_nan=False) if as_json else runner.format_draws(result))
        return
    drawn = runner.os_seed_drawn(prog, values, x.shape[0] if x.ndim == 2 else 1)
    if drawn is not None:       # (`sample()` without a seed: the run says the seed it drew, to be run again)
        flag, seeds = drawn
        print(f"seed drawn from the OS: {seeds} ({flag}{'' if flag.endswith('=') else ' '}{seeds} runs this draw "
              "again)", file=sys.stderr)
    out = prog(x, **values)
    _echo(json.dumps(runner.to_json(out), allow_nan=False) if as_json else runner.format_outputs(out))


_FLAG_OF_KIND = {"seed": "--seed N", "tokens": "--history FILE.npy", "mask": "--mask FILE.npy",
                 "bias": "--bias FILE.npy"}


def _array_params(prog) -> set[str]:
    return {p.name for p in prog.params if p.kind in ("tokens", "mask", "bias")}


def _check_required(prog, values: dict, seeds_given_by_draws: bool = False) -> None:
    """A required parameter left out: name the flag that gives it."""
    for p in prog.params:
        if p.default is not None or p.name in values or (seeds_given_by_draws and p.kind == "seed"):
            continue
        same_kind = [q for q in prog.params if q.kind == p.kind]
        value = "N" if p.kind in ("seed", "int") else "X" if p.kind == "float" else "FILE.npy"
        how = f"--param {p.name}={value}"
        if p.kind in _FLAG_OF_KIND and len(same_kind) == 1:
            how = f"{_FLAG_OF_KIND[p.kind]} (or {how})"
        raise SamplecError(f"missing required parameter '{p.name}' ({p.kind}): pass {how}")


def main():
    try:
        app()
    except BrokenPipeError:             # (--help, --version, doctor: outside _guard)
        _reader_left()
    except OSError as e:
        if os.environ.get("SAMPLEC_DEBUG"):
            raise
        print(_os_error(e), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
