"""Speed right after `/health` turns 200 vs once the server is warm (jserve's lazy buckets compiled).

For each concurrency, a fresh `jserve serve SERVE_ARGS`: one `jserve bench --workload short-short
--scale S --num-requests N --concurrency C` (eos ignored) the moment it is ready (`--no-wait-warm`),
then, after waiting until /health stops saying "warming", the same load again. Prints output tok/s,
TTFT and TPOT medians of both and their ratio; `--tree DIR` serves another checkout's jserve (its
PYTHONPATH) to compare code versions.

    python -m benchmarks.serving.ready_vs_steady --concurrency 1 16 --out ready.json
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from benchmarks.harness import ServerProcess, bench, parser, report
from jserve.bench.server import wait_warm


def measure(server: ServerProcess, c: int, requests: int, scale: float) -> dict:
    """One load, without waiting for warm: its headline figures and the buckets still pending after."""
    m = bench(server.url, "--workload", "short-short", "--scale", str(scale), "--num-requests", str(requests),
              "--concurrency", str(c), "--extra-body", '{"ignore_eos": true}', "--no-wait-warm")
    return {"tok_s": m["output_throughput"], "ttft_ms": m["ttft_ms"]["median"], "tpot_ms": m["tpot_ms"]["median"],
            "pending_after": server.metric("jserve_buckets_pending")}


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--serve-args", default="", help="flags for jserve serve")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per concurrent stream")
    p.add_argument("--scale", type=float, default=2.0, help="of short-short's 32-word prompts and 32 tokens")
    p.add_argument("--tree", default=None, help="serve the jserve of this checkout (its PYTHONPATH)")
    args = p.parse_args(argv)
    env = {"PYTHONPATH": os.path.abspath(args.tree)} if args.tree else None
    # -P: the current folder not first on sys.path, so that PYTHONPATH's jserve is the one served
    command = [sys.executable, "-P", "-m", "jserve.cli", "serve", "--port", "{port}", *shlex.split(args.serve_args)]
    rows = []
    for c in args.concurrency:
        with ServerProcess(command=command, env=env, wait_warm=None) as server:
            pending = server.metric("jserve_buckets_pending")
            ready = measure(server, c, c * args.requests_per_stream, args.scale)
            waited, warm = wait_warm(server.url, 900)
            while server.metric("jserve_buckets_pending") > 0 and waited < 900:  # a jserve before /health said it
                time.sleep(0.5)
                waited += 0.5
            steady = measure(server, c, c * args.requests_per_stream, args.scale)
        rows.append({"concurrency": c, "pending_at_ready": pending, "ready_tok_s": ready["tok_s"],
                     "steady_tok_s": steady["tok_s"], "ratio": ready["tok_s"] / steady["tok_s"],
                     "ready_ttft_ms": ready["ttft_ms"], "steady_ttft_ms": steady["ttft_ms"],
                     "ready_tpot_ms": ready["tpot_ms"], "steady_tpot_ms": steady["tpot_ms"],
                     "pending_after_ready_run": ready["pending_after"], "waited_for_warmup_s": waited, "warm": warm})
    report(rows, args.out, title=f"jserve serve {args.serve_args} (tree {args.tree or 'this one'})",
           serve_args=args.serve_args, tree=args.tree, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
