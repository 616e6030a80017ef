#!/usr/bin/env python3
"""What speculative decoding buys: the verify step's cost against a decode step per batch size
(where the turn-down default comes from), and `jserve bench` throughput of the same model served
with and without n-gram speculation, side by side in one run.

Parts:
- `step`: the default model's runner, in process: the median time of a decode step and of a
  verify step (k drafts per row) at each batch size, and their ratio: the tokens a verified row
  must gain per step (1 + accepted drafts) to break even.
- `server`: two `jserve serve` processes, plain and speculative (`--speculative-config`), up at
  once, benchmarked in alternation (each round runs every load on both): the `copy` workload at
  concurrency 1 (the output repeats the prompt) and `mix` at concurrency 16; the speculative
  server's acceptance numbers from /metrics.

    python scripts/bench_speculative.py --parts step,server --out bench_speculative.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--parts", default="step,server", help="step, server or both (comma-separated)")
    p.add_argument("--reps", type=int, default=20, help="calls per variant in the step part")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every load on both servers")
    p.add_argument("--copy-requests", type=int, default=6)
    p.add_argument("--mix-requests", type=int, default=48)
    p.add_argument("--mix-scale", type=float, default=0.5, help="--scale of the mix workload")
    p.add_argument("--serve-args", default="--max-model-len 2048", help="flags for both servers")
    p.add_argument("--out", default="bench_speculative.json")
    return p.parse_args(argv)


def step_part(args) -> list[dict]:
    from jserve import LLM
    from jserve.runtime.steps import StepRow

    llm = LLM(args.model, max_model_len=2048, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                                                      "disable_by_batch_size": 1024})
    runner = llm.engine.runner
    pages = list(range(1, 1 + 512 // runner.page_size))
    rows = []
    for B in runner.verify_buckets:  # every decode bucket: the cap above is past them all
        decode = [StepRow(400, [7], pages)] * B
        verify = [StepRow(400, [7], pages, draft_ids=[7] * args.k)] * B

        def median_ms(fn) -> float:
            fn()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return 1000 * statistics.median(times)

        d = median_ms(lambda: runner.execute(decode))
        v = median_ms(lambda: runner.execute_verify(verify))
        rows.append({"batch": B, "decode_ms": d, "verify_ms": v, "ratio": v / d})
    print(f"{'batch':>5} {'decode ms':>10} {'verify ms (k=' + str(args.k) + ')':>17} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['decode_ms']:>10.2f} {r['verify_ms']:>17.2f} {r['ratio']:>6.2f}")
    return rows


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _start(jserve: str, args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = [jserve, "serve", "--port", str(port), *(["--model", args.model] if args.model else []),
           *args.serve_args.split(), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 1200
    while True:
        try:
            if _get(url + "/health"):
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(1)


def _bench(jserve: str, url: str, workload: str, n: int, concurrency: int, scale: float, out: Path) -> dict:
    cmd = [jserve, "bench", "--base-url", url, "--workload", workload, "--num-requests", str(n),
           "--concurrency", str(concurrency), "--scale", str(scale), "--output-dir", str(out), "--no-plots",
           "--quiet", "--extra-body", json.dumps({"temperature": 0, "ignore_eos": True})]
    subprocess.run(cmd, check=True)
    run = json.loads((out / "results.json").read_text())["runs"][0]["metrics"]
    if run["failed"]:
        raise SystemExit(f"{run['failed']} requests failed: {run.get('errors')}")
    return run


SPEC_KEYS = ("jserve_spec_proposed_tokens", "jserve_spec_accepted_tokens", "jserve_spec_verify_rows",
             "jserve_spec_verify_steps", "jserve_spec_turned_down_steps")


def server_part(args) -> dict:
    jserve = str(Path(sys.executable).with_name("jserve"))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    servers = {"plain": _start(jserve, args, []), "ngram": _start(jserve, args, ["--speculative-config", spec])}
    loads = {"copy c=1": ("copy", args.copy_requests, 1, 1.0),
             "mix c=16": ("mix", args.mix_requests, 16, args.mix_scale)}
    rows = []
    try:
        for proc, url in servers.values():
            _wait(proc, url)
        with tempfile.TemporaryDirectory() as tmp:
            for name, url in ((n, u) for n, (_, u) in servers.items()):  # warm the caches and the tokenizer
                _bench(jserve, url, "copy", 2, 1, 0.25, Path(tmp) / f"warm-{name}")
            for r in range(args.rounds):
                for load, (workload, n, c, scale) in loads.items():
                    for name, (_, url) in servers.items():
                        before = _get(url + "/metrics")
                        m = _bench(jserve, url, workload, n, c, scale, Path(tmp) / f"{name}-{r}-{workload}")
                        after = _get(url + "/metrics")
                        d = {k: _metric(after, k) - _metric(before, k) for k in SPEC_KEYS}
                        proposed, accepted, verified = (d[k] for k in SPEC_KEYS[:3])
                        rows.append({"round": r, "load": load, "server": name, "output_tok_s": m["output_throughput"],
                                     "tpot_ms_p50": m["tpot_ms"]["median"], "output_tokens": m["total_output_tokens"],
                                     "acceptance_rate": accepted / proposed if proposed else None,
                                     "mean_accepted_length": 1 + accepted / verified if verified else None,
                                     "verify_steps": d["jserve_spec_verify_steps"],
                                     "turned_down_steps": d["jserve_spec_turned_down_steps"],
                                     "compilations_after_warmup": _metric(after, "jserve_compilations_after_warmup")})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"{'round':>5} {'load':<9} {'server':<6} {'out tok/s':>10} {'TPOT p50 ms':>12} {'accept':>7} "
          f"{'tok/verify':>10} {'turned down':>11}")
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        print(f"{r['round']:>5} {r['load']:<9} {r['server']:<6} {r['output_tok_s']:>10.1f} {r['tpot_ms_p50']:>12.1f} "
              f"{acc:>7} {length:>10} {r['turned_down_steps']:>11.0f}")
    summary = {}
    for load in loads:
        med = {s: statistics.median(r["output_tok_s"] for r in rows if r["load"] == load and r["server"] == s)
               for s in servers}
        summary[load] = {**med, "ratio": med["ngram"] / med["plain"]}
        print(f"{load}: median output tok/s plain {med['plain']:.1f}, ngram {med['ngram']:.1f}; "
              f"ratio {med['ngram'] / med['plain']:.2f}")
    return {"rows": rows, "summary": summary}


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"config": vars(args)}
    if "step" in parts:
        result["step"] = step_part(args)
    if "server" in parts:
        result["server"] = server_part(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
