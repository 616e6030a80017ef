"""Each supported architecture against Hugging Face transformers on a tiny random model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import DATA
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
from jserve.model.checkpoint import read_params

ARCHS = ["llama2", "llama3", "llama_bias", "mistral", "qwen2", "qwen3", "smollm2", "gemma2", "gemma3"]


def _forward(config, params, ids: np.ndarray, layout: str = "list") -> np.ndarray:
    """The model's logits over a contiguous cache: its layers unrolled ("list") or scanned over
    stacked weights ("stacked")."""
    B, T = ids.shape
    stacked = layout == "stacked"
    model = nnx.merge(model_graphdef(config, layout),
                      model_params(config, {k: jnp.asarray(v) for k, v in params.items()}, layout))
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    cache = init_cache(config.num_layers, B, config.num_kv_heads, T, config.head_dim, stacked=stacked)
    ops = XlaOps(DenseAttention(config.sliding_window, stacked=stacked), scan=stacked)
    logits, _ = model(jnp.asarray(ids), jnp.asarray(positions), cache, jnp.asarray(positions), ops)
    return np.asarray(logits)


@pytest.mark.parametrize("layout", ["list", "stacked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, layout):
    folder = DATA / "arch" / arch
    ref = np.load(folder / "reference.npz")
    config, params = read_params(folder)
    logits = _forward(config, params, ref["input_ids"], layout)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen3", "gemma2", "gemma3"])
def test_cached_greedy_decode_matches_transformers(arch):
    """Prefill + step-by-step decode over the KV cache reproduces HF's greedy tokens."""
    folder = DATA / "arch" / arch
    ref = np.load(folder / "reference.npz")
    config, params = read_params(folder)
    model = nnx.merge(model_graphdef(config), model_params(config, {k: jnp.asarray(v) for k, v in params.items()}))
    ops = XlaOps(DenseAttention(config.sliding_window))
    step = jax.jit(lambda tokens, positions, cache: model(tokens, positions, cache, positions, ops,
                                                          logits_index=jnp.full((1, 1), tokens.shape[1] - 1)))
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    cache = init_cache(config.num_layers, 1, config.num_kv_heads, 18, config.head_dim)
    logits, cache = step(jnp.asarray([prompt]), jnp.arange(10)[None], cache)
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(7):
        pos = len(prompt) + len(tokens) - 1
        logits, cache = step(jnp.asarray([[tokens[-1]]]), jnp.asarray([[pos]]), cache)
        tokens.append(int(jnp.argmax(logits[0, -1])))
    assert tokens == ref["greedy_ids"][0].tolist()


def test_config_parses_rope_and_features():
    import json

    from jserve.model.config import ModelConfig

    cfgs = {a: ModelConfig.from_hf_config(json.loads((DATA / "arch" / a / "config.json").read_text()))
            for a in ARCHS}
    assert cfgs["llama3"].rope_scaling is not None and cfgs["llama3"].rope_scaling.rope_type == "llama3"
    assert cfgs["llama3"].rope_theta == 500000.0
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["llama_bias"].o_bias and cfgs["llama_bias"].mlp_bias
    assert cfgs["mistral"].sliding_window == 8
    assert cfgs["smollm2"].tie_word_embeddings
    assert cfgs["gemma2"].attn_logit_softcap == 2.0 and cfgs["gemma3"].rope_local_theta == 1e4  # tests/test_gemma.py


def test_unsupported_architecture_is_named():
    from jserve.model.config import ModelConfig

    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8})
