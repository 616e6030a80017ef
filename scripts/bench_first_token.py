"""Cold start of `jserve serve`: seconds to ready (/health 200) and to the first token, per backend.

Each run starts `jserve serve --attention-backend B` in a fresh process with an empty
`JSERVE_COMPILATION_CACHE` (a new temporary folder; with `--fresh-kernel-cache` an empty native
kernel cache too, so the C++ kernels are built again) and times, from the moment the process is
started, its `/health` answer and the answer of a one-token `/v1/completions`. The converted
checkpoint is taken as it is on disk (convert it once before: `jserve generate` does). #26's
target: the first token within 30 s on every backend.

    python scripts/bench_first_token.py --backends cpu reference cpu_pallas --rounds 2 --out cold.json

Prints a table (median over rounds) and writes JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(backend: str, args: argparse.Namespace) -> dict:
    """One cold start: {"ready": s, "first_token": s} (None where it did not come in time)."""
    port = _free_port()
    caches = {"JSERVE_COMPILATION_CACHE": tempfile.mkdtemp(prefix="jserve-cold-")}
    if args.fresh_kernel_cache:
        caches["JSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="jserve-kernels-")
    env = {**os.environ, **caches}
    cmd = [sys.executable, "-m", "jserve.cli", "serve", "--port", str(port), "--attention-backend", backend]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"jserve-cold-{backend}-", suffix=".log", delete=False)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    ready = first = None
    try:
        while first is None and proc.poll() is None and time.monotonic() - t0 < args.timeout:
            try:
                if ready is None:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                    ready = time.monotonic() - t0
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=args.timeout).read()
                first = time.monotonic() - t0
            except OSError:
                time.sleep(0.2)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for folder in caches.values():  # the log stays, for a failed run
            shutil.rmtree(folder, ignore_errors=True)
    return {"backend": backend, "ready": ready, "first_token": first, "log": log.name,
            "exit_code": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["cpu", "reference", "cpu_pallas"])
    p.add_argument("--model", default=None, help="default: the server's default model")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1, help="runs per backend, alternated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take to its first token")
    p.add_argument("--target", type=float, default=30.0)
    p.add_argument("--fresh-kernel-cache", action="store_true", help="also build the native kernels again")
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    runs = [run_once(b, args) for _ in range(args.rounds) for b in args.backends]
    print(f"{'backend':<12} {'ready s':>8} {'first token s':>14}  within {args.target:.0f} s")
    summary = {}
    for b in args.backends:
        mine = [r for r in runs if r["backend"] == b]
        ready = [r["ready"] for r in mine if r["ready"] is not None]
        first = [r["first_token"] for r in mine if r["first_token"] is not None]
        med = statistics.median(first) if len(first) == len(mine) else None
        summary[b] = {"ready_median": statistics.median(ready) if ready else None, "first_token_median": med}
        ready_s = f"{statistics.median(ready):8.1f}" if ready else f"{'-':>8}"
        first_s = f"{med:14.1f}" if med is not None else f"{'(failed)':>14}"
        print(f"{b:<12} {ready_s} {first_s}  {'yes' if med is not None and med <= args.target else 'no'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "target_seconds": args.target,
                                              "max_model_len": args.max_model_len}, indent=2))
    failed = [r for r in runs if r["first_token"] is None]
    for r in failed:
        print(f"{r['backend']}: no first token (exit code {r['exit_code']}); its log: {r['log']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
