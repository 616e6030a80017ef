"""The real default model (SmolLM2-135M-Instruct) against Hugging Face transformers' outputs.

Reference: tests/data/smollm2_golden.json (HF transformers fp32 on the dequantized GGUF). Token
ids must match exactly while the reference's top-1/top-2 margin is comfortable (> 0.05); from the
first step below that, a float-rounding tie could flip the choice, so the logits are compared
(teacher-forced on the reference tokens, within 1e-3 relative) instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import conftest
from jserve import SamplingParams
from jserve.model import DenseAttention, init_cache

MARGIN = 0.05


def _confident_prefix(case) -> int:
    for j, step in enumerate(case["steps"]):
        if step["margin"] <= MARGIN:
            return j + 1  # the low-margin step itself was still predicted from exact inputs
    return len(case["steps"])


def test_prompt_token_ids_match_reference_tokenizer(smollm2_llm, golden):
    tok = smollm2_llm.tokenizer
    for case in golden["cases"]:
        if case["kind"] == "chat":
            assert tok.apply_chat_template(case["messages"]) == case["rendered"]
            assert tok.encode(case["rendered"], add_special_tokens=False) == case["prompt_ids"]
        else:
            assert tok.encode(case["prompt"]) == case["prompt_ids"]


def test_greedy_generation_matches_reference(smollm2_llm, golden):
    """All cases in one batch, through the public API, with EOS ignored as in the reference."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]]
    outs = smollm2_llm.generate(prompts, params)
    for case, out in zip(golden["cases"], outs):
        n = _confident_prefix(case)
        got = out.outputs[0].token_ids
        assert got[:n] == case["greedy_ids"][:n], case.get("prompt") or case["messages"]
        assert out.outputs[0].finish_reason == "length"
        if n == 32:
            assert out.outputs[0].text == case["greedy_text"]
    # The runner's steps, not stats()' total: the fixture is shared, and another module's
    # prompt_logprobs request compiles the scoring step on first use (counted in stats() by design).
    _no_compilations(smollm2_llm)


def test_chat_api_matches_reference(smollm2_llm, golden):
    case = next(c for c in golden["cases"] if c["kind"] == "chat")
    out = smollm2_llm.chat(case["messages"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_token_ids == case["prompt_ids"]
    assert out.outputs[0].token_ids == case["greedy_ids"][:8]
    _no_compilations(smollm2_llm)


def test_teacher_forced_logits_match_reference(smollm2_llm, golden):
    """Top-5 logits at every prompt position and every reference step, within 1e-3 relative."""
    llm = smollm2_llm
    config = llm.config
    runner = llm.runner
    model = nnx.merge(runner.graphdef, runner.params)
    T = 96
    for case in golden["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"]
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(ids)] = ids
        positions = np.full((1, T), T, np.int32)
        positions[0, :len(ids)] = np.arange(len(ids))
        stacked = runner.backend.param_layout == "stacked"
        cache = init_cache(config.num_layers, 1, config.num_kv_heads, T, config.head_dim, stacked=stacked)
        # The runner's params may hold packed weights: its backend's operations read them.
        ops = runner.ops.with_attention(DenseAttention(config.sliding_window, stacked=stacked))
        logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), cache, jnp.asarray(positions), ops)
        logits = np.asarray(logits[0])
        P = len(case["prompt_ids"])
        refs = [(j, s) for j, s in enumerate(case["prompt_positions"])]
        refs += [(P - 1 + j, s) for j, s in enumerate(case["steps"])]
        for pos, ref in refs:
            got = logits[pos][ref["top5_ids"]]
            np.testing.assert_allclose(got, ref["top5_logits"], rtol=1e-3, atol=1e-4)


def _no_compilations(llm) -> None:
    """Nothing compiled after warm-up, unless the suite dropped JAX's caches under this shared
    session engine (conftest's mapping guard: that recompiles every warmed-up step)."""
    if conftest._GC["cleared"] == 0:
        assert llm.runner.num_compilations_after_warmup == 0, llm.runner.compiles.seen
