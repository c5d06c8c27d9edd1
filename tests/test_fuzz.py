"""The fuzzers (fuzz/) in a short budget: hypothesis draws the seeds, each case must end as the fuzz target's
contract says (a result or samplec's own located error; never another exception, a hang, or silent garbage).
`python -m fuzz.run --seconds N` runs them as long as you like; docs/reliability.md records long runs."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fuzz import differential, runtime, smpb, source  # noqa: E402
from fuzz.common import Counts  # noqa: E402

SEEDS = st.integers(0, 2**32 - 1)
FAST = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def clean(c: Counts) -> None:
    assert c.failures == 0, c.line() + "\n" + "\n".join(map(str, c.examples))


EXAMPLE_SOURCES = [p.read_text(encoding="utf-8") for p in sorted(source.EXAMPLES.glob("*.smp"))]


@FAST
@given(SEEDS, st.sampled_from(range(len(EXAMPLE_SOURCES))))
def test_mutated_sources_compile_or_give_located_errors(seed, which):
    c = Counts("source")
    source.one(source.mutate(EXAMPLE_SOURCES[which], random.Random(seed)), c)
    clean(c)


@FAST
@given(SEEDS)
def test_generated_sources_compile_or_give_located_errors(seed):
    c = Counts("source")
    source.one(source.generate(random.Random(seed)), c)
    clean(c)


@pytest.fixture(scope="module")
def programs():
    return smpb.programs()


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_damaged_programs_are_refused_before_they_load(programs, seed):
    """Truncations, bit flips and splices of every example's .smpb: refused (the seal), never loaded as another
    program, never another exception."""
    from samplec import serialize
    import samplec
    rng = random.Random(seed)
    ir, data = rng.choice(programs)
    bad = smpb.damage(data, rng, rng.choice(programs)[1])
    try:
        g = serialize.from_bytes(bad)
    except samplec.SamplecError:
        return
    assert serialize.to_bytes(g) == data


def test_crafted_programs_load_and_run_without_crashing(programs):
    """The same damage sealed again (a crafted file): in a child process, each loads and runs or is refused."""
    rng = random.Random(7)
    files = []
    from samplec import serialize
    while len(files) < 80:
        ir, data = rng.choice(programs)
        bad = smpb.damage(data, rng, rng.choice(programs)[1])
        if len(bad) > serialize.SEAL_SIZE:
            files.append(serialize.seal(bad[:-serialize.SEAL_SIZE]))
    c = Counts("smpb")
    smpb.crafted_batch(files, c)
    clean(c)
    assert c.cases == len(files)


@pytest.mark.uncompiled
def test_bad_calls_budget():
    clean(runtime.fuzz(6, seed=11))


@pytest.mark.uncompiled
def test_differential_budget():
    clean(differential.fuzz(6, seed=12))
