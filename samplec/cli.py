"""The `samplec` command line (spec §5): compile, run, inspect, import, passes.

Every user error is printed as a diagnostic (`file:line:col: error: ...` with a caret for source errors) and
exits with status 1; nothing is written on failure and no traceback is shown (set SAMPLEC_DEBUG=1 to see one).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from samplec.diagnostics import SamplecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="samplec: compile LLM sampler chains (.smp) into optimized MLX programs (.smpb).")


def _fail(message: str, code: int = 1):
    typer.echo(message, err=True)
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
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as e:  # noqa: BLE001 - the CLI promises no tracebacks
            if os.environ.get("SAMPLEC_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set SAMPLEC_DEBUG=1 for a traceback)", 2)
    return wrapper


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SamplecError(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _load_program(path: Path, sampler: str | None, opt: int, bindings: dict | None = None):
    import samplec
    if not path.exists():
        raise SamplecError(f"{path}: no such file")
    if path.suffix == ".smpb":
        if sampler or bindings:
            raise SamplecError("--sampler and --set apply to .smp sources, not to a compiled .smpb")
        return samplec.load(path)
    return samplec.compile_file(path, sampler=sampler, opt_level=opt, bindings=bindings)


@app.command("compile")
@_guard
def compile_cmd(
    file: Path = typer.Argument(..., help="the .smp source"),
    more_sets: Optional[List[str]] = typer.Argument(None, metavar="[NAME=VALUE]...",
                                                     help="more --set bindings: --set a=1 b=2"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="where to write the .smpb "
                                          "(default: FILE with the suffix .smpb; nothing is written with --emit)"),
    sampler: Optional[str] = typer.Option(None, "--sampler", help="which sampler of the file (default: the first)"),
    opt: int = typer.Option(2, "-O", help="optimization level: -O0, -O1 or -O2", min=0, max=2),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="bind a parameter at compile time: NAME=VALUE"),
    emit: Optional[str] = typer.Option(None, "--emit", help="print ir | ir-unopt | dot instead of writing"),
    print_after_all: bool = typer.Option(False, "--print-after-all", help="print the IR after every pass"),
):
    """Compile a .smp sampler into a .smpb program."""
    import samplec.api as api
    from samplec.ir.printer import print_graph
    if emit not in (None, "ir", "ir-unopt", "dot"):
        raise SamplecError(f"--emit must be ir, ir-unopt or dot, got {emit!r}")
    bindings = _pairs(list(set_ or []) + list(more_sets or []), "--set")
    after = None
    if print_after_all:
        after = lambda name, g: typer.echo(f"// ---- after {name} ----\n{print_graph(g)}", err=emit is None)
    if emit == "ir-unopt":
        source = file.read_text(encoding="utf-8-sig") if file.exists() else _fail(f"{file}: no such file")
        graph, _ = api.lower_source(source, sampler, bindings, filename=str(file))
        typer.echo(print_graph(graph), nl=False)
        return
    prog = api.compile_file(file, sampler=sampler, opt_level=opt, bindings=bindings, after_pass=after)
    if emit == "ir":
        typer.echo(prog.ir(), nl=False)
    elif emit == "dot":
        typer.echo(to_dot(prog.graph), nl=False)
    if emit is None or output is not None:
        out = output or file.with_suffix(".smpb")
        prog.save(out)
        if emit is None:
            typer.echo(f"wrote {out} ({out.stat().st_size} bytes, {len(prog.graph.toposort())} nodes)", err=True)


def to_dot(graph) -> str:
    from samplec.ir.printer import Namer
    name = Namer()
    lines = [f'digraph "{graph.name}" {{', "  node [shape=box, fontname=monospace];"]
    for n in graph.nodes():
        label = f"%{name(n)} = {n.op}\\n{n.type}"
        lines.append(f'  "{name(n)}" [label="{label}"];')
        lines += [f'  "{name(i)}" -> "{name(n)}";' for i in n.inputs]
    for k, n in graph.outputs:
        lines.append(f'  "out:{k}" [shape=ellipse];\n  "{name(n)}" -> "out:{k}";')
    return "\n".join(lines) + "\n}\n"


@app.command()
@_guard
def inspect(file: Path = typer.Argument(..., help="a compiled .smpb program")):
    """Print the IR of a compiled program."""
    import samplec
    if not file.exists():
        raise SamplecError(f"{file}: no such file")
    typer.echo(samplec.load(file).ir(), nl=False)


@app.command("import")
@_guard
def import_cmd(
    file: Path = typer.Argument(..., help="a generation_config.json, a llama.cpp flags file, or a request body"),
    source: str = typer.Option(..., "--from", help="hf | llama-cpp | openai"),
):
    """Print an equivalent .smp sampler for another system's sampling settings."""
    from samplec.importers import import_source
    typer.echo(import_source(source, file), nl=False)


@app.command()
@_guard
def passes():
    """List the passes and the -O pipelines."""
    from samplec.passes import PASSES, PIPELINES
    for p in PASSES.values():
        typer.echo(f"{p.name:16} {p.doc}")
    for level, names in PIPELINES.items():
        typer.echo(f"-O{level}: {' '.join(names) or '(none)'}")


@app.command()
@_guard
def run(
    file: Path = typer.Argument(..., help="a .smp source or a compiled .smpb"),
    more_params: Optional[List[str]] = typer.Argument(None, metavar="[NAME=VALUE]...",
                                                       help="more --param values: --param a=1 b=2"),
    logits: Path = typer.Option(..., "--logits", help=".npy, .npz or .safetensors; shape [V] or [B, V]"),
    sampler: Optional[str] = typer.Option(None, "--sampler"),
    opt: int = typer.Option(2, "-O", min=0, max=2, help="optimization level for a .smp source"),
    param: Optional[List[str]] = typer.Option(None, "--param", help="NAME=VALUE, or NAME=V1,V2,... per row"),
    seed: Optional[str] = typer.Option(None, "--seed", help="the sampler's seed parameter"),
    history: Optional[Path] = typer.Option(None, "--history", help=".npy int token history [B, H]"),
    mask: Optional[Path] = typer.Option(None, "--mask", help=".npy bool mask [B, V] or packed int32 bitmask"),
    bias: Optional[Path] = typer.Option(None, "--bias", help=".npy float32 bias [B, V]"),
    draws: Optional[int] = typer.Option(None, "--draws", min=1, help="sample N times with seeds seed..seed+N-1"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Run a sampler on a logits file."""
    from samplec import runner
    prog = _load_program(file, sampler, opt)
    x = runner.load_array(logits, "--logits")
    values = runner.parse_params(prog, _pairs(list(param or []) + list(more_params or []), "--param"))
    for flag, kind, value in (("--seed", "seed", seed), ("--history", "tokens", history),
                              ("--mask", "mask", mask), ("--bias", "bias", bias)):
        if value is not None:
            name = runner.param_of_kind(prog, kind, flag)
            values[name] = runner.parse_value(prog, name, value) if kind == "seed" else \
                runner.load_array(value, flag)
    if draws:
        result = runner.draws(prog, x, values, draws)
        typer.echo(json.dumps(result) if as_json else runner.format_draws(result), nl=not as_json or True)
        return
    out = prog(x, **values)
    typer.echo(json.dumps(runner.to_json(out)) if as_json else runner.format_outputs(out))


def main():
    app()


if __name__ == "__main__":
    sys.exit(main())
