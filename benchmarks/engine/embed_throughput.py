"""Embeddings throughput beside prefill throughput, the same model and prompts: a batch of
--batch prompts of --tokens random token ids embedded (`LLM.embed`, task embed: the pooled step,
no head) against the same batch prefilled by a generation engine (`LLM.generate`, max_tokens=1:
the prefill and one sample). Both engines are loaded at once and their runs alternate (after a
warm one each), so the machine's noise falls on both; prompt tokens per second of the medians of
--reps runs, and their ratio.

    python -m benchmarks.engine.embed_throughput [--model M] [--batch 16] [--tokens 256]
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.harness import parser, report
from jserve import LLM
from jserve.core.request import SamplingParams


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default=None, help="the model (default: jserve's default model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args(argv)
    settings = dict(max_model_len=max(args.tokens + 16, args.max_num_batched_tokens), max_num_seqs=args.batch,
                    max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    llms = {task: LLM(args.model, task=task, **settings) for task in ("embed", "generate")}
    prompts = np.random.default_rng(0).integers(100, llms["embed"].config.vocab_size, (args.batch, args.tokens))
    prompts = prompts.tolist()
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    runs = {"embed": lambda: llms["embed"].embed(prompts),
            "generate": lambda: llms["generate"].generate(prompts, greedy)}
    seconds: dict[str, list[float]] = {task: [] for task in runs}
    for rep in range(args.reps + 1):  # the first (warm) run of each is not counted
        for task, run in runs.items():
            start = time.perf_counter()
            run()
            if rep:
                seconds[task].append(time.perf_counter() - start)
    rows = []
    for task, llm in llms.items():
        s = statistics.median(seconds[task])
        rows.append({"task": task, "batch": args.batch, "tokens": args.tokens, "ms": round(s * 1e3, 1),
                     "tokens_per_s": round(args.batch * args.tokens / s),
                     "compiled_after_warmup": llm.stats()["compilations_after_warmup"]})
        llm.close()
    rows[0]["embed_over_prefill_time"] = round(rows[0]["ms"] / rows[1]["ms"], 2)
    report(rows, args.out, title=f"embeddings vs prefill, {args.model or 'default model'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
