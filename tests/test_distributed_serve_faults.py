"""A rank of `samplec serve` under `mlx.launch -n 2 --backend ring` that dies or stops answering: every other rank
ends with one clear line on stderr within a bounded time, never a hang -- rank 0 answers the requests in flight
with a 503 naming the cause first -- and an idle server outlives the bound (rank 0's heartbeat plans).

Each test starts the demo server (tests/distributed/worker_serve_faults.py), sends requests from this process,
kills (SIGKILL) or stops (SIGSTOP) one rank mid-request, and times what the other rank does. Every wait here is
bounded; past HARD_TIMEOUT the run counts as a hang."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).parent))

from test_distributed import HERE, LAUNCH, _free_port, _pythonpath  # noqa: E402

from samplec import serve  # noqa: E402
from samplec.diagnostics import SamplecError  # noqa: E402
from samplec.distributed import follow  # noqa: E402

needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")

HARD_TIMEOUT = 240      # seconds: start-up, or any wait past it, is a hang
PROMPT = "A sampler chain"
EOS = 1                 # the demo tokenizer's end of sequence: biased away, so a long request runs until stopped
LONG = {"model": "demo", "prompt": PROMPT, "max_tokens": 2000, "temperature": 1.0, "seed": 3,
        "logit_bias": {str(EOS): -100}}
SHORT = {"model": "demo", "prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "seed": 5}
# the causes a rank that died is named by: its lifeline to rank 0 closed, or the ring backend's connection error
# what a rank says when another dies: its lifeline closed, the ring failed, or the plan it waited for broke off
# (which comes first depends on the scheduler)
FOLLOWER_DIED = re.compile(r"rank 1 stopped \(its connection to rank 0 closed\)|a rank stopped \(\[ring\]|"
                           r"rank 1's header of plan \d+ did not arrive intact \(a rank stopped")
RANK0_DIED = re.compile(r"rank 0 stopped \(its connection to this rank closed\)|a rank stopped \(\[ring\]|"
                        r"rank 0's header of plan \d+ did not arrive intact \(a rank stopped")


class Served:
    """`samplec serve --demo FLAGS` on 2 ranks under mlx.launch, once both ranks serve."""

    def __init__(self, out: Path, *flags: str):
        self.out = out
        self.err_path = out / "launch.err"
        cmd = [LAUNCH, "-n", "2", "--backend", "ring", "-p", str(_free_port(2)), "--", sys.executable,
               str(HERE / "worker_serve_faults.py"), str(out), *flags]
        # (stdin a pipe left open: mlx.launch polls it, and /dev/null would always be readable)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=(out / "launch.out").open("w"),
                                     stderr=self.err_path.open("w"), env=dict(os.environ, PYTHONPATH=_pythonpath()))
        self.pids: list[int] = []
        end = time.monotonic() + HARD_TIMEOUT
        for r in range(2):
            path = out / f"ready{r}.json"
            while not path.exists():
                assert self.proc.poll() is None, f"mlx.launch ended before rank {r} served\n{self.stderr()}"
                assert time.monotonic() < end, f"rank {r} did not start within {HARD_TIMEOUT} s\n{self.stderr()}"
                time.sleep(0.2)
            info = json.loads(path.read_text())
            self.pids.append(info["pid"])
            if r == 0:
                self.port = info["port"]

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def connect(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, body: dict, timeout: float = 120) -> tuple[int, dict]:
        c = self.connect(timeout)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def active(self) -> int:
        c = self.connect(30)
        c.request("GET", "/health")
        return json.loads(c.getresponse().read())["active_rows"]

    def wait_active(self, n: int) -> None:
        end = time.monotonic() + 120
        while self.active() < n:
            assert time.monotonic() < end, "the requests were not admitted"
            time.sleep(0.1)

    def wait_exit(self, rank: int, within: float) -> float:
        """Seconds until rank's process ended (gone, or a zombie mlx.launch has not reaped yet); fails past
        `within`."""
        t0 = time.monotonic()
        while running(self.pids[rank]):
            assert time.monotonic() - t0 < within, f"rank {rank} still runs {within} s later\n{self.stderr()}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def finish(self) -> str:
        """Let every rank go (a stopped one is continued, so that mlx.launch's SIGTERM reaches it), wait for
        mlx.launch, and return its stderr (every rank's)."""
        for pid in self.pids:
            if running(pid):
                os.kill(pid, signal.SIGCONT)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.close()
        return self.stderr()

    def close(self) -> None:
        for pid in self.pids:
            if running(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def served(tmp_path):
    made = []

    def start(*flags: str) -> Served:
        made.append(Served(tmp_path, *flags))
        return made[-1]
    yield start
    for s in made:
        s.close()


def said(err: str, rank: int) -> list[str]:
    """The server's own lines from `rank` in mlx.launch's stderr (where the ring backend's messages, written piece
    by piece, may run into them)."""
    return re.findall(f"samplec serve: rank {rank} of 2: .*", err)


def in_background(fn):
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            box["error"] = e
        box["seconds"] = time.monotonic() - t0
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def stream_started(s: Served):
    """A long streamed request, once its first text arrived: (connection, response)."""
    c = s.connect(120)
    c.request("POST", "/v1/completions", json.dumps({**LONG, "stream": True, "seed": 4}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    while True:
        line = r.fp.readline()
        assert line, "the stream ended before its first text"
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
            return c, r


def rest_of(r) -> list[bytes]:
    return [line for line in r.fp.read().split(b"\n") if line.startswith(b"data: ")]


def a_503(t, box) -> tuple[str, float]:
    """The 503 a request running in `t` (in_background) gets: its error message and the seconds it took to come."""
    t0 = time.monotonic()
    t.join(30)
    assert "value" in box, box
    status, body = box["value"]
    assert status == 503, body
    return body["error"]["message"], time.monotonic() - t0


@needs_launch
def test_a_follower_that_dies_ends_rank_0_with_503s(served):
    s = served("--rank-timeout", "30")
    _, stream = stream_started(s)
    t, box = in_background(lambda: s.post(LONG))
    s.wait_active(2)
    os.kill(s.pids[1], signal.SIGKILL)
    msg, waited = a_503(t, box)
    assert msg.startswith("samplec serve: rank 0 of 2 ended: ") and FOLLOWER_DIED.search(msg), msg
    assert waited < 10, waited      # (a dead peer breaks the next collective at once; the bound is 30 s)
    events = rest_of(stream)
    # (the error event, then data: [DONE] as every stream ends -- vLLM's too)
    assert len(events) >= 2 and FOLLOWER_DIED.search(events[-2].decode()) and events[-1] == b"data: [DONE]", \
        events[-3:]
    s.wait_exit(0, 10)
    err = s.finish()
    lines = said(err, 0)
    assert len(lines) == 1 and FOLLOWER_DIED.search(lines[0]), err[-3000:]
    assert lines[0].endswith("exiting with status 70"), lines
    assert "Node with rank 0 exited with code 70" in err


@needs_launch
def test_rank_0_that_dies_ends_the_follower(served):
    s = served("--rank-timeout", "30")
    t, box = in_background(lambda: s.post(LONG))
    s.wait_active(1)
    os.kill(s.pids[0], signal.SIGKILL)
    waited = s.wait_exit(1, 10)
    t.join(30)
    assert "error" in box       # (rank 0 is gone: the connection closes without a response)
    err = s.finish()
    lines = said(err, 1)
    assert len(lines) == 1 and RANK0_DIED.search(lines[0]), err[-3000:]
    assert lines[0].endswith("exiting with status 70"), lines
    assert waited < 10


@needs_launch
def test_an_idle_server_outlives_the_bound_and_a_follower_that_hangs_ends_rank_0(served):
    s = served("--rank-timeout", "4")
    status, first = s.post(SHORT)
    assert status == 200, first
    time.sleep(10)                  # idle for 2.5 bounds: rank 0's plans every second keep every rank waiting
    assert running(s.pids[0]) and running(s.pids[1])
    status, again = s.post(SHORT)
    assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"], again
    # a follower that stops answering (alive, so no connection error): rank 0's step watch ends it
    t, box = in_background(lambda: s.post(LONG))
    s.wait_active(1)
    os.kill(s.pids[1], signal.SIGSTOP)
    msg, waited = a_503(t, box)
    assert "no answer from the other ranks within 4 s during" in msg and "(a rank stopped or hangs)" in msg, msg
    assert 2 < waited < 4 + 8, waited   # (the bound, then at most 2 s to answer, and this loaded machine)
    s.wait_exit(0, 10)
    err = s.finish()
    assert "Node with rank 0 exited with code 70" in err


@needs_launch
def test_rank_0_that_hangs_ends_the_follower(served):
    s = served("--rank-timeout", "4")
    status, _ = s.post(SHORT)
    assert status == 200
    os.kill(s.pids[0], signal.SIGSTOP)
    waited = s.wait_exit(1, 4 + 8)
    err = s.finish()
    lines = said(err, 1)
    assert len(lines) == 1, err[-3000:]
    assert "no answer from the other ranks within 4 s during the wait for rank 0's plan" in lines[0], lines
    assert waited > 2, waited


# ---- in one process ----

def test_rank_timeout_is_an_option_of_a_sharded_server_only():
    with pytest.raises(SamplecError, match="--rank-timeout: only under mlx.launch"):
        serve.serve(["--rank-timeout", "10", "--port", "0"], [], True)


def test_which_errors_end_the_ranks():
    assert follow.rank_failure(RuntimeError("[ring] connection to a peer was lost")) == \
        "a rank stopped ([ring] connection to a peer was lost)"
    assert follow.rank_failure(follow.PlanError("rank 1's header of plan 3 did not arrive intact"))
    assert follow.rank_failure(SamplecError("sharded call: the batch size B differs across ranks (...)"))
    assert follow.rank_failure(SamplecError("logits: NaN or +inf (row 0)")) is None
    assert follow.rank_failure(ValueError("a batch's own failure")) is None


def test_a_plan_round_trips_on_one_rank():
    import mlx.core as mx
    group = mx.distributed.init()
    plan = {"end": False, "gone": [2], "admit": [{"kind": "chat", "body": {"x": "\u00e9" * 7}, "seeds": ["1"]}]}
    assert follow.send_plan(plan, group, 7) == plan
    assert follow.broadcast(b"abcde", group, 8) == b"abcde" and follow.broadcast(b"", group, 9) == b""


def test_the_step_watch_calls_back_at_its_deadline_and_not_when_disarmed():
    got: list = []
    w = follow.StepWatch(0.3, got.append)
    w.arm("step 1")
    w.disarm()
    time.sleep(0.6)
    assert got == []
    t0 = time.monotonic()
    w.arm("step 2")
    while not got and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert got == ["no answer from the other ranks within 0.3 s during step 2 (a rank stopped or hangs)"]
    assert 0.25 < time.monotonic() - t0 < 5
