"""Batch-invariant mode against the default, side by side in one process: the default model
served as it is (`LLM()`) and with `batch_invariant=True`, both loaded at once and their runs
alternated; 16 concurrent requests (random 64-token prompts, 64 greedy tokens, eos ignored) and
one request alone on each. Output tokens/s, medians over the rounds, and the invariant engine's
ratio to the default's (#41's target: within 15 % at 16 requests).

    python -m benchmarks.engine.batch_invariant [--rounds 3] [--out batch_invariant.json]
"""

from __future__ import annotations

import numpy as np

from benchmarks.harness import alternated_rates, parser, report
from jserve import LLM, SamplingParams


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default=None, help="the model (default: jserve's default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="prompt and output tokens per request")
    args = p.parse_args(argv)
    engines = {"default": LLM(args.model), "batch-invariant": LLM(args.model, batch_invariant=True)}
    rng = np.random.default_rng(0)
    vocab = engines["default"].config.vocab_size
    prompts = [rng.integers(100, vocab - 100, args.tokens).tolist() for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for llm in engines.values():  # every shape run once
        llm.generate(prompts, params)
    variants = {name: (lambda n, llm=llm: llm.generate(prompts[:n], params)) for name, llm in engines.items()}
    rows = alternated_rates(variants, (args.concurrency, 1), args.rounds, args.tokens, "default", "vs_default")
    compiled = {name: llm.stats()["compilations_after_warmup"] for name, llm in engines.items()}
    report(rows, args.out, title=f"batch-invariant vs default ({args.rounds} rounds alternated; compilations "
                                 f"after warm-up: {compiled})", model=str(engines["default"].path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
