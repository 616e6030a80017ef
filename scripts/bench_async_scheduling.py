#!/usr/bin/env python3
"""Async scheduling against single steps: the device's idle time between steps and throughput.

Two engines on the same model and workload in one process (`EngineConfig.async_scheduling` off
and on), each run `--repeats` times, interleaved (this machine is shared and noisy: medians of
side-by-side runs). Greedy, eos ignored, random token-id prompts from a fixed seed; the two must
give the same tokens (checked). Per engine it reports output tokens/s, the median decode step, the
host time between consecutive device steps (the runner's `idle_before`: with async scheduling 0
where a step was dispatched while the one before still ran, else at most the time since that one
was last seen running) and its share of the steps' time, and how many steps were dispatched while
the step before was still on the device.

    .venv/bin/python scripts/bench_async_scheduling.py --out async.json
    .venv/bin/python scripts/bench_async_scheduling.py --model DIR --load-format dummy --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def _run(llm, prompts, params):
    engine = llm.engine
    engine.runner.records.clear()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - t0
    records = list(engine.runner.records)
    decode = [r.seconds for r in records if r.kind == "decode"]
    busy = sum(r.seconds for r in records)
    idle = sum(r.idle_before for r in records)
    return {
        "seconds": seconds,
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
        "steps": len(records),
        "median_decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
        "idle_ms_per_step": 1e3 * idle / max(len(records), 1),
        "idle_fraction": idle / (busy + idle) if busy + idle else 0.0,
    }, [o.outputs[0].token_ids for o in outs]


def main(argv=None) -> int:
    args = parse_args(argv)
    from jserve import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, 1000, args.input_len).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    settings = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, load_format=args.load_format,
                    max_model_len=args.input_len + args.output_len + 16)
    llms = {mode: LLM(args.model, async_scheduling=mode == "async", **settings) for mode in ("sync", "async")}
    runs: dict[str, list[dict]] = {m: [] for m in llms}
    tokens = {}
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            result, tokens[mode] = _run(llm, prompts, params)
            runs[mode].append(result)
    same = tokens["sync"] == tokens["async"]
    table = {}
    for mode, results in runs.items():
        table[mode] = {key: statistics.median(r[key] for r in results) for key in results[0]
                       if results[0][key] is not None}
    stats = llms["async"].engine.stats()
    table["async"]["overlapped_fraction"] = stats["overlapped_steps"] / max(stats["launched_steps"], 1)
    print(f"{'mode':6} {'tok/s':>8} {'steps':>6} {'decode ms':>10} {'idle ms/step':>13} {'idle %':>7}")
    for mode, row in table.items():
        print(f"{mode:6} {row['output_tokens_per_s']:8.1f} {row['steps']:6.0f} "
              f"{row.get('median_decode_step_ms', float('nan')):10.2f} {row['idle_ms_per_step']:13.3f} "
              f"{100 * row['idle_fraction']:6.1f}%")
    print(f"async/sync throughput {table['async']['output_tokens_per_s'] / table['sync']['output_tokens_per_s']:.2f}x; "
          f"{100 * table['async']['overlapped_fraction']:.0f}% of async steps dispatched while the one before "
          f"ran; same tokens: {same}")
    result = {"args": vars(args), "same_tokens": same, "medians": table, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
