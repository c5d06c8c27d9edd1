"""samplec.distributed.shard under `mlx.launch -n 2` and `-n 3` (the ring backend on loopback): on every rank, the
outputs of every program of tests/distributed/cases.py on uneven slices equal the unsharded program's on the whole
row; and the faults (slices that do not tile the vocabulary, different batch sizes or parameters across ranks, a
rank that stops) give a clear error on every rank that still runs, within a bounded time."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "distributed"
LAUNCH = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")
HARD_TIMEOUT = 150      # seconds: a run past it is a hang (the workers' own waits are bounded well below it)

pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def _free_port(n: int) -> int:
    """A base port with n free ports after it (the ring backend listens on base + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def launch(n: int, script: str, out: Path, *args: str) -> list[dict]:
    """Run tests/distributed/SCRIPT on n ranks; every rank's OUT/rank<r>.json (mlx.launch exits 0 whatever its
    ranks do: each rank's report is the result)."""
    cmd = [LAUNCH, "-n", str(n), "--backend", "ring", "-p", str(_free_port(n)), "--",
           sys.executable, str(HERE / script), str(out), *args]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT, env=env)
    reports = []
    for r in range(n):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_equals_unsharded(tmp_path, n):
    reports = launch(n, "worker_stages.py", tmp_path)
    for rep in reports:
        assert rep["size"] == n
        assert rep["cases"] >= 60
        assert rep["mismatches"] == [], "\n".join(rep["mismatches"][:20])
