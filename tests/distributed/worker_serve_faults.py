"""Run under `mlx.launch -n N`: `samplec serve --demo` on every rank with the server flags given after OUT (rank 0
listens on a free port). Once serving, each rank writes OUT/ready<r>.json -- its process id and, on rank 0, the
port -- for tests/test_distributed_serve_faults.py, which sends the requests and stops or kills the ranks. A rank
that returns from the server writes OUT/returned<r>.json."""
from __future__ import annotations

import json
import os
import sys

from samplec import serve


def main(out_dir: str, flags: list[str]) -> None:
    rank = int(os.environ.get("MLX_RANK", "0"))

    def ready(httpd, app):
        info = {"rank": rank, "pid": os.getpid(), "port": httpd.server_address[1] if httpd is not None else None}
        tmp = os.path.join(out_dir, f".ready{rank}.json")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(out_dir, f"ready{rank}.json"))

    serve.serve(["--host", "127.0.0.1", "--port", "0", *flags], [], True, ready)
    with open(os.path.join(out_dir, f"returned{rank}.json"), "w") as f:
        json.dump({"rank": rank}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
