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
HARD_TIMEOUT = 300      # seconds: a run past it is a hang (the workers' own waits are bounded well below it)

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


def _pythonpath() -> str:
    """The checkout first, then whatever PYTHONPATH the tests run with."""
    return os.pathsep.join(p for p in (str(HERE.parent.parent), os.environ.get("PYTHONPATH")) if p)


def launch(n: int, script: str, out: Path, *args: str) -> list[dict]:
    """Run tests/distributed/SCRIPT on n ranks; every rank's OUT/rank<r>.json (mlx.launch exits 0 whatever its
    ranks do: each rank's report is the result)."""
    cmd = [LAUNCH, "-n", str(n), "--backend", "ring", "-p", str(_free_port(n)), "--",
           sys.executable, str(HERE / script), str(out), *args]
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT, env=env)
    reports = []
    for r in range(n):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_equals_unsharded(tmp_path, n):
    """n = 2: every program on every kind of row; n = 3 (three processes on as few as two cores): every program on
    one kind of row each, the kinds in turn."""
    reports = launch(n, "worker_stages.py", tmp_path, *(["all"] if n == 2 else []))
    for rep in reports:
        assert rep["size"] == n
        assert rep["cases"] >= (60 if n == 2 else 20)
        assert rep["mismatches"] == [], "\n".join(rep["mismatches"][:20])


MISMATCH_ERRORS = {
    "gap": "the slices do not tile the vocabulary [0, 100): they end at 99",
    "overlap": "the slices do not tile the vocabulary [0, 100): an overlap",
    "batch": "the batch size B differs across ranks",
    "param": "parameter 't' differs across ranks",
    "vocab": "vocab_size differs across ranks",
    "program": "the ranks run different programs",
}


def test_mismatched_calls_fail_on_every_rank(tmp_path):
    reports = launch(2, "worker_faults.py", tmp_path, "mismatch")
    for rep in reports:
        events = {e[0]: e for e in rep["events"]}
        for label, text in MISMATCH_ERRORS.items():
            assert events[label][1] == "error" and text in events[label][2], (rep["rank"], events[label])
        assert events["good"][1:3] == ["ok", True], events["good"]     # (the group still works afterwards)
        assert events["os_seed"][1] == "ok", events["os_seed"]
    # every rank raised the same errors, and drew the same tokens from the lowest rank's OS seed
    assert [e[2] for e in reports[0]["events"]] == [e[2] for e in reports[1]["events"]]


def spawn(n: int, script: str, out: Path, *args: str) -> tuple[list[dict], list[int]]:
    """Run SCRIPT as n ring ranks started one by one (not by mlx.launch, which ends every rank once one exits);
    each is killed past HARD_TIMEOUT (the last one once the others ended). Every rank's report and exit status."""
    base = _free_port(n)
    hosts = out / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    procs = [subprocess.Popen([sys.executable, str(HERE / script), str(out), *args],
                              env=dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(r),
                                       PYTHONPATH=_pythonpath()),
                              stdout=subprocess.DEVNULL, stderr=(out / f"stderr{r}.txt").open("w"))
             for r in range(n)]
    try:
        for p in procs[:-1]:
            p.wait(timeout=HARD_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)], [p.returncode for p in procs]


STOPPED = ("did not arrive intact", "no answer from the other ranks within 3 s", "connection to a peer was lost",
           "is not a samplec.distributed header", "the group is unusable", "outputs differ")


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_rank_that_stops_gives_an_error_not_a_hang(tmp_path, mode):
    """The last rank exits (or sleeps) after one good call: the others' next calls raise, each within its
    3-second bound (the harness kills the run past HARD_TIMEOUT: a hang fails the test)."""
    reports, _ = spawn(3, "worker_faults.py", tmp_path, mode)
    for rep in reports[:-1]:
        events = {e[0]: e for e in rep["events"]}
        assert events["good"][1:3] == ["ok", True]
        for label in ("after", "again"):
            assert events[label][1] == "error" and any(s in events[label][2] for s in STOPPED), events[label]


def test_decode_with_a_vocabulary_parallel_lm_head(tmp_path):
    """samplec.decode.generate with a random llama whose LM head `shard_lm_head` split over 2 ranks (tied and
    untied): each rank holds only its rows, and every rank emits the tokens of the one-process loop."""
    reports = launch(2, "worker_decode.py", tmp_path)
    for rep in reports:
        assert len(rep["results"]) == 8
        for res in rep["results"]:
            assert res["head_rows"] == res["rows"] < 611
            assert res["got"] == res["want"], res
    # the ranks agree (and the sampled runs are not all one token: the test can tell programs apart)
    assert [r["got"] for r in reports[0]["results"]] == [r["got"] for r in reports[1]["results"]]
    assert any(len(set(r["got"])) > 3 for r in reports[0]["results"])


def test_a_rank_that_hangs_ends_the_others_with_on_timeout_exit(tmp_path):
    """on_timeout="exit" (the default): past the timeout a rank prints the error and exits with status 70."""
    reports, codes = spawn(2, "worker_faults.py", tmp_path, "hang_exit")
    assert reports[0]["events"][0][1:3] == ["ok", True]
    assert codes[0] == 70
    err = (tmp_path / "stderr0.txt").read_text()
    assert "samplec.distributed: no answer from the other ranks within 3 s" in err
