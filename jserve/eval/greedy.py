"""Greedy agreement: both models generate greedily from the same prompts on the engine.

The default model's prompts are the golden ones (tests/data/smollm2_golden.json in a source
checkout: 6 text and 2 chat prompts, their token ids, 32 new tokens with EOS ignored, as
tests/test_golden.py runs them); other models (or an installed jserve without the tests) get
`BUILTIN_PROMPTS`, encoded with the model's tokenizer, 32 new tokens, EOS ignored.

Per prompt: whether the two token sequences are identical, and their common prefix as a
fraction of the tokens generated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jserve.eval.models import EvalModel

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2_golden.json"
GOLDEN_MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
BUILTIN_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "In 1969, astronauts",
    "A list of prime numbers: 2, 3, 5,",
)


def is_golden_model(model: EvalModel) -> bool:
    """Whether `model` is the default model (its golden prompts apply)."""
    names = [Path(p).name for p in (model.source, model.path) if p]
    return any(n.startswith(GOLDEN_MODEL) or n == "smollm2-135m-instruct" for n in names)


def prompts_for(model: EvalModel) -> tuple[str, list[list[int]], int]:
    """(where the prompts come from, their token ids, max new tokens)."""
    if is_golden_model(model) and GOLDEN.is_file():
        golden = json.loads(GOLDEN.read_text())
        cases = golden["cases"]
        return "tests/data/smollm2_golden.json", [c["prompt_ids"] for c in cases], len(cases[0]["greedy_ids"])
    if model.tokenizer is None:
        raise ValueError("greedy agreement needs the model's tokenizer (for the built-in prompts)")
    return "built-in prompts", [model.tokenizer.encode(p) for p in BUILTIN_PROMPTS], MAX_TOKENS


def generate_greedy(model: EvalModel, prompts: Sequence[Sequence[int]], max_tokens: int,
                    backend: Any = None) -> list[list[int]]:
    """Greedy token ids (EOS ignored, `max_tokens` each) from the engine, all prompts in one batch."""
    from jserve.core.request import SamplingParams
    from jserve.engine import EngineConfig, build_engine

    c = model.config
    longest = max(len(p) for p in prompts) + max_tokens
    # KV for every sequence at once (with a page of slack each), in the weights' float dtype
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * np.dtype(model.params["final_norm"].dtype).itemsize
    tokens = sum(len(p) + max_tokens + 64 for p in prompts) + 64
    config = EngineConfig(max_model_len=min(c.max_position_embeddings, max(256, longest)),
                          max_num_seqs=len(prompts), max_num_batched_tokens=256, backend=backend,
                          kv_cache_bytes=max(8 << 20, 2 * per_token * tokens), warmup=False)
    engine = build_engine(model.config, model.params, model.tokenizer, list(model.eos_token_ids), config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), list(p), params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Exact-match fraction and mean common-prefix fraction of two lists of token sequences."""
    if len(a) != len(b) or not a:
        raise ValueError("agreement needs two equally long, non-empty lists of sequences")
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n / max(len(x), len(y), 1))
    exact = [list(x) == list(y) for x, y in zip(a, b)]
    return {"prompts": len(a), "exact_match": sum(exact) / len(a),
            "mean_prefix_fraction": sum(prefixes) / len(a), "prefix_fractions": prefixes}
