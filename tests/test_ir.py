"""The IR core: typing through the op table, the verifier, the textual round trip, the networkx view."""
from __future__ import annotations

import networkx as nx
import pytest

from samplec.api import lower_source
from samplec.ir.graph import INPUT, Check, Graph, Node, Param, VerifyError, make, verify
from samplec.ir.ops import OPS
from samplec.ir.parser import IRParseError, parse
from samplec.ir.printer import print_graph
from samplec.ir.types import Type, TypeError_

LOGITS = Node(INPUT, (), (), Type("f32", ("B", "V")), "logits")


def small() -> Graph:
    t = Node(INPUT, (), (), Type("f32", ("B",)), "t")
    x = make("div", LOGITS, make("expand", t), name="x")
    tok = make("squeeze", make("argmax", x), name="token")
    bad = make("squeeze", make("reduce_any", make("isnan", LOGITS)))
    return Graph("g", (Param("logits", "logits", LOGITS), Param("t", "float", t, 0.5, "(0.0, inf]")),
                 (("token", tok),), (Check(bad, "logits: NaN"),))


def test_types_come_from_the_op_table():
    x = make("reduce_max", LOGITS)
    assert str(x.type) == "f32[B,1]"
    assert str(make("topk_ids", LOGITS, k=5).type) == "i32[B,5]"
    assert str(make("add", x, LOGITS).type) == "f32[B,V]"
    with pytest.raises(TypeError_):
        make("add", LOGITS, make("iota", LOGITS))            # f32 + i32
    with pytest.raises(TypeError_):
        make("topk_ids", LOGITS)                              # missing attribute
    with pytest.raises(TypeError_):
        make("take_along", LOGITS, make("reduce_max", LOGITS))  # f32 indices


def test_verify_rejects_a_wrong_recorded_type():
    g = small()
    tok = g.outputs[0][1]
    forged = Node(tok.op, tok.inputs, tok.attrs, Type("f32", ("B",)), tok.name)
    with pytest.raises(VerifyError, match="recorded type"):
        verify(Graph(g.name, g.params, (("token", forged),), g.checks))


def test_verify_rejects_undeclared_inputs_and_bad_checks():
    g = small()
    stray = Node(INPUT, (), (), Type("f32", ("B", "V")), "stray")
    with pytest.raises(VerifyError, match="not a declared parameter"):
        verify(Graph(g.name, g.params, (("x", make("exp", stray)),)))
    with pytest.raises(VerifyError, match="bool"):
        verify(Graph(g.name, g.params, g.outputs, (Check(g.outputs[0][1], "not a flag"),)))


def test_print_parse_round_trip_and_determinism():
    g = small()
    text = print_graph(g)
    assert text == print_graph(small())
    assert print_graph(parse(text)) == text
    assert "param %t: f32[B] float = 0.5 range (0.0, inf]" in text


@pytest.mark.parametrize("bad", ["", "sampler @x {\n  %0 = nosuchop %logits : f32[B,V]\n}",
                                 "sampler @x {\n  param %logits: f32[B,V] logits\n  %0 = exp %nope : f32[B,V]\n}",
                                 "sampler @x {\n  param %logits: f32[B,V] logits\n  %0 = exp %logits : f32[B]\n}"])
def test_parse_errors(bad):
    with pytest.raises(IRParseError):
        parse(bad)


def test_networkx_view_is_acyclic_and_complete():
    g, _ = lower_source("sampler s(seed: seed = 0) -> token, logprob { top_k(40) top_p(0.9) sample(seed) }")
    view = g.to_networkx()
    assert nx.is_directed_acyclic_graph(view)
    assert view.number_of_nodes() == len(g.nodes())


def test_every_op_has_a_kernel_and_a_doc():
    from samplec.backend_mlx.kernels import KERNELS
    from samplec.frontend.expand import EXPAND
    from samplec.ir.ops import ALL_OPS, TARGET_OPS
    assert set(ALL_OPS) == set(KERNELS) | set(EXPAND) and not set(KERNELS) & set(EXPAND)
    assert not set(TARGET_OPS) & set(OPS)      # (target-level ops are never in a .smpb: not in the schema's table)
    assert all(op.doc for op in ALL_OPS.values())


def test_docs_op_table_is_the_op_table():
    from pathlib import Path
    from samplec.ir.ops import markdown_table
    doc = (Path(__file__).parent.parent / "docs" / "compiler.md").read_text()
    assert markdown_table() in doc, "docs/compiler.md's op table is stale: run python scripts/gen_schema.py"
