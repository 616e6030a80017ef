#!/usr/bin/env python3
"""What structured outputs cost: `jserve bench` throughput with every request constrained by a JSON
schema against the same load unconstrained, side by side on one server, and the host time the
grammar masks take per step (the server's /metrics).

One `jserve serve` (the default model unless --model) serves both loads, alternated for
--rounds rounds (free, constrained, free, constrained, ...) so that the machine's noise falls on
both; the table gives each round and the medians' ratio (the issue's target: >= 0.9). The
constrained requests use a schema whose output is longer than max_tokens (an array of at least 64
bounded objects), so both loads run every request to max_tokens and their token counts match;
`ignore_eos` keeps the free ones going. Both use the chat endpoint, greedy.

`--parts sampler` (also part of the default run, first) times the pieces in this process: the
jitted sampler at batch 16 over the 49152-token vocabulary with no constrained row (the cached
all-ones mask; the unpacking skipped) and with every row constrained, against the sampler with
no mask input at all (what it was before structured outputs), and llguidance's bitmask fill for 16
rows along random walks of this schema (host time per step, each after a new token), median of
--reps calls each.

    .venv/bin/python scripts/bench_structured.py --out structured.json
    .venv/bin/python scripts/bench_structured.py --concurrency 16 --num-requests 32 --rounds 3
    .venv/bin/python scripts/bench_structured.py --parts sampler
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string", "maxLength": 24},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue", "new"]}},
                   "score": {"type": "number", "minimum": 0, "maximum": 1},
                   "ok": {"type": "boolean"}}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `jserve serve --model` takes (default: the default model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32, help="requests per round and load")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-args", default="", help="more `jserve serve` flags, e.g. '--max-num-seqs 16'")
    p.add_argument("--parts", default="sampler,server", help="sampler, server or both (comma-separated)")
    p.add_argument("--reps", type=int, default=50, help="calls per variant in the sampler part")
    p.add_argument("--out", default="bench_structured.json")
    return p.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def _workload(path: Path, n: int, max_tokens: int) -> None:
    """n chat requests asking for records, each with its own prompt (no prefix-cache effects)."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Request {i}: list records of items as a JSON array of objects with "
                                          f"id, name, tags, score and ok.", "max_tokens": max_tokens}) + "\n")


def _bench(jserve: str, url: str, workload: Path, args, extra: dict, out_dir: Path) -> dict:
    cmd = [jserve, "bench", "--base-url", url, "--endpoint", "chat", "--workload", str(workload),
           "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
           "--extra-body", json.dumps(extra), "--output-dir", str(out_dir), "--no-plots", "--quiet"]
    subprocess.run(cmd, check=True)
    run = json.loads((out_dir / "results.json").read_text())["runs"][0]["metrics"]
    if run["failed"]:
        raise SystemExit(f"{run['failed']} requests failed: {run.get('errors')}")
    return run


def sampler_part(reps: int) -> dict:
    """Sampler and mask-fill times (ms, medians), see the module docstring."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jserve.core.request import SamplingParams, StructuredOutputsParams
    from jserve.model.checkpoint import resolve_model
    from jserve.runtime import device_steps
    from jserve.runtime.sampler import SamplingArrays, penalty_history
    from jserve.structured.grammar import GrammarCompiler, allowed_tokens, bitmask_width, fill_bitmasks
    from jserve.text.tokenizer import Tokenizer

    B, V = 16, 49152
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)), jnp.float32)
    sampling = SamplingArrays.build([(SamplingParams(temperature=0), 0)] * B, B)
    history = penalty_history([None] * B, B, 2048, V)
    free = jax.device_put(np.full((B, bitmask_width(V)), -1, np.int32))
    tokenizer = Tokenizer.load(resolve_model(None))
    compiler = GrammarCompiler(tokenizer, V, tokenizer.eos_token_ids)
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    matchers = [grammar.matcher() for _ in range(B)]
    prefix = tokenizer.encode('[{"id": 12, "name": "a', add_special_tokens=False)
    for m in matchers:
        for t in prefix:
            m.consume(t)
    host = np.full((B, bitmask_width(V)), -1, np.int32)
    fill_bitmasks([(m, i) for i, m in enumerate(matchers)], host)
    constrained = jax.device_put(host)
    with_mask = jax.jit(device_steps.sample_rows)
    without = jax.jit(lambda l, s, h: device_steps.sample(l, s, penalties=h, num_logprobs=20))

    def median_ms(fn) -> float:
        jax.block_until_ready(fn())
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    rng = np.random.default_rng(1)
    fills = []
    for _ in range(reps):  # each step after a new token, as in serving (a repeated state is cached)
        out = np.full((B, bitmask_width(V)), -1, np.int32)
        t0 = time.perf_counter()
        fill_bitmasks([(m, i) for i, m in enumerate(matchers)], out)
        fills.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            ids = allowed_tokens(out[i], V)
            m.consume(int(rng.choice(ids[ids != tokenizer.eos_token_ids[0]] if len(ids) > 1 else ids)))
    return {"sampler_no_mask_input_ms": median_ms(lambda: without(logits, sampling, history)),
            "sampler_free_mask_ms": median_ms(lambda: with_mask(logits, sampling, history, free)),
            "sampler_16_constrained_ms": median_ms(lambda: with_mask(logits, sampling, history, constrained)),
            "mask_fill_16_rows_ms": 1000 * statistics.median(fills),
            "mask_fill_16_rows_p90_ms": 1000 * float(np.percentile(fills, 90))}


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"config": vars(args), "schema": SCHEMA}
    if "sampler" in parts:
        result["sampler"] = sampler_part(args.reps)
        print(f"{'batch 16, vocab 49152 (median ms)':<40} {'':>8}")
        for key, value in result["sampler"].items():
            print(f"{key:<40} {value:>8.3f}")
    if "server" in parts:
        result.update(server_part(args))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def server_part(args: argparse.Namespace) -> dict:
    jserve = str(Path(sys.executable).with_name("jserve"))
    port = _port()
    url = f"http://127.0.0.1:{port}"
    serve = [jserve, "serve", "--port", str(port), *(["--model", args.model] if args.model else []),
             *args.serve_args.split()]
    server = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = []
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if _get(url + "/health"):
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(1)
        with tempfile.TemporaryDirectory() as tmp:
            workload = Path(tmp) / "requests.jsonl"
            _workload(workload, args.num_requests, args.max_tokens)
            loads = {"free": {"temperature": 0, "ignore_eos": True},
                     "json_schema": {"temperature": 0, "response_format": {
                         "type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}}}
            _bench(jserve, url, workload, _with_requests(args, 2 * args.concurrency), loads["json_schema"],
                   Path(tmp) / "warm")  # compiles the grammar, warms the tokenizer and the caches
            for r in range(args.rounds):
                for name, extra in loads.items():
                    before = _get(url + "/metrics")
                    m = _bench(jserve, url, workload, args, extra, Path(tmp) / f"{name}{r}")
                    after = _get(url + "/metrics")
                    steps = _metric(after, "jserve_structured_mask_steps") - _metric(before,
                                                                                    "jserve_structured_mask_steps")
                    seconds = _metric(after, "jserve_structured_mask_seconds") - _metric(
                        before, "jserve_structured_mask_seconds")
                    rows.append({"round": r, "load": name, "output_tok_s": m["output_throughput"],
                                 "output_tokens": m["total_output_tokens"], "tpot_ms_p50": m["tpot_ms"]["median"],
                                 "mask_ms_per_step": 1000 * seconds / steps if steps else 0.0,
                                 "mask_steps": steps,
                                 "compilations_after_warmup": _metric(after, "jserve_compilations_after_warmup")})
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    median = {name: statistics.median(r["output_tok_s"] for r in rows if r["load"] == name)
              for name in ("free", "json_schema")}
    ratio = median["json_schema"] / median["free"]
    print(f"{'round':>5} {'load':<12} {'out tok/s':>10} {'tokens':>7} {'TPOT p50 ms':>12} {'mask ms/step':>13}")
    for r in rows:
        print(f"{r['round']:>5} {r['load']:<12} {r['output_tok_s']:>10.1f} {r['output_tokens']:>7} "
              f"{r['tpot_ms_p50']:>12.1f} {r['mask_ms_per_step']:>13.3f}")
    print(f"median output tok/s: free {median['free']:.1f}, json_schema {median['json_schema']:.1f}; "
          f"ratio {ratio:.3f} (target >= 0.9); compilations after warm-up {rows[-1]['compilations_after_warmup']:.0f}")
    return {"rows": rows, "median": median, "ratio": ratio}


def _with_requests(args: argparse.Namespace, num_requests: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "num_requests": num_requests})


if __name__ == "__main__":
    sys.exit(main())
