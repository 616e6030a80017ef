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

    python -m benchmarks.serving.structured --out structured.json
    python -m benchmarks.serving.structured --concurrency 16 --num-requests 32 --rounds 3
    python -m benchmarks.serving.structured --parts sampler
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ServerProcess, bench, median_ms, parser, table, write_json

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string", "maxLength": 24},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue", "new"]}},
                   "score": {"type": "number", "minimum": 0, "maximum": 1},
                   "ok": {"type": "boolean"}}}}


def parse_args(argv=None):
    p = parser(__doc__, out="bench_structured.json")
    p.add_argument("--model", default=None, help="what `jserve serve --model` takes (default: the default model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32, help="requests per round and load")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-args", default="", help="more `jserve serve` flags, e.g. '--max-num-seqs 16'")
    p.add_argument("--parts", default="sampler,server", help="sampler, server or both (comma-separated)")
    p.add_argument("--reps", type=int, default=50, help="calls per variant in the sampler part")
    return p.parse_args(argv)


def _workload(path: Path, n: int, max_tokens: int) -> None:
    """n chat requests asking for records, each with its own prompt (no prefix-cache effects)."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Request {i}: list records of items as a JSON array of objects with "
                                          f"id, name, tags, score and ok.", "max_tokens": max_tokens}) + "\n")


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

    def ms(fn) -> float:
        return median_ms(fn, reps, sync=jax.block_until_ready)

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
    return {"sampler_no_mask_input_ms": ms(lambda: without(logits, sampling, history)),
            "sampler_free_mask_ms": ms(lambda: with_mask(logits, sampling, history, free)),
            "sampler_16_constrained_ms": ms(lambda: with_mask(logits, sampling, history, constrained)),
            "mask_fill_16_rows_ms": 1000 * statistics.median(fills),
            "mask_fill_16_rows_p90_ms": 1000 * float(np.percentile(fills, 90))}


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"config": vars(args), "schema": SCHEMA}
    if "sampler" in parts:
        result["sampler"] = sampler_part(args.reps)
        print(table([{"batch 16, vocab 49152": k, "median ms": v} for k, v in result["sampler"].items()], digits=3))
    if "server" in parts:
        result.update(server_part(args))
    write_json(args.out, result)
    return 0


def server_part(args) -> dict:
    rows = []
    flags = [*(["--model", args.model] if args.model else []), *args.serve_args.split()]
    with ServerProcess(flags) as server, tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "requests.jsonl"
        _workload(workload, args.num_requests, args.max_tokens)
        loads = {"free": {"temperature": 0, "ignore_eos": True},
                 "json_schema": {"temperature": 0, "response_format": {
                     "type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}}}

        def run(extra: dict, num_requests: int) -> dict:
            return bench(server.url, "--endpoint", "chat", "--workload", str(workload), "--num-requests",
                         str(num_requests), "--concurrency", str(args.concurrency), "--extra-body", json.dumps(extra))

        run(loads["json_schema"], 2 * args.concurrency)  # compiles the grammar, warms the tokenizer and the caches
        for r in range(args.rounds):
            for name, extra in loads.items():
                before = server.metrics()
                m = run(extra, args.num_requests)
                after = server.metrics()
                delta = {k: after.get(k, math.nan) - before.get(k, math.nan)
                         for k in ("jserve_structured_mask_steps", "jserve_structured_mask_seconds")}
                steps, seconds = delta.values()
                rows.append({"round": r, "load": name, "output_tok_s": m["output_throughput"],
                             "output_tokens": m["total_output_tokens"], "tpot_ms_p50": m["tpot_ms"]["median"],
                             "mask_ms_per_step": 1000 * seconds / steps if steps else 0.0, "mask_steps": steps,
                             "compilations_after_warmup": after.get("jserve_compilations_after_warmup")})
    median = {name: statistics.median(r["output_tok_s"] for r in rows if r["load"] == name)
              for name in ("free", "json_schema")}
    ratio = median["json_schema"] / median["free"]
    print(table(rows, digits=3))
    print(f"median output tok/s: free {median['free']:.1f}, json_schema {median['json_schema']:.1f}; "
          f"ratio {ratio:.3f} (target >= 0.9); compilations after warm-up {rows[-1]['compilations_after_warmup']}")
    return {"rows": rows, "median": median, "ratio": ratio}


if __name__ == "__main__":
    sys.exit(main())
