#!/usr/bin/env python3
"""Step time per mesh (dp x tp), with a correctness check on each.

For every mesh it loads the model into that mesh (weights restored straight into their
shardings), checks the golden SmolLM2 cases' first greedy tokens (default model only), then
times the compiled decode step at a fixed batch and context and one prefill chunk (median of
several calls, each after a warm-up call). On CPU it runs on fake devices
(`--xla_force_host_platform_device_count`), which share this machine's cores: the numbers show
the *shape* of the scaling and the collectives' overhead, not a speed-up. On a TPU or GPU host the
same command measures the real thing.

    python -m benchmarks.step.sharding --out sharding.json
    python -m benchmarks.step.sharding --meshes none,tp=2,dp=2 --batch 16 --context 512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DEFAULT_MESHES = "none,tp=2,tp=3,tp=4,tp=8,dp=2,dp=2_tp=2,dp=8"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--meshes", default=DEFAULT_MESHES,
                   help="comma-separated meshes; 'none' is one device, '_' joins axes (dp=2_tp=2)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU only)")
    p.add_argument("--batch", type=int, default=8, help="decode rows (all dp groups together)")
    p.add_argument("--context", type=int, default=256, help="tokens already cached per decode row")
    p.add_argument("--prefill", type=int, default=128, help="prefill chunk tokens per dp group")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per step kind (median)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # only affects the CPU platform
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    import jax

    from jserve.runtime.sharding import parse_mesh

    golden = json.loads((REPO / "tests" / "data" / "smollm2_golden.json").read_text())["cases"]
    results = []
    for name in args.meshes.split(","):
        mesh = None if name == "none" else name.replace("_", ",")
        sizes = parse_mesh(mesh) if mesh else {"dp": 1, "tp": 1}
        if sizes["dp"] * sizes["tp"] > jax.device_count():
            print(f"skip {name}: needs {sizes['dp'] * sizes['tp']} devices", file=sys.stderr)
            continue
        results.append(bench_mesh(args, name, mesh, sizes, golden))
        print(_row(results[-1]), flush=True)
    print()
    print(_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"platform": jax.devices()[0].platform, "args": vars(args),
                                              "results": results}, indent=2))
    return 0 if all(r["golden_ok"] is not False for r in results) else 1


def bench_mesh(args, name: str, mesh: str | None, sizes: dict, golden: list) -> dict:
    """Load the model into one mesh, check the golden cases (default model only) and time its
    decode and prefill steps: the mesh's result row."""
    import jax

    from jserve.core.request import SamplingParams
    from jserve.llm import LLM

    dp = sizes["dp"]
    t0 = time.perf_counter()
    batch = math.ceil(args.batch / dp) * dp
    llm = LLM(args.model, mesh=mesh, warmup=False, max_model_len=args.max_model_len, max_num_seqs=batch,
              max_num_batched_tokens=max(args.prefill * dp, 512 * dp), kv_cache_bytes=256 << 20)
    load_s = time.perf_counter() - t0
    runner = llm.runner
    golden_ok = None
    if args.model is None:
        outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in golden],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        golden_ok = all(o.outputs[0].token_ids == c["greedy_ids"][:8] for o, c in zip(outs, golden))
    timings = {kind: time_step(runner, rows, args.repeats)
               for kind, rows in step_rows(args, runner.page_size, runner.pages_per_group, batch, dp).items()}
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(runner.params))
    return dict(mesh=name, dp=dp, tp=sizes["tp"], devices=dp * sizes["tp"], batch=batch,
                context=args.context, decode_ms=timings["decode"] * 1e3,
                prefill_ms=timings["prefill"] * 1e3, prefill_tokens=args.prefill * dp,
                weight_mib_per_device=weights / 2**20, load_s=load_s, golden_ok=golden_ok,
                compilations=runner.num_compilations)


def step_rows(args, S: int, pages_per_group: int, batch: int, dp: int) -> dict:
    """{"decode": rows, "prefill": rows}: decode rows at `context` tokens on distinct pages of
    their group (the KV content does not change the step's cost), and one prefill chunk per group."""
    from jserve.runtime.steps import StepRow

    pages = math.ceil((args.context + 1) / S)
    rows = []
    for i in range(batch):
        g, j = i % dp, i // dp
        rows.append(StepRow(args.context, [1], list(range(1 + j * pages, 1 + (j + 1) * pages)), dp_group=g))
    if (batch // dp) * pages + 1 > pages_per_group:
        raise SystemExit(f"not enough pages for batch {batch} x context {args.context}")
    prefill_rows = [StepRow(0, [1] * args.prefill, list(range(1, 1 + math.ceil(args.prefill / S))), dp_group=g)
                    for g in range(dp)]
    return {"decode": rows, "prefill": prefill_rows}


def time_step(runner, rows, repeats: int) -> float:
    """The median seconds of `repeats` executions of `rows`, after one to compile and warm."""
    runner.execute(rows)
    secs = []
    for _ in range(repeats):
        runner.execute(rows)
        secs.append(runner.records[-1].seconds)
    return statistics.median(secs)


def _row(r) -> str:
    return (f"{r['mesh']:<10} {r['devices']:>3} {r['batch']:>5} {r['decode_ms']:>10.1f} {r['prefill_ms']:>11.1f} "
            f"{r['weight_mib_per_device']:>10.1f} {str(r['golden_ok']):>7}")


def _table(results) -> str:
    head = f"{'mesh':<10} {'dev':>3} {'batch':>5} {'decode ms':>10} {'prefill ms':>11} {'MiB/dev':>10} {'golden':>7}"
    return "\n".join([head, "-" * len(head)] + [_row(r) for r in results])


if __name__ == "__main__":
    sys.exit(main())
