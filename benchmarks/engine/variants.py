"""Engines side by side in one process: the same workload on engines that differ in their settings.

Each `--variants` entry is `key=value[,key=value]` of `LLM(...)` settings (values read as JSON
where they parse: true, 8, "x"); the engines run in turns `--repeats` times, the order reversed
every round (a shared machine's noise falls on all), greedy, eos ignored, and must give the same
tokens (exit 1 otherwise). Per variant: output tokens/s, compiled calls, multi-step calls, the
median decode model step, the host time between device calls (the runner's `records`,
`StepRecord.idle_before`) and its share, and the steps dispatched while the one before still ran.
Workloads: `random` (`--num-requests` prompts of `--input-len` random ids, `--output-len` each) or
`mix` (benchmarks.engine.offline's four prompt/output shapes).

    python -m benchmarks.engine.variants --variants async_scheduling=false async_scheduling=true --out async.json
    python -m benchmarks.engine.variants --variants num_scheduler_steps=1 num_scheduler_steps=8 --workload mix
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from benchmarks.harness import parser, records_since, report


def settings(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def run_once(llm, prompts, max_tokens) -> tuple[dict, list]:
    from jserve import SamplingParams

    records = llm.runner.records
    last = records[-1] if records else None
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - t0
    mine = records_since(records, last)
    decode = [r.seconds / r.steps for r in mine if r.kind == "decode"]
    busy, idle = sum(r.seconds for r in mine), sum(r.idle_before for r in mine)
    return {"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds, "calls": len(mine),
            "multi_step_calls": sum(r.steps > 1 for r in mine),
            "decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
            "idle_ms_per_call": 1e3 * idle / max(len(mine), 1),
            "idle_fraction": idle / (busy + idle) if busy + idle else 0.0}, [o.outputs[0].token_ids for o in outs]


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--variants", nargs="+", required=True, metavar="KEY=VALUE[,...]")
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", default="random", choices=["random", "mix"])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from jserve import LLM

    rng = np.random.default_rng(args.seed)
    if args.workload == "random":
        prompts = [rng.integers(3, 1000, args.input_len).tolist() for _ in range(args.num_requests)]
        max_tokens = [args.output_len] * args.num_requests
        max_model_len = args.input_len + args.output_len + 16
    else:
        from benchmarks.engine.offline import build_workload

        prompts, max_tokens, _ = build_workload(args.num_requests, (32, 512), (32, 256), 1000, args.seed)
        max_model_len = 1024
    base = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, load_format=args.load_format,
                max_model_len=max_model_len)
    llms = {v: LLM(args.model, **{**base, **settings(v)}) for v in args.variants}
    runs: dict[str, list[dict]] = {v: [] for v in llms}
    tokens = {}
    for r in range(args.repeats):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            result, tokens[v] = run_once(llms[v], prompts, max_tokens)
            runs[v].append(result)
            print(f"round {r} {v}: {result['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    same = all(tokens[v] == tokens[args.variants[0]] for v in args.variants)
    rows = []
    for v, results in runs.items():
        row = {"variant": v, **{k: statistics.median(x[k] for x in results) if results[0][k] is not None else None
                                for k in results[0]}}
        stats = llms[v].stats()
        row["overlapped_fraction"] = stats.get("overlapped_steps", 0) / max(stats.get("launched_steps", 0), 1)
        row["vs_first"] = row["output_tok_s"] / rows[0]["output_tok_s"] if rows else 1.0
        rows.append(row)
    report(rows, args.out, title=f"medians of {args.repeats}; same tokens: {same}", args=vars(args),
           same_tokens=same, runs=runs)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
