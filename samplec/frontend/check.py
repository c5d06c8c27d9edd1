"""Semantic checks of a parsed `.smp` module: names, types, arities, ranges, terminals and outputs.

Everything the grammar lets through but the language forbids is reported here, as `file:line:col` diagnostics
pointing at the offending text. Stage signatures come from the one table in samplec.stages.
`check` returns one sampler with its stages bound to their signatures (`BoundStage`), ready for lowering.
"""
from __future__ import annotations

import difflib
import math
import struct

from samplec.diagnostics import Diagnostic, DiagnosticSink, SamplecError, Span
from samplec.frontend.ast import (Arg, BoundStage, CheckedSampler, DictLit, ListLit, Literal, Module, Name, Output,
                                  Param, Sampler, Stage)
from samplec.stages import NO_DEFAULT, OUTPUTS, PARAM_TYPES, STAGES, U64, Range, StageParam

INT32 = Range(-2**31, 2**31 - 1)           # `int` values (top_k's k, positions, last_n) are 32-bit at run time
TOKEN_ID = Range(0, 2**31 - 1)             # keys of a logit_bias dict
NO_DEFAULT_TYPES = ("tokens", "mask", "bias")   # array-valued parameters: always given at run time

# Which sampler parameter types a stage slot of each type accepts (an int parameter may feed a float slot).
ACCEPTS = {"float": ("float", "int"), "int": ("int",), "seed": ("seed",), "tokens": ("tokens",),
           "mask": ("mask",), "bias_or_dict": ("bias",), "state": ("state",), "tokens_or_list": ("tokens",)}
SLOT_WORDS = {"float": "a float", "int": "an int", "seed": "a seed", "tokens": "a 'tokens' parameter",
              "mask": "a 'mask' parameter", "bias_or_dict": "a 'bias' parameter or a {token_id: bias} dict",
              "state": "a 'state' parameter", "tokens_or_list": "a list of token ids [a, b, ...] or a 'tokens' parameter"}


def check(module: Module, sampler: str | None = None) -> tuple[CheckedSampler, list[Diagnostic]]:
    """Check `module` and return the chosen sampler, bound and with defaults filled, plus its warnings.

    `sampler` picks a sampler by name; when it is None the file's only sampler is chosen, or the first one when the
    file holds several. The whole file is checked: an error in any sampler (or a duplicate sampler name) raises a
    SamplecError carrying every error, in source order. Warnings returned are those of the chosen sampler.
    """
    if not module.samplers:
        _raise([Diagnostic("error", "no sampler in this file", _file_start(module))], module)
    if sampler is None:
        chosen = module.samplers[0]
    else:
        chosen = next((s for s in module.samplers if s.name == sampler), None)
        if chosen is None:
            names = [s.name for s in module.samplers]
            msg = f"no sampler named '{sampler}' in {module.filename}{_did_you_mean(sampler, names)}"
            raise SamplecError(f"{msg} (samplers: {', '.join(names)})")     # (not a place in the source)
    diags = check_module(module)
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        _raise(errors, module)
    sink = DiagnosticSink(module.source)
    checked = _check_sampler(chosen, sink)
    return checked, sink.warnings


def check_module(module: Module) -> list[Diagnostic]:
    """Check every sampler of the file; return all errors and warnings in source order (raises nothing)."""
    sink = DiagnosticSink(module.source)
    if not module.samplers:
        sink.error("no sampler in this file", _file_start(module))
    if len(module.samplers) > LIMITS["samplers in a file"]:
        sink.error(f"the file holds {len(module.samplers)} samplers; the limit is {LIMITS['samplers in a file']}",
                   module.samplers[LIMITS["samplers in a file"]].name_span)
    first: dict[str, Sampler] = {}
    for s in module.samplers:
        if s.name in first:
            sink.error(f"sampler '{s.name}' is already defined at {_at(first[s.name].name_span)}", s.name_span)
        first.setdefault(s.name, s)
        _check_sampler(s, sink)
    return sorted(sink.items, key=lambda d: (d.span.line, d.span.col) if d.span else (0, 0))


def _raise(errors: list[Diagnostic], module: Module):
    raise SamplecError(errors[0].message, tuple(errors), module.source)


# ---- one sampler ----------------------------------------------------------------------------------------------

# Sizes past which a sampler makes no sense (real chains have a dozen stages and parameters); each limit keeps
# compiling any file within it well under a second. docs/language.md lists them.
LIMITS = {"samplers in a file": 1000, "stages in a sampler": 1000, "parameters of a sampler": 256,
          "outputs of a sampler": 64, "entries in a logit_bias dict": 10_000, "ids in a list": 10_000}


def _check_limits(s: Sampler, sink: DiagnosticSink) -> None:
    for what, items, span in (("stages in a sampler", s.stages, lambda i: i.span),
                              ("parameters of a sampler", s.params, lambda i: i.span),
                              ("outputs of a sampler", s.outputs or (), lambda i: i.span)):
        if len(items) > LIMITS[what]:
            sink.error(f"sampler '{s.name}' has {len(items)} {what.split()[0]}; the limit is {LIMITS[what]}",
                       span(items[LIMITS[what]]))
    for st in s.stages:
        for a in st.args:
            v = a.value
            if isinstance(v, DictLit) and len(v.items) > LIMITS["entries in a logit_bias dict"]:
                sink.error(f"a logit_bias dict holds {len(v.items)} entries; the limit is "
                           f"{LIMITS['entries in a logit_bias dict']} (pass a bias parameter instead)", v.span)
            if isinstance(v, ListLit) and len(v.items) > LIMITS["ids in a list"]:
                sink.error(f"a list holds {len(v.items)} ids; the limit is {LIMITS['ids in a list']} "
                           "(pass a tokens parameter instead)", v.span)


def _check_sampler(s: Sampler, sink: DiagnosticSink) -> CheckedSampler:
    _check_limits(s, sink)
    params = _check_params(s.params, sink)
    used: set[str] = set()
    stages = tuple(_bind_stage(st, params, used, sink) for st in s.stages)
    for p in params.values():
        if p.name not in used:
            sink.warning(f"parameter '{p.name}' is never used", _name_span(p.span, p.name))
    _check_terminals(s.stages, sink)
    _check_states(s, sink)
    outputs = s.outputs if s.outputs is not None else (Output("token", None, s.name_span),)
    _check_outputs(outputs, s, sink)
    return CheckedSampler(s.name, tuple(_coerce_param(p) for p in params.values()), outputs,
                          tuple(b for b in stages if b is not None), s.span)


def _check_params(params: tuple[Param, ...], sink: DiagnosticSink) -> dict[str, Param]:
    """Duplicates, types and defaults. Returns the parameters by name (the first of duplicates)."""
    by_name: dict[str, Param] = {}
    for p in params:
        name_span = _name_span(p.span, p.name)
        if p.name in by_name:
            sink.error(f"parameter '{p.name}' is already declared at {_at(by_name[p.name].span)}", name_span)
            continue
        by_name[p.name] = p
        if p.type not in PARAM_TYPES:
            sink.error(f"unknown parameter type '{p.type}'{_did_you_mean(p.type, PARAM_TYPES)}"
                       f" (types: {', '.join(PARAM_TYPES)})", p.type_span or p.span)
        elif p.default is not None and (problem := _default_problem(p)):
            sink.error(problem, p.default.span)
    return by_name


def _default_problem(p: Param) -> str | None:
    """Why a parameter's default does not fit the parameter's own type, or None."""
    d = p.default
    if p.type == "state":
        return f"a 'state' parameter cannot have a default (the stage that reads it says where it starts)"
    if p.type in NO_DEFAULT_TYPES:
        return f"a parameter of type '{p.type}' cannot have a default (its value is given at run time)"
    if p.type in ("int", "seed") and d.kind != "int":
        return f"default of '{p.name}' must be an integer, not {_show(d.value)}"
    if p.type == "seed" and not U64.contains(d.value):
        return f"default of seed '{p.name}' = {_show(d.value)} is out of range {U64.describe()}"
    if p.type == "int" and not INT32.contains(d.value):
        return f"default of '{p.name}' = {_show(d.value)} does not fit in a 32-bit int"
    if p.type == "float" and as_float32(float(d.value)) is None:
        return f"default of '{p.name}' = {_show(d.value)} is {F32_RANGE}"
    return None


def _coerce_param(p: Param) -> Param:
    """A float parameter's integer default becomes a float literal (what the parameter holds at run time)."""
    if p.type == "float" and p.default is not None and p.default.kind == "int":
        return Param(p.name, p.type, Literal(float(p.default.value), "float", p.default.span), p.span, p.type_span)
    return p


# ---- stages ---------------------------------------------------------------------------------------------------

def _bind_stage(st: Stage, params: dict[str, Param], used: set[str], sink: DiagnosticSink) -> BoundStage | None:
    """Match a stage call's arguments to its signature, check each one, and fill in the defaults."""
    sig = STAGES.get(st.name)
    if sig is None:
        sink.error(f"unknown stage '{st.name}'{_did_you_mean(st.name, STAGES)}", st.name_span)
        for a in st.args:  # still resolve names, so their parameters are not reported as unused
            if isinstance(a.value, Name):
                used.add(a.value.name)
        return None
    slots = {sp.name: sp for sp in sig.params}
    given: dict[str, Arg] = {}
    seen_keyword = too_many = False
    for i, a in enumerate(st.args):
        slot = None
        if a.key is None and seen_keyword:
            sink.error("a positional argument cannot follow a keyword argument", a.span)
        elif a.key is None and i >= len(sig.params):
            if not too_many:
                n, got = len(sig.params), sum(b.key is None for b in st.args)
                takes = "no arguments" if n == 0 else f"{n} argument{'s' * (n != 1)}"
                sink.error(f"{st.name} takes {takes} but {got} {'was' if got == 1 else 'were'} given", a.span)
            too_many = True
        elif a.key is None:
            slot = sig.params[i]
        else:
            seen_keyword = True
            slot = slots.get(a.key)
            if slot is None:
                hint = _did_you_mean(a.key, slots) or f" (parameters: {', '.join(slots) or 'none'})"
                sink.error(f"{st.name} has no parameter '{a.key}'{hint}", _name_span(a.span, a.key))
        if slot is not None and slot.name in given:
            sink.error(f"{st.name}: argument '{slot.name}' is given twice", a.span)
            slot = None
        if slot is None:  # a rejected argument still uses the parameter it names
            if isinstance(a.value, Name):
                used.add(a.value.name)
            continue
        given[slot.name] = a
        _check_arg(st.name, slot, a.value, params, used, sink)
    args: dict = {}
    for sp in sig.params:
        if sp.name in given:
            args[sp.name] = _coerce_arg(sp, given[sp.name].value)
        elif sp.default is NO_DEFAULT:
            sink.error(f"{st.name}: missing required argument '{sp.name}'", st.span)
        elif sp.default is None:
            args[sp.name] = None  # sample() without a seed: a fresh seed from the OS on every call
        elif isinstance(sp.default, tuple):
            args[sp.name] = ListLit(sp.default, st.span)
        else:
            kind = "float" if isinstance(sp.default, float) else "int"
            args[sp.name] = Literal(sp.default, kind, st.span)
    return BoundStage(st.name, args, st.span)


def _coerce_arg(slot: StageParam, value):
    """An integer literal in a float slot becomes a float literal, so lowering sees the slot's type."""
    if slot.type == "float" and isinstance(value, Literal) and value.kind == "int":
        return Literal(float(value.value), "float", value.span)
    return value


def _check_arg(stage: str, slot: StageParam, value, params: dict[str, Param], used: set[str],
               sink: DiagnosticSink) -> None:
    where = f"{stage}: {slot.name}"
    if isinstance(value, ListLit):
        if slot.type != "tokens_or_list":
            sink.error(f"{where} must be {SLOT_WORDS[slot.type]}; a list literal is only allowed in dry's breakers",
                       value.span)
        for tok, span in zip(value.items, value.item_spans or (value.span,) * len(value.items)):
            if not TOKEN_ID.contains(tok):
                sink.error(f"{where}: token id {tok} is out of range {TOKEN_ID.describe()}", span)
    elif isinstance(value, DictLit):
        if slot.type != "bias_or_dict":
            sink.error(f"{where} must be {SLOT_WORDS[slot.type]}; a dict literal is only allowed in logit_bias",
                       value.span)
        else:
            _check_dict(value, sink)
    elif isinstance(value, Literal):
        if not slot.literal_ok or slot.type in ("bias_or_dict", "tokens_or_list"):
            sink.error(f"{where} must be {SLOT_WORDS[slot.type]}, not a number", value.span)
        elif slot.type in ("int", "seed") and value.kind != "int":
            sink.error(f"{where} must be an integer, not {_show(value.value)}", value.span)
        elif problem := _range_problem(slot, value.value):
            sink.error(f"{where} = {_show(value.value)} {problem}", value.span)
    else:
        _check_name(where, slot, value, params, used, sink)


def _check_name(where: str, slot: StageParam, n: Name, params: dict[str, Param], used: set[str],
                sink: DiagnosticSink) -> None:
    used.add(n.name)
    p = params.get(n.name)
    if p is None:
        sink.error(f"undefined parameter '{n.name}'{_did_you_mean(n.name, params)}", n.span)
        used.add(_closest(n.name, params))  # the suggested parameter is not also reported as unused
    elif p.type not in PARAM_TYPES:
        pass  # already reported at the declaration
    elif p.type not in ACCEPTS[slot.type]:
        sink.error(f"{where} must be {SLOT_WORDS[slot.type]}, but parameter '{p.name}' has type {p.type}",
                   n.span)
    elif p.default is not None and _default_problem(p) is None:
        # The default feeds this slot whenever the caller leaves the parameter out: it must fit here too.
        d = p.default
        if problem := _range_problem(slot, d.value):
            sink.error(f"default of '{p.name}' = {_show(d.value)} {problem} (it is used as {where} at {_at(n.span)})",
                       d.span)


def as_float32(value: float) -> float | None:
    """The value a float literal has in the program (float32), or None when a finite value is past its range."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return None


F32_RANGE = "out of the float32 range (|x| <= 3.4028235e38; write inf for infinity)"


def _range_problem(slot: StageParam, value) -> str | None:
    """Why a literal value does not fit the slot's range, or None (a float literal as the float32 it becomes:
    1e-50 is 0 there, and 1e39 no number at all)."""
    rng = slot.range
    if slot.type == "float":  # show a float slot's bounds as floats: (0.0, 1.0]
        rng = Range(float(rng.lo), float(rng.hi), rng.lo_open, rng.hi_open)
        value = as_float32(float(value))
        if value is None:
            return "is " + F32_RANGE
    if not rng.contains(value):
        return f"is out of range {rng.describe()}"
    if slot.type == "int" and not INT32.contains(value):
        return "does not fit in a 32-bit int"
    return None


def _check_dict(d: DictLit, sink: DiagnosticSink) -> None:
    spans = d.item_spans or tuple((d.span, d.span) for _ in d.items)
    first: dict[int, Span] = {}
    for (key, bias), (kspan, vspan) in zip(d.items, spans):
        if not (isinstance(key, int) and TOKEN_ID.contains(key)):
            sink.error(f"logit_bias: token id {_show(key)} is out of range {TOKEN_ID.describe()}", kspan)
        elif key in first:
            sink.error(f"logit_bias: token id {key} appears twice (first at {_at(first[key])})", kspan)
        first.setdefault(key, kspan)
        if math.isnan(bias) or bias == math.inf:   # -inf bans the token, as in llama.cpp
            sink.error(f"logit_bias: the bias of token {_show(key)} must be a number or -inf, not {_show(bias)}",
                       vspan)
        elif as_float32(bias) is None:
            sink.error(f"logit_bias: the bias of token {_show(key)} is {F32_RANGE}", vspan)


# ---- terminals and outputs ------------------------------------------------------------------------------------

def _check_terminals(stages: tuple[Stage, ...], sink: DiagnosticSink) -> None:
    terminals = [i for i, st in enumerate(stages) if st.name in STAGES and STAGES[st.name].terminal]
    if not terminals:
        return
    first = stages[terminals[0]]
    for i in terminals[1:]:
        sink.error(f"a sampler has at most one terminal stage; '{first.name}' at {_at(first.span)} already ends it",
                   stages[i].name_span)
    after = [st for st in stages[terminals[0] + 1:] if not (st.name in STAGES and STAGES[st.name].terminal)]
    if after:
        sink.error(f"terminal stage '{first.name}' must be the last stage, but '{after[0].name}' follows it",
                   first.name_span)


def _check_states(s: Sampler, sink: DiagnosticSink) -> None:
    """A `state` parameter is read by exactly one stage (the one that updates it) and is not named like an output."""
    readers: dict[str, Stage] = {}
    for st in s.stages:
        for a in st.args:
            p = next((p for p in s.params if isinstance(a.value, Name) and p.name == a.value.name), None)
            if p is not None and p.type == "state":
                if p.name in readers:
                    sink.error(f"state '{p.name}' is already read by '{readers[p.name].name}' at "
                               f"{_at(readers[p.name].span)}; a state belongs to one stage", a.value.span)
                readers.setdefault(p.name, st)
    for o in s.outputs or ():
        if o.name not in OUTPUTS and o.name not in readers and any(p.name == o.name and p.type == "state"
                                                                   for p in s.params):
            sink.error(f"output '{o.name}': no stage reads the state '{o.name}', so nothing updates it", o.span)
    for p in s.params:
        if p.type == "state" and p.name in OUTPUTS:
            sink.error(f"a state parameter cannot be called '{p.name}' (an output has that name)",
                       _name_span(p.span, p.name))


def _check_outputs(outputs: tuple[Output, ...], s: Sampler, sink: DiagnosticSink) -> None:
    # An unknown stage might have been meant as the terminal: do not pile a second error on it.
    has_terminal = any(st.name not in STAGES or STAGES[st.name].terminal for st in s.stages)
    seen: dict[str, Output] = {}
    states = {p.name for p in s.params if p.type == "state"}
    for o in outputs:
        if o.name in states and o.name not in OUTPUTS:     # the updated value of a state parameter
            if o.arg is not None:
                sink.error(f"output '{o.name}' (a state) takes no argument", o.span)
            if o.name in seen:
                sink.error(f"output '{o.name}' is listed twice", o.span)
            seen[o.name] = o
            continue
        if o.name not in OUTPUTS:
            sink.error(f"unknown output '{o.name}'{_did_you_mean(o.name, [*OUTPUTS, *states])}"
                       f" (outputs: {', '.join([*OUTPUTS, *states])})", o.span)
            continue
        if o.name in seen:
            sink.error(f"output '{o.name}' is listed twice", o.span)
            continue
        seen[o.name] = o
        takes_arg, needs_terminal = OUTPUTS[o.name]
        if takes_arg and (o.arg is None or o.arg <= 0):
            got = "" if o.arg is None else f", not {o.arg}"
            sink.error(f"output '{o.name}' needs a positive count, e.g. {o.name}(5){got}", o.span)
        elif takes_arg and o.arg > MAX_OUTPUT_COUNT:
            sink.error(f"output '{o.name}({o.arg})' asks for more than {MAX_OUTPUT_COUNT} entries per row "
                       "(a call also refuses more than the vocabulary holds)", o.span)
        elif not takes_arg and o.arg is not None:
            sink.error(f"output '{o.name}' takes no argument", o.span)
        if needs_terminal and not has_terminal:
            sink.error(f"output '{o.name}' needs a terminal stage (greedy() or sample(...))", o.span)


MAX_OUTPUT_COUNT = 1 << 20      # top_logprobs(n), candidates(k): [B, n] arrays; V is at most a few hundred thousand


# ---- shared pieces ---------------------------------------------------------------------------------------------

def _did_you_mean(word: str, choices) -> str:
    close = _closest(word, choices)
    return f"; did you mean '{close}'?" if close else ""


def _closest(word: str, choices) -> str | None:
    """The likeliest intended choice: a close spelling, else a choice the word abbreviates (temp -> temperature)."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1)
    if close:
        return close[0]
    longer = [c for c in choices if len(word) >= 3 and c.lower().startswith(word.lower())]
    return min(longer, key=len) if longer else None


def _name_span(span: Span, name: str) -> Span:
    """The leading name of a `name: type` parameter or a `key = value` argument."""
    return Span(span.file, span.line, span.col, span.line, span.col + len(name))


def _at(span: Span) -> str:
    return f"{span.line}:{span.col}"


def _show(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def _file_start(module: Module) -> Span:
    return Span(module.filename, 1, 1, 1, 1)
