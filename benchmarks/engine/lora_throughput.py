"""Multi-LoRA against the base model, side by side in one process: the default model served plain
(`LLM()`) and with LoRA slots (`enable_lora`, 4 slots of rank 16) in the model's dtype and in
bfloat16 (`lora_dtype`), all loaded at once and their runs alternated; 16 concurrent requests
(random 64-token prompts, 64 greedy tokens, eos ignored) on the base model, on the LoRA engine's
base model (slot 0: what enabling LoRA costs a step), and spread over 4 random rank-16 adapters on
every linear; and one request alone on each. Output tokens/s, medians over the rounds, and each
one's ratio to the plain base model's.

    python -m benchmarks.engine.lora_throughput [--rounds 3] [--out lora.json]
"""

from __future__ import annotations

import tempfile

import numpy as np

from benchmarks.harness import alternated_rates, parser, report
from jserve import LLM, LoRARequest, SamplingParams
from jserve.model.lora_adapters import write_random_adapter


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default=None, help="the model (default: jserve's default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="prompt and output tokens per request")
    args = p.parse_args(argv)
    base = LLM(args.model)
    lora = LLM(args.model, enable_lora=True, max_loras=4, max_lora_rank=16)
    lora_bf16 = LLM(args.model, enable_lora=True, max_loras=4, max_lora_rank=16, lora_dtype="bfloat16")
    folder = tempfile.mkdtemp(prefix="jserve-lora-bench-")
    adapters = [LoRARequest(f"a{i}", i + 1, write_random_adapter(f"{folder}/a{i}", lora.config, 16, seed=i))
                for i in range(4)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, lora.config.vocab_size - 100, args.tokens).tolist() for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {
        "base model": lambda n: base.generate(prompts[:n], params),
        "LoRA engine, base model": lambda n: lora.generate(prompts[:n], params),
        "LoRA engine, 4 adapters mixed": lambda n: lora.generate(prompts[:n], params,
                                                                 lora_request=[adapters[i % 4] for i in range(n)]),
        "LoRA engine, bfloat16 slots, 4 adapters mixed": lambda n: lora_bf16.generate(
            prompts[:n], params, lora_request=[adapters[i % 4] for i in range(n)]),
    }
    for fn in variants.values():  # adapters read and put into slots, every shape run once
        fn(args.concurrency)
    rows = alternated_rates(variants, (args.concurrency, 1), args.rounds, args.tokens, "base model", "vs_base")
    compiled = lora.stats()["compilations_after_warmup"] + lora_bf16.stats()["compilations_after_warmup"]
    report(rows, args.out, title=f"multi-LoRA vs base ({args.rounds} rounds alternated; {compiled} compilations "
                                 f"after warm-up)", model=str(lora.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
