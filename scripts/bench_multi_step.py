"""Multi-step decode: output tokens/s per `num_scheduler_steps`, engines side by side in one process.

Two workloads on the real model (default SmolLM2-135M-Instruct), greedy, EOS ignored:
- `decode`: `--batch` requests with `--prompt-len` token prompts, timed after their prefill, so
  that every step is a decode of the whole batch (the case multi-step decode is for);
- `mix`: bench_offline.py's workload (`--num-requests` of the four prompt/output shapes), all in
  one `LLM.generate` call, where prefills and admissions break the multi-step calls.
Each value of `--steps` is its own engine; they take turns run by run (order reversed every
round), so a busy machine slows them alike. Prints the median (and all runs) per engine, checks
that every engine returns the same token ids, and writes JSON with --out.

    python scripts/bench_multi_step.py [--steps 1 4 8] [--rounds 3] [--workload decode mix]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_offline import build_workload  # noqa: E402

from jserve import LLM, SamplingParams  # noqa: E402


def decode_run(llm, prompts, out_len: int, tag: str) -> tuple[float, list]:
    """Output tokens/s of the decode phase alone (prefill first, untimed)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    done = {}
    while any(not s.request.output_token_ids for s in engine._sequences.values()):
        # Requests that wait for pages can still be prefilling when the first ones finish.
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - t0
    return len(prompts) * (out_len - 1) / seconds, [done[f"{tag}-{i}"] for i in range(len(prompts))]


def mix_run(llm, prompts, max_tokens) -> tuple[float, list]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(max_tokens) / (time.perf_counter() - t0), [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--workload", nargs="+", default=["decode", "mix"], choices=["decode", "mix"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--out-len", type=int, default=100)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    llms = {k: LLM(args.model, max_num_seqs=args.batch, max_num_batched_tokens=512, max_model_len=2048,
                   num_scheduler_steps=k) for k in args.steps}
    vocab = llms[args.steps[0]].config.vocab_size
    rng = np.random.default_rng(0)
    decode_prompts = [rng.integers(16, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    mix_prompts, mix_tokens, _ = build_workload(args.num_requests, (32, 512), (32, 256), vocab, 0)
    runs = {w: {k: [] for k in args.steps} for w in args.workload}
    ids: dict = {w: {} for w in args.workload}
    for r in range(args.rounds):
        for w in args.workload:
            for k in (args.steps if r % 2 == 0 else args.steps[::-1]):
                load = os.getloadavg()[0]
                if w == "decode":
                    rate, got = decode_run(llms[k], decode_prompts, args.out_len, f"r{r}")
                else:
                    rate, got = mix_run(llms[k], mix_prompts, mix_tokens)
                runs[w][k].append({"tokens_per_s": rate, "loadavg_1m_before": load})
                ids[w][k] = got
                print(f"round {r} {w:6} steps={k}: {rate:.1f} tok/s (load {load:.2f})", file=sys.stderr, flush=True)

    result = {"args": vars(args), "workloads": {}}
    print(f"\n{'workload':10}{'steps':>6}{'median tok/s':>14}{'vs steps=' + str(args.steps[0]):>12}  runs")
    for w in args.workload:
        base = statistics.median(x["tokens_per_s"] for x in runs[w][args.steps[0]])
        same = all(ids[w][k] == ids[w][args.steps[0]] for k in args.steps)
        result["workloads"][w] = {"same_token_ids": same, "engines": {}}
        for k in args.steps:
            rates = [x["tokens_per_s"] for x in runs[w][k]]
            med = statistics.median(rates)
            stats = llms[k].stats()
            result["workloads"][w]["engines"][k] = {"median_tokens_per_s": med, "runs": runs[w][k],
                                                    "compilations_after_warmup": stats["compilations_after_warmup"]}
            print(f"{w:10}{k:>6}{med:>14.1f}{med / base:>12.3f}  {[round(x, 1) for x in rates]}")
        print(f"{'':10}same token ids for every steps value: {same}")
    compiles = [llms[k].stats()["compilations_after_warmup"] for k in args.steps]
    print(f"compilations after warm-up: {compiles}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
