"""Run under `mlx.launch -n N`: `samplec serve --demo` on every rank (the CLI's own path: under mlx.launch it
splits the demo model's LM head over the ranks; rank 0 listens, the others follow its steps). Rank 0 sends the
requests of serve_requests.py with the openai client -- one after another, streamed, and several at once --
then shuts the server down, which ends every rank. Each rank writes OUT/rank<r>.json: the LM head rows it held and
every row it finished (request number, choice, tokens, text); rank 0 also the responses."""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))

import mlx.core as mx  # noqa: E402
import openai  # noqa: E402

from samplec import serve  # noqa: E402
from serve_requests import CONCURRENT, REQUESTS, STREAMED, send  # noqa: E402


def main(out_dir: str) -> None:
    group = mx.distributed.init()
    rank = group.rank()
    report: dict = {"rank": rank, "size": group.size(), "finished": [], "responses": {}, "error": None}

    def client(httpd):
        try:
            host, port = httpd.server_address[:2]
            c = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
            res = report["responses"]
            for name in REQUESTS:
                res[name] = send(c, name)
            for name in STREAMED:
                res["stream:" + name] = send(c, name, stream=True)
            with ThreadPoolExecutor(len(CONCURRENT)) as ex:
                for name, r in zip(CONCURRENT, ex.map(lambda n: send(c, n), CONCURRENT)):
                    res["together:" + name] = r
        except Exception:  # noqa: BLE001 - reported to the test
            report["error"] = traceback.format_exc()
        finally:
            httpd.shutdown()

    def ready(httpd, app):
        eng = app.engine
        s = eng.model.samplec_vocab
        report.update(start=s.start, rows=s.size, vocab=s.vocab,
                      head_rows=int(eng.model.model.embed_tokens.rows.weight.shape[0]))
        finish = eng._finish

        def recording(row, reason, in_batch):
            finish(row, reason, in_batch)
            report["finished"].append({"job": row.job.number, "index": row.index, "finish": reason,
                                       "tokens": [r[0] for r in row.records[:row.delivered]], "text": row.text})
        eng._finish = recording
        if httpd is not None:
            threading.Thread(target=client, args=(httpd,), daemon=True).start()

    try:
        serve.serve(["--host", "127.0.0.1", "--port", "0"], [], True, ready)
    except Exception:  # noqa: BLE001
        report["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
