"""Shared pytest setup.

`@pytest.mark.uncompiled`: the test runs with MLX's compile off (`mx.disable_compile`). For tests that sweep many
distinct programs or shapes (random chains, fuzzers, random histories): each new program or shape under
`mx.compile` costs a C++ compile of its fused kernels on MLX's CPU backend the first time a machine sees it (a cold
cache adds minutes to the suite). What they test is the programs' semantics, op by op; that compiled programs give
the same bits as uncompiled ones is tested on its own (tests/test_examples.py::test_compiled_equals_uncompiled).
"""
from __future__ import annotations

import mlx.core as mx
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "uncompiled: run with MLX's compile off (many distinct programs or shapes)")


@pytest.fixture(autouse=True)
def _mlx_compile_mode(request):
    if request.node.get_closest_marker("uncompiled") is None:
        yield
        return
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()
