"""Tests of the frontend: the grammar and parser (AST shape, literals, spans, syntax errors) and the checker
(every check, with its message and position; binding of stage arguments to signatures)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, strategies as st
from lark import Lark

from samplec.diagnostics import SamplecError, Span
from samplec.frontend.ast import Arg, BoundStage, DictLit, Literal, Module, Name, Output
from samplec.frontend.check import check, check_module
from samplec.frontend.parser import _HINTS, GRAMMAR_PATH, ToAst, _hint_states, _lark, parse
from samplec.stages import NO_DEFAULT, OUTPUTS, STAGES

LLAMA = """\
# llama.smp — llama.cpp's default chain
sampler llama(temperature: float = 0.8, seed: seed = 0, pos: int = 0, history: tokens) -> token, logprob {
    penalties(history, last_n = 64, repeat = 1.1)
    top_k(40)
    top_p(0.95)
    min_p(0.05)
    temperature(temperature)
    sample(seed, position = pos)
}
"""


def one(src: str):
    """The only sampler of `src`."""
    (s,) = parse(src, "t.smp").samplers
    return s


def arg_values(stage) -> list:
    return [(a.key, a.value.value if isinstance(a.value, Literal) else a.value) for a in stage.args]


def diags(src: str) -> list[tuple[str, str, int, int]]:
    """(severity, message, line, col) of every diagnostic of `src`."""
    return [(d.severity, d.message, d.span.line, d.span.col) for d in check_module(parse(src, "t.smp"))]


def errors(src: str) -> list[tuple[str, int, int]]:
    return [(m, line, col) for sev, m, line, col in diags(src) if sev == "error"]


def syntax_error(src: str):
    with pytest.raises(SamplecError) as info:
        parse(src, "t.smp")
    (d,) = info.value.diagnostics
    assert d.severity == "error" and d.span.file == "t.smp"
    return d


# ==== grammar ==================================================================================================

def test_grammar_is_strict_lalr():
    pytest.importorskip("interegular")  # lark needs it to look for terminal collisions
    Lark(GRAMMAR_PATH.read_text(), parser="lalr", propagate_positions=True, strict=True)


def test_grammar_is_reachable_through_the_package_symlink():
    root = Path(__file__).resolve().parent.parent
    link = root / "samplec" / "grammar"
    assert link.is_symlink() and str(link.readlink()) == "../grammar"  # relative, so it survives copies
    assert GRAMMAR_PATH == link / "samplec.lark"
    assert GRAMMAR_PATH.resolve() == (root / "grammar" / "samplec.lark").resolve()


def test_parser_is_built_once():
    assert _lark() is _lark()


def test_every_tree_node_has_a_transformer_method():
    names = set()
    for rule in _lark().rules:
        name = rule.alias or rule.origin.name
        if isinstance(name, str) and not name.startswith("_") and not (rule.options.expand1 and not rule.alias):
            names.add(name)
    names.discard("start")  # aliased to `module`
    assert names and all(hasattr(ToAst, n) for n in names), names - set(dir(ToAst))


def test_every_syntax_hint_is_reachable():
    # each example fails to parse (else _hint_states raises) and no hint is shadowed by another with its state
    assert set(_hint_states().values()) == set(_HINTS)


# ==== parsing ==================================================================================================

def test_spec_example():
    module = parse(LLAMA, "llama.smp")
    assert isinstance(module, Module) and module.filename == "llama.smp" and module.source == LLAMA
    (s,) = module.samplers
    assert s.name == "llama"
    assert [(p.name, p.type, p.default.value if p.default else None) for p in s.params] == [
        ("temperature", "float", 0.8), ("seed", "seed", 0), ("pos", "int", 0), ("history", "tokens", None)]
    assert [(o.name, o.arg) for o in s.outputs] == [("token", None), ("logprob", None)]
    assert [st.name for st in s.stages] == ["penalties", "top_k", "top_p", "min_p", "temperature", "sample"]
    assert arg_values(s.stages[0]) == [(None, Name("history", s.stages[0].args[0].value.span)),
                                       ("last_n", 64), ("repeat", 1.1)]
    assert s.stages[5].args[1].key == "position" and s.stages[5].args[1].value.name == "pos"


def test_one_line_body():
    s = one("sampler s(seed: seed) { top_k(40) temperature(0.8) sample(seed) }")
    assert [st.name for st in s.stages] == ["top_k", "temperature", "sample"]
    assert arg_values(s.stages[1]) == [(None, 0.8)]


@pytest.mark.parametrize("body", [
    "top_k(40); temperature(0.8); greedy()",
    "top_k(40);temperature(0.8);greedy();",
    ";; top_k(40) ;\n temperature(0.8)\n\n;greedy() ;",
    "\n  top_k(40)\n  temperature(0.8)\n  greedy()\n",
])
def test_stage_separators(body):
    s = one(f"sampler s() {{{body}}}")
    assert [st.name for st in s.stages] == ["top_k", "temperature", "greedy"]


def test_comments_everywhere():
    src = """# leading comment
sampler s( # after paren
    t: float = 0.5, # after param
    seed: seed # no comma
) -> token # outputs
{ # open
    temperature(t) # trailing
    # own line
    sample(seed)#tight
} # close
# final comment without newline"""
    s = one(src)
    assert [p.name for p in s.params] == ["t", "seed"]
    assert [st.name for st in s.stages] == ["temperature", "sample"]


def test_several_samplers_and_empty_file():
    module = parse("sampler a() { greedy() }\nsampler b(seed: seed) -> probs {}\nsampler c() { greedy() }")
    assert [s.name for s in module.samplers] == ["a", "b", "c"]
    assert module.samplers[1].stages == () and module.samplers[1].outputs[0].name == "probs"
    assert parse("").samplers == () and parse("# nothing\n\n").samplers == ()


def test_outputs_optional_and_with_arguments():
    assert one("sampler s() { greedy() }").outputs is None
    s = one("sampler s() -> token, top_logprobs(5), candidates(10), probs, raw_logprob { greedy() }")
    assert [(o.name, o.arg) for o in s.outputs] == [
        ("token", None), ("top_logprobs", 5), ("candidates", 10), ("probs", None), ("raw_logprob", None)]
    # generic names and any integer parse; validation is the checker's job
    s = one("sampler s() -> whatever(-3) { }")
    assert [(o.name, o.arg) for o in s.outputs] == [("whatever", -3)]


def test_params_positional_and_keyword_args_and_trailing_commas():
    s = one("sampler s(a: int, b: float = 2, c: seed = 3,) { xtc(0.1, probability = 0.5, seed = c,) }")
    assert [(p.name, p.type) for p in s.params] == [("a", "int"), ("b", "float"), ("c", "seed")]
    assert [a.key for a in s.stages[0].args] == [None, "probability", "seed"]
    assert one("sampler s() { greedy() }").stages[0].args == ()
    assert one("sampler s() {}").params == ()


@pytest.mark.parametrize("text, value, kind", [
    ("40", 40, "int"), ("0", 0, "int"), ("-1", -1, "int"), ("+7", 7, "int"),
    ("18446744073709551615", 2**64 - 1, "int"), ("123456789012345678901234567890", 123456789012345678901234567890, "int"),
    ("0.5", 0.5, "float"), (".5", 0.5, "float"), ("-.5", -0.5, "float"), ("1.", 1.0, "float"), ("1.0", 1.0, "float"),
    ("1e-3", 1e-3, "float"), ("2.5E+4", 2.5e4, "float"), ("1e5", 1e5, "float"), ("-1e5", -1e5, "float"),
    ("inf", math.inf, "float"), ("-inf", -math.inf, "float"), ("+inf", math.inf, "float"),
])
def test_literals(text, value, kind):
    lit = one(f"sampler s() {{ x({text}) }}").stages[0].args[0].value
    assert isinstance(lit, Literal) and lit.kind == kind and lit.value == value and type(lit.value) is type(value)
    assert (lit.span.col, lit.span.end_col) == (17, 17 + len(text))


@pytest.mark.parametrize("text", ["info", "inf_x", "inf2", "_inf", "temperature", "x1"])
def test_names_that_look_like_inf_stay_names(text):
    value = one(f"sampler s() {{ x({text}) }}").stages[0].args[0].value
    assert value == Name(text, Span("t.smp", 1, 17, 1, 17 + len(text)))


def test_param_default_literals():
    s = one("sampler s(a: float = -inf, b: int = -1, c: seed = 18446744073709551615, d: float = 1e-3) {}")
    assert [(p.default.value, p.default.kind) for p in s.params] == [
        (-math.inf, "float"), (-1, "int"), (2**64 - 1, "int"), (1e-3, "float")]


def test_dict_literals():
    s = one("sampler s() { logit_bias({1: -2.5, 42: 3, 7: -inf,}) logit_bias({}) logit_bias({ 0 : 1 }) }")
    d = s.stages[0].args[0].value
    assert isinstance(d, DictLit)
    assert d.items == ((1, -2.5), (42, 3.0), (7, -math.inf))
    assert all(type(v) is float for _, v in d.items)
    assert d.span == Span("t.smp", 1, 26, 1, 52)
    assert [(k.col, k.end_col, v.col, v.end_col) for k, v in d.item_spans] == [
        (27, 28, 30, 34), (36, 38, 40, 41), (43, 44, 46, 50)]
    assert s.stages[1].args[0].value.items == ()
    assert s.stages[2].args[0].value.items == ((0, 1.0),)


def test_spans():
    src = "sampler nucleus(t: float = 0.7, seed: seed) -> token, top_logprobs(3) {\n" \
          "    top_p(p = 0.9)\n" \
          "    temperature(t); sample(seed)\n" \
          "}\n"
    s = one(src)
    f = "t.smp"
    assert s.span == Span(f, 1, 1, 4, 2)
    assert s.name_span == Span(f, 1, 9, 1, 16)
    t, seed = s.params
    assert t.span == Span(f, 1, 17, 1, 31) and t.type_span == Span(f, 1, 20, 1, 25)
    assert t.default.span == Span(f, 1, 28, 1, 31)
    assert seed.span == Span(f, 1, 33, 1, 43) and seed.type_span == Span(f, 1, 39, 1, 43)
    assert [o.span for o in s.outputs] == [Span(f, 1, 48, 1, 53), Span(f, 1, 55, 1, 70)]
    top_p, temp, sample = s.stages
    assert top_p.span == Span(f, 2, 5, 2, 19) and top_p.name_span == Span(f, 2, 5, 2, 10)
    assert top_p.args[0] == Arg("p", Literal(0.9, "float", Span(f, 2, 15, 2, 18)), Span(f, 2, 11, 2, 18))
    assert temp.span == Span(f, 3, 5, 3, 19) and temp.args[0].value.span == Span(f, 3, 17, 3, 18)
    assert sample.span == Span(f, 3, 21, 3, 33) and sample.name_span == Span(f, 3, 21, 3, 27)


def test_spans_count_characters_not_bytes():
    s = one("sampler s() { # é ü ß\n  top_k(40) }")
    assert s.stages[0].span == Span("t.smp", 2, 3, 2, 12)
    s = one("sampler s() { x(1) } # ünïcödé")
    assert s.stages[0].span.col == 15


def test_keywords_are_contextual():
    # `sampler` is a keyword only where a sampler may start; `inf` only where a value may stand
    s = one("sampler sampler(inf: float, sampler: int) { x(sampler) }")
    assert s.name == "sampler" and [p.name for p in s.params] == ["inf", "sampler"]
    assert s.stages[0].args[0].value.name == "sampler"


def test_default_filename():
    assert parse("sampler s() {}").samplers[0].span.file == "<string>"


@given(st.floats(allow_nan=False))
def test_float_literals_round_trip(x):
    lit = one(f"sampler s() {{ x({x!r}) }}").stages[0].args[0].value
    assert lit.kind == "float" and lit.value == x


@given(st.integers(min_value=-(2**80), max_value=2**80))
def test_int_literals_round_trip(n):
    lit = one(f"sampler s() {{ x({n}) }}").stages[0].args[0].value
    assert lit == Literal(n, "int", lit.span) and type(lit.value) is int


# ==== syntax errors ============================================================================================

@pytest.mark.parametrize("src, message, line, col", [
    ("sampler s() { top_k(40 50) }", "unexpected '50'; expected ')' or ','", 1, 24),
    ("sampler s() {\n  top_k(40\n}", "unexpected '}'; expected ')' or ','", 3, 1),
    ("sampler s() {\n  top_k(40)\n", "unexpected end of file; expected a stage or '}'", 2, 12),
    ("sampler s(", "unexpected end of file; expected ')' or a name", 1, 11),
    ("sampler s() { top_k(40", "unexpected end of file; expected ')' or ','", 1, 23),
    ("sampler s() { greedy }", "stage 'greedy' needs parentheses: greedy(...)", 1, 15),
    ("sampler a() {}\nsampler s() { top_k(1) greedy }", "stage 'greedy' needs parentheses: greedy(...)", 2, 24),
    ("sampler s() { top_k(@) }", "unexpected character '@'; expected an argument", 1, 21),
    ("sampler s() { top_k(- 1) }", "unexpected character '-'", 1, 21),
    ("sampler s() { top_k(1.2.3) }", "unexpected '.3'; expected ')' or ','", 1, 24),
    ("sampler (", "unexpected '('; expected the sampler's name after 'sampler'", 1, 9),
    ("sampler s {", "unexpected '{'; expected '(' and a parameter list", 1, 11),
    ("sampler s(x: ) {}", "unexpected ')'; expected a parameter type after ':'", 1, 14),
    ("sampler s(x) {}", "unexpected ')'; a parameter needs a type", 1, 12),
    ("sampler s(a: int, x = 1) {}", "unexpected '='; a parameter needs a type", 1, 21),
    ("sampler s(x: float = a) {}", "unexpected 'a'; expected a number", 1, 22),
    ("sampler s() -> { }", "unexpected '{'; expected a name", 1, 16),
    ("sampler s() -> top_logprobs(a) {}", "unexpected 'a'; expected an integer", 1, 29),
    ("sampler s() -> token sample() }", "unexpected 'sample'; expected '{' and the sampler's stages", 1, 22),
    ("sampler s() { top_k(40),  }", "unexpected ','; expected a stage or '}'", 1, 24),
    ("sampler s() { top_k(k = ) }", "unexpected ')'; expected an argument", 1, 25),
    ("sampler s() { top_k(k: 1) }", "unexpected ':'; expected ')', ',' or '='", 1, 22),
    ("sampler s() { logit_bias({1.5: 2}) }", "unexpected '.5'; expected ':' after the token id", 1, 28),
    ("sampler s() { logit_bias({a: 1}) }", "unexpected 'a'; expected an integer token id", 1, 27),
    ("sampler s() { logit_bias({1: 1, 2: a}) }", "unexpected 'a'; expected a number", 1, 36),
    ("samplr s() {}", "unexpected 'samplr'; expected 'sampler' or end of file", 1, 1),
    ("sampler s() { top_k(40) } }", "unexpected '}'; expected 'sampler' or end of file", 1, 27),
])
def test_syntax_errors(src, message, line, col):
    d = syntax_error(src)
    assert d.message.startswith(message), d.message
    assert (d.span.line, d.span.col) == (line, col)


def test_syntax_error_renders_with_caret():
    with pytest.raises(SamplecError) as info:
        parse("sampler s() {\n    top_k(40 50)\n}\n", "bad.smp")
    assert str(info.value) == ("bad.smp:2:14: error: unexpected '50'; expected ')' or ','\n"
                               "    top_k(40 50)\n"
                               "             ^~")


# ==== checker: selection and results ===========================================================================

def test_check_selects_samplers():
    module = parse("sampler a() { greedy() }\nsampler b() -> probs { top_k(3) }")
    assert check(module)[0].name == "a"  # first of several when no name is given
    assert check(module, "b")[0].name == "b"
    assert check(parse("sampler only() { greedy() }"))[0].name == "only"
    with pytest.raises(SamplecError, match=r"^no sampler named 'c' in <string> \(samplers: a, b\)"):
        check(module, "c")
    with pytest.raises(SamplecError, match="did you mean 'alpha'"):
        check(parse("sampler alpha() { greedy() }"), "alpah")
    with pytest.raises(SamplecError, match="no sampler in this file"):
        check(parse("# empty"))


def test_check_reports_errors_anywhere_in_the_file():
    module = parse("sampler good() { greedy() }\nsampler bad() { top_q(1) greedy() top_p(2) }", "f.smp")
    with pytest.raises(SamplecError) as info:
        check(module, "good")
    assert [d.message for d in info.value.diagnostics] == [
        "unknown stage 'top_q'; did you mean 'top_p'?",
        "terminal stage 'greedy' must be the last stage, but 'top_p' follows it",
        "top_p: p = 2 is out of range (0.0, 1.0]"]
    assert all(d.severity == "error" for d in info.value.diagnostics)
    assert str(info.value).startswith("f.smp:2:17: error: unknown stage 'top_q'")
    assert "sampler bad() { top_q(1)" in str(info.value)


def test_check_returns_warnings_of_the_chosen_sampler():
    module = parse("sampler a(x: int) { greedy() }\nsampler b(y: int) { greedy() }")
    _, warnings = check(module, "b")
    assert [(w.severity, w.message) for w in warnings] == [("warning", "parameter 'y' is never used")]
    assert check(parse(LLAMA))[1] == []


def test_checked_sampler_binds_every_signature_parameter():
    checked, _ = check(parse(LLAMA, "llama.smp"))
    assert checked.name == "llama" and [o.name for o in checked.outputs] == ["token", "logprob"]
    assert all(isinstance(b, BoundStage) for b in checked.stages)
    for b in checked.stages:
        assert list(b.args) == [p.name for p in STAGES[b.name].params]
    pen = checked.stages[0]
    assert pen.args["last_n"].value == 64 and pen.args["repeat"].value == 1.1
    assert pen.args["frequency"] == Literal(0.0, "float", pen.span)
    assert pen.args["presence"] == Literal(0.0, "float", pen.span)
    assert checked.stages[-1].args["position"].name == "pos"


def test_defaults_and_absent_seed():
    checked, _ = check(parse("sampler s() { xtc(0.1, 0.5, 3) sample() }"))
    xtc, sample = checked.stages
    assert xtc.args["position"] == Literal(0, "int", xtc.span)
    assert xtc.args["seed"].value == 3 and xtc.args["seed"].kind == "int"
    assert sample.args == {"seed": None, "position": Literal(0, "int", sample.span)}
    assert checked.outputs == (Output("token", None, parse("sampler s() {}").samplers[0].name_span),)


def test_int_literals_in_float_slots_become_floats():
    checked, _ = check(parse("sampler s(t: float = 1, k: int = 3) { temperature(2) top_k(k) temperature(t) greedy() }"))
    t = checked.stages[0].args["t"]
    assert t.kind == "float" and t.value == 2.0 and type(t.value) is float
    assert checked.stages[1].args["k"].name == "k"
    assert checked.params[0].default == Literal(1.0, "float", checked.params[0].default.span)
    assert checked.params[1].default.kind == "int"


def test_empty_body_with_probs_or_candidates():
    assert check(parse("sampler s() -> probs {}"))[0].stages == ()
    assert check(parse("sampler s() -> candidates(8), probs { top_k(8) }"))[0].outputs[0].arg == 8


def test_every_stage_accepts_well_typed_arguments():
    """Drive the signature table: call each stage with its required arguments and check it binds."""
    value = {"float": "0.5", "int": "1", "seed": "sd", "tokens": "hist", "mask": "allowed", "bias_or_dict": "{1: 0.5}",
             "state": "mu"}
    header = "sampler s(sd: seed, hist: tokens, allowed: mask, mu: state) -> probs"
    for name, sig in STAGES.items():
        args = ", ".join(value[p.type] for p in sig.params if p.default is NO_DEFAULT)
        src = f"{header} {{ {name}({args}) }}"
        checked, _ = check(parse(src))
        assert checked.stages[0].name == name and set(checked.stages[0].args) == {p.name for p in sig.params}


# ==== checker: each check ======================================================================================

@pytest.mark.parametrize("src, message, line, col", [
    # names
    ("sampler a() { greedy() }\nsampler a() { greedy() }", "sampler 'a' is already defined at 1:9", 2, 9),
    ("sampler s(x: int, y: int, x: float) { top_k(x) top_k(y) greedy() }",
     "parameter 'x' is already declared at 1:11", 1, 27),
    ("sampler s(t: flaot) { temperature(t) greedy() }",
     "unknown parameter type 'flaot'; did you mean 'float'? (types: float, int, seed, tokens, mask, bias, state)", 1, 14),
    ("sampler s(t: string) { greedy() }", "unknown parameter type 'string' (types:", 1, 14),
    # defaults
    ("sampler s(k: int = 0.5) { top_k(k) greedy() }", "default of 'k' must be an integer, not 0.5", 1, 20),
    ("sampler s(sd: seed = -1) { sample(sd) }", "default of seed 'sd' = -1 is out of range [0, 18446744073709551615]", 1, 22),
    ("sampler s(sd: seed = 18446744073709551616) { sample(sd) }", "default of seed 'sd' = 18446744073709551616", 1, 22),
    ("sampler s(sd: seed = 1.0) { sample(sd) }", "default of 'sd' must be an integer, not 1.0", 1, 22),
    ("sampler s(k: int = 4294967296) { top_k(k) greedy() }", "default of 'k' = 4294967296 does not fit in a 32-bit int", 1, 20),
    ("sampler s(h: tokens = 1) { penalties(h) greedy() }", "a parameter of type 'tokens' cannot have a default", 1, 23),
    ("sampler s(m: mask = 1) { allow(m) greedy() }", "a parameter of type 'mask' cannot have a default", 1, 21),
    ("sampler s(b: bias = 0.0) { logit_bias(b) greedy() }", "a parameter of type 'bias' cannot have a default", 1, 21),
    ("sampler s(p: float = 1.5) { top_p(p) greedy() }",
     "default of 'p' = 1.5 is out of range (0.0, 1.0] (it is used as top_p: p at 1:35)", 1, 22),
    ("sampler s(t: float = -0.5) { min_p(0.1) temperature(t) greedy() }",
     "default of 't' = -0.5 is out of range [0.0, inf] (it is used as temperature: t at 1:53)", 1, 22),
    ("sampler s(n: int = -2) { penalties(h, last_n = n) greedy() }",
     "default of 'n' = -2 is out of range [-1, inf] (it is used as penalties: last_n at 1:48)", 1, 20),
    # unknown stages
    ("sampler s() { top_q(0.9) greedy() }", "unknown stage 'top_q'; did you mean 'top_p'?", 1, 15),
    ("sampler s() { tempreature(0.9) greedy() }", "unknown stage 'tempreature'; did you mean 'temperature'?", 1, 15),
    ("sampler s() { frobnicate() greedy() }", "unknown stage 'frobnicate'", 1, 15),
    # arity
    ("sampler s() { top_k(40, 50) greedy() }", "top_k takes 1 argument but 2 were given", 1, 25),
    ("sampler s() { greedy(1) }", "greedy takes no arguments but 1 was given", 1, 22),
    ("sampler s() { top_p(q = 0.9) greedy() }", "top_p has no parameter 'q' (parameters: p)", 1, 21),
    ("sampler s() { top_p(pp = 0.9) greedy() }", "top_p has no parameter 'pp'; did you mean 'p'?", 1, 21),
    ("sampler s() { greedy(x = 1) }", "greedy has no parameter 'x' (parameters: none)", 1, 22),
    ("sampler s(sd: seed) { sample(sd, postion = 3) }", "sample has no parameter 'postion'; did you mean 'position'?", 1, 34),
    ("sampler s() { top_k(40, k = 50) greedy() }", "top_k: argument 'k' is given twice", 1, 25),
    ("sampler s() { top_k(k = 1, k = 2) greedy() }", "top_k: argument 'k' is given twice", 1, 28),
    ("sampler s(sd: seed) { sample(position = 1, sd) }", "a positional argument cannot follow a keyword argument", 1, 44),
    ("sampler s() { top_k() greedy() }", "top_k: missing required argument 'k'", 1, 15),
    ("sampler s() { xtc(0.1, 0.5) greedy() }", "xtc: missing required argument 'seed'", 1, 15),
    ("sampler s() { penalties(repeat = 1.1) greedy() }", "penalties: missing required argument 'history'", 1, 15),
    # types
    ("sampler s() { top_k(0.5) greedy() }", "top_k: k must be an integer, not 0.5", 1, 21),
    ("sampler s() { top_k(40.0) greedy() }", "top_k: k must be an integer, not 40.0", 1, 21),
    ("sampler s() { sample(1.5) }", "sample: seed must be an integer, not 1.5", 1, 22),
    ("sampler s() { sample(position = inf) }", "sample: position must be an integer, not inf", 1, 33),
    ("sampler s(k: float) { top_k(k) greedy() }", "top_k: k must be an int, but parameter 'k' has type float", 1, 29),
    ("sampler s(sd: int) { sample(sd) }", "sample: seed must be a seed, but parameter 'sd' has type int", 1, 29),
    ("sampler s(t: seed) { temperature(t) greedy() }",
     "temperature: t must be a float, but parameter 't' has type seed", 1, 34),
    ("sampler s(h: mask) { penalties(h) greedy() }",
     "penalties: history must be a 'tokens' parameter, but parameter 'h' has type mask", 1, 32),
    ("sampler s(h: tokens) { allow(h) greedy() }",
     "allow: mask must be a 'mask' parameter, but parameter 'h' has type tokens", 1, 30),
    ("sampler s(b: float) { logit_bias(b) greedy() }",
     "logit_bias: b must be a 'bias' parameter or a {token_id: bias} dict, but parameter 'b' has type float", 1, 34),
    ("sampler s() { penalties(64) greedy() }", "penalties: history must be a 'tokens' parameter, not a number", 1, 25),
    ("sampler s() { allow(1) greedy() }", "allow: mask must be a 'mask' parameter, not a number", 1, 21),
    ("sampler s() { logit_bias(1.0) greedy() }",
     "logit_bias: b must be a 'bias' parameter or a {token_id: bias} dict, not a number", 1, 26),
    ("sampler s() { top_k({1: 2}) greedy() }",
     "top_k: k must be an int; a dict literal is only allowed in logit_bias", 1, 21),
    ("sampler s() { logit_bias({-1: 2}) greedy() }", "logit_bias: token id -1 is out of range [0, 2147483647]", 1, 27),
    ("sampler s() { logit_bias({2147483648: 2}) greedy() }", "logit_bias: token id 2147483648 is out of range", 1, 27),
    ("sampler s() { logit_bias({5: 1, 5: 2}) greedy() }", "logit_bias: token id 5 appears twice (first at 1:27)", 1, 33),
    ("sampler s() { logit_bias({5: inf}) greedy() }",
     "logit_bias: the bias of token 5 must be a number or -inf, not inf", 1, 30),
    # ranges
    ("sampler s() { top_p(1.5) greedy() }", "top_p: p = 1.5 is out of range (0.0, 1.0]", 1, 21),
    ("sampler s() { top_p(0) greedy() }", "top_p: p = 0 is out of range (0.0, 1.0]", 1, 21),
    ("sampler s() { temperature(-1) greedy() }", "temperature: t = -1 is out of range [0.0, inf]", 1, 27),
    ("sampler s() { min_p(2) greedy() }", "min_p: m = 2 is out of range [0.0, 1.0]", 1, 21),
    ("sampler s() { min_p(-inf) greedy() }", "min_p: m = -inf is out of range [0.0, 1.0]", 1, 21),
    ("sampler s() { typical_p(-0.1) greedy() }", "typical_p: m = -0.1 is out of range [0.0, inf]", 1, 25),
    ("sampler s() { xtc(0.1, 1.5, 1) greedy() }", "xtc: probability = 1.5 is out of range [0.0, 1.0]", 1, 24),
    ("sampler s(h: tokens) { penalties(h, last_n = -2) greedy() }",
     "penalties: last_n = -2 is out of range [-1, inf]", 1, 46),
    ("sampler s(h: tokens) { penalties(h, repeat = 0) greedy() }",
     "penalties: repeat = 0 is out of range (0.0, inf)", 1, 46),
    ("sampler s() { sample(-1) }", "sample: seed = -1 is out of range [0, 18446744073709551615]", 1, 22),
    ("sampler s() { sample(18446744073709551616) }", "sample: seed = 18446744073709551616 is out of range", 1, 22),
    ("sampler s() { top_k(2147483648) greedy() }", "top_k: k = 2147483648 does not fit in a 32-bit int", 1, 21),
    # undefined parameters
    ("sampler s(temperature: float) { temperature(temp) greedy() }",
     "undefined parameter 'temp'; did you mean 'temperature'?", 1, 45),
    ("sampler s(seed: seed) { sample(sede) }", "undefined parameter 'sede'; did you mean 'seed'?", 1, 32),
    ("sampler s() { sample(seed) }", "undefined parameter 'seed'", 1, 22),
    # terminals
    ("sampler s() { greedy() top_k(1) }", "terminal stage 'greedy' must be the last stage, but 'top_k' follows it", 1, 15),
    ("sampler s() { greedy() greedy() }",
     "a sampler has at most one terminal stage; 'greedy' at 1:15 already ends it", 1, 24),
    # outputs
    ("sampler s() -> tokens { greedy() }", "unknown output 'tokens'; did you mean 'token'? (outputs: token, logprob,", 1, 16),
    ("sampler s() -> foo { greedy() }", "unknown output 'foo' (outputs:", 1, 16),
    ("sampler s() -> top_logprobs { greedy() }", "output 'top_logprobs' needs a positive count, e.g. top_logprobs(5)", 1, 16),
    ("sampler s() -> candidates(0) { }", "output 'candidates' needs a positive count, e.g. candidates(5), not 0", 1, 16),
    ("sampler s() -> top_logprobs(-2) { greedy() }", "output 'top_logprobs' needs a positive count", 1, 16),
    ("sampler s() -> logprob(1) { greedy() }", "output 'logprob' takes no argument", 1, 16),
    ("sampler s() -> token, probs, token { greedy() }", "output 'token' is listed twice", 1, 30),
    ("sampler s() -> probs, probs { }", "output 'probs' is listed twice", 1, 23),
    ("sampler s() { top_k(40) }", "output 'token' needs a terminal stage (greedy() or sample(...))", 1, 9),
    ("sampler s() {}", "output 'token' needs a terminal stage (greedy() or sample(...))", 1, 9),
    ("sampler s() -> probs, logprob { }", "output 'logprob' needs a terminal stage (greedy() or sample(...))", 1, 23),
    ("sampler s() -> top_logprobs(3) { }", "output 'top_logprobs' needs a terminal stage", 1, 16),
    # files
    ("", "no sampler in this file", 1, 1),
])
def test_check_errors(src, message, line, col):
    found = errors(src)
    assert any(m.startswith(message) and (ln, c) == (line, col) for m, ln, c in found), found


@pytest.mark.parametrize("src", [
    LLAMA,
    "sampler s() { greedy() }",
    "sampler s(sd: seed) { sample(sd) }",
    "sampler s() { sample() }",
    "sampler s() { sample(0) } sampler t() { sample(18446744073709551615) }",
    "sampler s() -> probs {}",
    "sampler s() -> candidates(5) { top_k(5) }",
    "sampler s() -> token, logprob, raw_logprob, top_logprobs(20), probs, candidates(3) { greedy() }",
    "sampler s(k: int = 5, t: float = 0) { top_k(k) temperature(k) temperature(t) greedy() }",
    "sampler s(p: float = 1) { top_p(p) greedy() }",
    "sampler s() { top_p(1) min_p(0) min_p(1) temperature(0) temperature(inf) top_k(-5) greedy() }",
    "sampler s(b: bias, m: mask, h: tokens) { logit_bias(b) allow(m) penalties(h, -1, 1.2, 0.1, 0.2) greedy() }",
    "sampler s(h: tokens) { penalties(history = h, presence = -0.5, frequency = 1e-3) greedy() }",
    "sampler s() { logit_bias({0: -100, 2147483647: 1.5, 3: 0}) greedy() }",
    "sampler s(sd: seed, pos: int) { xtc(0.1, 0.5, sd, pos) sample(sd, pos) }",
    "sampler s(sd: seed = 18446744073709551615) { sample(seed = sd, position = 2147483647) }",
])
def test_valid_programs_have_no_errors(src):
    assert errors(src) == []


def test_unused_parameter_is_a_warning_only():
    found = diags("sampler s(a: int, seed: seed, b: float = 1) { sample(seed) }")
    assert found == [("warning", "parameter 'a' is never used", 1, 11),
                     ("warning", "parameter 'b' is never used", 1, 31)]
    checked, warnings = check(parse("sampler s(a: int) { greedy() }"))
    assert checked.name == "s" and [w.message for w in warnings] == ["parameter 'a' is never used"]


def test_no_cascading_diagnostics():
    # an unknown stage may have been the terminal: no "needs a terminal stage" on top
    assert errors("sampler s(sd: seed) { smaple(sd) }") == [("unknown stage 'smaple'; did you mean 'sample'?", 1, 23)]
    # a misspelled name does not also make the parameter it meant "unused"
    assert diags("sampler s(temperature: float) { temperature(temp) greedy() }") == [
        ("error", "undefined parameter 'temp'; did you mean 'temperature'?", 1, 45)]
    # a parameter named by a rejected argument still counts as used
    assert diags("sampler s(k: int) { top_k(1, k) greedy() }") == [
        ("error", "top_k takes 1 argument but 2 were given", 1, 30)]
    # an invalid default is reported once, at the declaration
    assert len(errors("sampler s(sd: seed = -1) { sample(sd) }")) == 1
    # a parameter of unknown type is not reported again where it is used
    assert len(errors("sampler s(k: integer) { top_k(k) greedy() }")) == 1


def test_diagnostics_are_in_source_order():
    found = errors("sampler a() { top_p(2) }\nsampler a() { top_k(0.5) greedy() greedy() }")
    assert [(ln, c) for _, ln, c in found] == sorted((ln, c) for _, ln, c in found)
    assert len(found) == 5


def test_outputs_table_is_covered():
    """Every output of the table is accepted by the checker in some form."""
    for name, (takes_arg, needs_terminal) in OUTPUTS.items():
        out = f"{name}(2)" if takes_arg else name
        body = "greedy()" if needs_terminal else ""
        assert errors(f"sampler s() -> {out} {{ {body} }}") == []
