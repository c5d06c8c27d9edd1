"""The Python API of spec §5: compile source (or a file) into a `Program`, and load a saved `.smpb`."""
from __future__ import annotations

import os
import warnings as _warnings

from samplec.diagnostics import SamplecError, SamplecWarning
from samplec.files import read_source
from samplec.frontend.check import F32_RANGE, as_float32, check
from samplec.frontend.lower import _param_ranges, lower
from samplec.frontend.parser import parse
from samplec.ir.graph import Graph
from samplec.passes import run_pipeline
from samplec.program import Program
from samplec.stages import SCALAR_TYPES

__all__ = ["compile", "compile_file", "load", "lower_source", "Program", "SamplecError", "SamplecWarning"]


def lower_source(source: str, sampler: str | None = None, bindings: dict | None = None,
                 filename: str = "<string>") -> tuple[Graph, list]:
    """Parse, check and lower; returns the unoptimized graph and the warnings."""
    checked, warnings, binds = _front(source, sampler, bindings, filename)
    graph = lower(checked, binds)
    _warn(warnings, source)
    return graph, warnings


def _front(source, sampler, bindings, filename):
    checked, warnings = check(parse(source, filename), sampler)
    return checked, warnings, _check_bindings(checked, dict(bindings or {}))


def _warn(warnings: list, source: str) -> None:
    """Each source warning as a SamplecWarning -- once the source has lowered: a source that fails warns of
    nothing."""
    lines = source.split("\n")
    for w in warnings:
        _warnings.warn(SamplecWarning(w.render(lines)), stacklevel=3)


def compile(source_text: str, sampler: str | None = None, opt_level: int = 2, bindings: dict | None = None,
            filename: str = "<string>", after_pass=None, target: str | None = None) -> Program:  # noqa: A001
    """Compile `.smp` source text (the sampler named `sampler`, else the first) into a Program for `target`
    ("auto" or None: the device MLX runs on, or SAMPLEC_TARGET; "cpu", "cuda", "metal", "portable")."""
    if opt_level not in (0, 1, 2):
        raise SamplecError(f"opt_level must be 0, 1 or 2, got {opt_level!r}")
    if not isinstance(source_text, str):
        raise SamplecError(f"source_text must be a str, got {type(source_text).__name__}")
    checked, warnings, binds = _front(source_text, sampler, bindings, filename)
    graph = lower(checked, binds)
    _warn(warnings, source_text)
    return Program(run_pipeline(graph, opt_level, after=after_pass), target=target, after_pass=after_pass)


def compile_file(path: str | os.PathLike, sampler: str | None = None, opt_level: int = 2,
                 bindings: dict | None = None, after_pass=None, target: str | None = None) -> Program:
    return compile(read_source(path), sampler, opt_level, bindings, filename=str(path), after_pass=after_pass,
                   target=target)


def load(path: str | os.PathLike, target: str | None = None) -> Program:
    """A saved program. A `.smpb` holds the stage-level IR and the target it was compiled for: it is lowered for
    `target` when given, else for the recorded one where that can run here, else (with a warning) for "auto"."""
    from samplec.passes.target import resolve, unavailable
    from samplec.serialize import load_program
    graph, recorded = load_program(path)
    if target is None and recorded != "auto":
        why = unavailable(recorded)
        if why is None:
            target = recorded
        else:
            _warnings.warn(SamplecWarning(f"{path}: compiled for target {recorded!r}, which cannot run here ({why}): "
                                          f"lowered for {resolve('auto')!r} instead"), stacklevel=2)
    return Program(graph, target=target)


def _check_bindings(checked, bindings: dict) -> dict:
    """Compile-time bindings (`bindings=`, the CLI's --set NAME=VALUE): the parameter must exist, be a scalar, and
    its value lie in the range of its uses. The messages say "binding", which reads right from either."""
    params = {p.name: p for p in checked.params}
    ranges = _param_ranges(checked)
    out = {}
    for name, value in bindings.items():
        if name not in params:
            raise SamplecError(f"binding {name}: the sampler '{checked.name}' has no parameter '{name}' "
                               f"(it has: {', '.join(params) or 'none'})")
        kind = params[name].type
        article = "an" if kind == "int" else "a"
        if kind not in SCALAR_TYPES:
            raise SamplecError(f"binding {name}: a {kind} parameter cannot be bound at compile time")
        try:
            num = float(value) if kind == "float" else _integer(value) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise SamplecError(f"binding {name}: expected {article} {kind}, got {value!r}") from None
        if kind == "int" and not -2**31 <= num < 2**31 or kind == "seed" and not 0 <= num < 2**64:
            raise SamplecError(f"binding {name}={value}: out of range for {article} {kind}")
        if kind == "float":         # the float32 the program holds, as a literal's (docs/language.md)
            num = as_float32(num)
            if num is None or num != num:
                raise SamplecError(f"binding {name}={value}: " + ("NaN" if num is not None else F32_RANGE))
        if name in ranges and not ranges[name].contains(float(num)):
            raise SamplecError(f"binding {name}={value}: out of range {ranges[name].describe()}")
        out[name] = num
    return out


def _integer(text: str) -> int:
    """An integer as written: decimal (a leading zero too: `007` is 7), or 0x/0o/0b-prefixed."""
    text = text.strip()
    return int(text, 10) if text.lstrip("+-").isdigit() else int(text, 0)
