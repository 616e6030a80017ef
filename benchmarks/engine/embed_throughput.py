"""Embeddings throughput beside prefill throughput, the same model and prompts: a batch of
--batch prompts of --tokens random token ids embedded (`LLM.embed`, task embed: the pooled step,
no head) against the same batch prefilled by a generation engine (`LLM.generate`, max_tokens=1:
the prefill and one sample). Prompt tokens per second, median of --reps runs after a warm one.

    python -m benchmarks.engine.embed_throughput [--model M] [--batch 16] [--tokens 256]
"""

from __future__ import annotations

import gc

import numpy as np

from benchmarks.harness import median_ms, parser, report
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
    rows = []
    for task in ("embed", "generate"):
        llm = LLM(args.model, task=task, **settings)
        rng = np.random.default_rng(0)  # the same prompts for both tasks
        prompts = [rng.integers(100, llm.config.vocab_size, args.tokens).tolist() for _ in range(args.batch)]
        if task == "embed":
            ms = median_ms(lambda: llm.embed(prompts), args.reps)
        else:
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            ms = median_ms(lambda: llm.generate(prompts, params), args.reps)
        compiled = llm.stats()["compilations_after_warmup"]
        rows.append({"task": task, "batch": args.batch, "tokens": args.tokens, "ms": round(ms, 1),
                     "tokens_per_s": round(args.batch * args.tokens / ms * 1e3), "compiled_after_warmup": compiled})
        llm.close()  # its weights and pages freed before the next task's load
        gc.collect()
    report(rows, args.out, title=f"embeddings vs prefill, {args.model or 'default model'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
