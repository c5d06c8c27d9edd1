"""`samplec serve --demo` under `mlx.launch -n 2` (the ring backend on loopback): the LM head split over the ranks
(`shard_lm_head`: each rank holds only its rows), rank 0 serving HTTP and the other rank following its steps.
Every response -- sequential, streamed and batched together -- is the plain one-process server's for the same
request and seed (tokens and text exactly, log-probabilities to float32 rounding: the sharded sums are added in
another order), and every rank finished the same rows with the same tokens."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
sys.path.insert(0, str(Path(__file__).parent))

from serve_requests import CONCURRENT, REQUESTS, STREAMED, finishes_of, send, text_of  # noqa: E402
from test_distributed import LAUNCH, launch  # noqa: E402

from samplec import serve  # noqa: E402

pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


@pytest.fixture(scope="module")
def plain():
    """The unsharded demo server in this process, and its answers to every request."""
    ready, box = threading.Event(), {}

    def on_ready(httpd, app):
        box.update(httpd=httpd, app=app)
        ready.set()
    t = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0"], [], True, on_ready),
                         daemon=True)
    t.start()
    assert ready.wait(120)
    host, port = box["httpd"].server_address[:2]
    c = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
    answers = {name: send(c, name) for name in REQUESTS}
    box["httpd"].shutdown()
    t.join(60)
    return answers


def close(a, b) -> bool:
    return a is None and b is None or a is not None and b is not None and abs(a - b) <= 2e-5 * max(1.0, abs(a))


def same_logprobs(want: dict, got: dict) -> list[str]:
    bad = []
    for cw, cg in zip(want["choices"], got["choices"]):
        lw, lg = cw["logprobs"], cg["logprobs"]
        if lw is None or lg is None:
            if lw != lg:
                bad.append("logprobs present on one side only")
            continue
        if "content" in lw:
            for ew, eg in zip(lw["content"], lg["content"]):
                if ew["bytes"] != eg["bytes"] or not close(ew["logprob"], eg["logprob"]) or \
                        [t["bytes"] for t in ew["top_logprobs"]] != [t["bytes"] for t in eg["top_logprobs"]] or \
                        not all(close(x["logprob"], y["logprob"]) for x, y in zip(ew["top_logprobs"],
                                                                                  eg["top_logprobs"])):
                    bad.append(f"{ew} vs {eg}")
        else:
            if lw["tokens"] != lg["tokens"] or lw["text_offset"] != lg["text_offset"] or \
                    not all(close(x, y) for x, y in zip(lw["token_logprobs"], lg["token_logprobs"])):
                bad.append(f"{lw} vs {lg}")
    return bad


def test_serve_with_a_vocabulary_parallel_lm_head(tmp_path, plain):
    reports = launch(2, "worker_serve.py", tmp_path)
    for rep in reports:
        assert rep["error"] is None, rep["error"]
        assert rep["size"] == 2 and rep["head_rows"] == rep["rows"] == 256 and rep["vocab"] == 512
    assert [r["start"] for r in reports] == [0, 256]
    got = reports[0]["responses"]
    for name, want in plain.items():
        assert text_of(got[name]) == text_of(want), name
        assert finishes_of(got[name]) == finishes_of(want), name
        assert got[name]["usage"] == want["usage"], name
        if "choices" in want:
            assert same_logprobs(want, got[name]) == [], name
    for name in STREAMED:
        assert got["stream:" + name]["texts"] == text_of(plain[name]), name
        assert got["stream:" + name]["usage"] == plain[name]["usage"]
    for name in CONCURRENT:
        assert text_of(got["together:" + name]) == text_of(plain[name]), name
    # every rank finished the same rows with the same tokens (rank 1 served nothing itself)
    assert reports[1]["responses"] == {}
    assert reports[0]["finished"] == reports[1]["finished"]
    assert len(reports[0]["finished"]) == sum(len(text_of(r)) for r in plain.values()) + \
        sum(len(text_of(plain[n])) for n in (*STREAMED, *CONCURRENT))
    # (the requests tell samplers apart: the sampled texts are not all one token)
    assert len(set(text_of(plain["sampled"])[0])) > 4
