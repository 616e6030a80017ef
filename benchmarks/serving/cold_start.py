"""Cold start of `jserve serve`: seconds to ready (/health 200) and to the first token, per backend.

Each run starts `jserve serve [--backend B]` ("default": the server's own choice) in a
fresh process with an empty `JSERVE_COMPILATION_CACHE` (with `--fresh-kernel-cache` an empty native
kernel cache too, so the C++ kernels are built again) and times, from the moment the process is
started, its `/health` answer and then the answer of a one-token `/v1/completions`. The converted
checkpoint is taken as it is on disk (convert it once before: `jserve generate` does). #26's
target: the first token within 30 s on every backend. Prints a table (median over rounds) and
writes JSON with every run; exit 1 when a run got no first token.

    python -m benchmarks.serving.cold_start --backends cpu reference cpu_pallas --rounds 2 --out cold.json
    python -m benchmarks.serving.cold_start --max-model-len 512 --timeout 100    # the device check's part
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

from benchmarks.harness import ServerProcess, parser, report


def run_once(backend: str, args) -> dict:
    """One cold start: {"ready": s, "first_token": s} (None where it did not come in time)."""
    caches = {"JSERVE_COMPILATION_CACHE": tempfile.mkdtemp(prefix="jserve-cold-")}
    if args.fresh_kernel_cache:
        caches["JSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="jserve-kernels-")
    flags = [*(["--backend", backend] if backend != "default" else []),
             *(["--model", args.model] if args.model else []),
             *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
    server = ServerProcess(flags, env=caches, timeout=args.timeout, wait_warm=None)  # the first token right at ready
    ready = first = None
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    try:
        with server:
            ready = server.startup_s
            t0 = time.monotonic()
            request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=max(args.timeout - ready, 1)).read()
            first = ready + time.monotonic() - t0
    except (RuntimeError, OSError) as e:
        print(f"{backend}: {e}", file=sys.stderr)
    finally:
        for folder in caches.values():  # the log stays, for a failed run
            shutil.rmtree(folder, ignore_errors=True)
    return {"backend": backend, "ready": ready, "first_token": first, "log": str(server.log),
            "exit_code": server.proc.returncode if server.proc else None}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--backends", nargs="+", default=["default"], help="--backend values, or default")
    p.add_argument("--model", default=None, help="default: the server's default model")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1, help="runs per backend, alternated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take to its first token")
    p.add_argument("--target", type=float, default=30.0)
    p.add_argument("--fresh-kernel-cache", action="store_true", help="also build the native kernels again")
    args = p.parse_args(argv)
    runs = [run_once(b, args) for _ in range(args.rounds) for b in args.backends]
    rows = []
    for b in args.backends:
        mine = [r for r in runs if r["backend"] == b]
        ready = [r["ready"] for r in mine if r["ready"] is not None]
        first = [r["first_token"] for r in mine if r["first_token"] is not None]
        med = statistics.median(first) if len(first) == len(mine) else None
        rows.append({"backend": b, "ready_s": statistics.median(ready) if ready else None, "first_token_s": med,
                     "within_target": med is not None and med <= args.target})
    report(rows, args.out, title=f"median of {args.rounds} cold start(s); target {args.target:g} s", runs=runs,
           target_seconds=args.target, max_model_len=args.max_model_len)
    return 1 if any(r["first_token"] is None for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
