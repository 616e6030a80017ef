"""The tiny architecture cases of tests/data/arch/ and how each model is built: shared sizes and
seeds, every case's Hugging Face classes, config overrides, torch seed and description, and the
random norm weights and biases (tests/tools/make_arch_goldens.py writes the goldens from them).

Importing it sets Hugging Face's offline flags before transformers loads."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "data" / "arch"

BATCH, SEQ, VOCAB = 2, 24, 256
PROMPT_LEN, NEW_TOKENS = 10, 8
INPUT_SEED = 1234
NORM_RANGE = (0.5, 1.5)
# Gemma's RMSNorm scales by (1 + weight): U(-0.5, 0.5) gives the same (0.5, 1.5) scales.
GEMMA_NORM_RANGE = (-0.5, 0.5)
BIAS_STD = 0.2

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (model class, config class, config overrides, torch seed, description)
CASES = {
    "llama2": (
        LlamaForCausalLM, LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             tie_word_embeddings=False),
        101, "Llama, MHA 4/4 heads, rope_theta 1e4, untied",
    ),
    "llama3": (
        LlamaForCausalLM, LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2,
             rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False),
        102, "Llama, GQA 4/2, rope_theta 5e5 + llama3 rope scaling "
             "(factor 8, low 1, high 4, original_max 64), untied",
    ),
    "llama_bias": (
        LlamaForCausalLM, LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        103, "Llama, GQA 4/2, attention_bias (q,k,v,o) + mlp_bias, random biases",
    ),
    "mistral": (
        MistralForCausalLM, MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=8,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             tie_word_embeddings=False),
        104, "Mistral, GQA 4/1, sliding_window 8 (< 24-token input), untied",
    ),
    "qwen2": (
        Qwen2ForCausalLM, Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=2,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
             use_sliding_window=False, tie_word_embeddings=False),
        105, "Qwen2, GQA 4/2, random q/k/v biases, rope_theta 1e6, untied",
    ),
    "qwen3": (
        Qwen3ForCausalLM, Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
             use_sliding_window=False, tie_word_embeddings=True),
        106, "Qwen3, GQA 4/2, head_dim 32 (!= 64/4), random q_norm/k_norm, "
             "rope_theta 1e6, tied (as Qwen3-0.6B)",
    ),
    "smollm2": (
        LlamaForCausalLM, LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2,
             rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
             rms_norm_eps=1e-5, tie_word_embeddings=True),
        107, "Llama (SmolLM2-style), GQA 4/2, rope_theta 1e5, rms_norm_eps 1e-5, tied",
    ),
    "gemma2": (
        Gemma2ForCausalLM, Gemma2Config,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32, sliding_window=8,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             tie_word_embeddings=False),
        108, "Gemma 2, 3 layers (sliding, full, sliding: the default alternation), GQA 4/2, "
             "sliding_window 8, attn / final logit soft-capping 2 / 3, query_pre_attn_scalar 32 "
             "(!= head_dim 16), (1 + w) norms incl. post-attention / post-MLP, GeGLU, untied (tied, "
             "the sqrt(hidden)-scaled embedding dominates and greedy repeats one token)",
    ),
    "gemma3": (
        Gemma3ForCausalLM, Gemma3TextConfig,
        dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
             tie_word_embeddings=True),
        109, "Gemma 3 text, 4 layers (sliding, sliding, full, sliding), GQA 4/2, head_dim 32, "
             "sliding_window 8, local rope_theta 1e4 vs global 1e6 + linear scaling 8, random "
             "(1 + w) q/k norms, query_pre_attn_scalar 24, tied",
    ),
    # Mixture of experts: 8 experts, top-2, experts 32 wide (each expert's MLP is a quarter of the
    # dense cases'), every layer sparse. The generator checks that routing is not trivial.
    "qwen3_moe": (
        Qwen3MoeForCausalLM, Qwen3MoeConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
             use_sliding_window=False, tie_word_embeddings=False),
        110, "Qwen3-MoE, GQA 4/2, head_dim 32, q/k norms, 8 experts of 32, top-2 with norm_topk_prob "
             "(as Qwen3-30B-A3B), every layer sparse, untied",
    ),
    "mixtral": (
        MixtralForCausalLM, MixtralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             intermediate_size=32, sliding_window=None,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False),
        117, "Mixtral, GQA 4/2, 8 experts of 32 (intermediate_size), top-2 renormalised, untied",
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM, Qwen2MoeConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1,
             mlp_only_layers=[], norm_topk_prob=False, qkv_bias=True, use_sliding_window=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False),
        129, "Qwen2-MoE (Qwen1.5-MoE), GQA 4/2, random q/k/v biases, 8 experts of 32, top-2 without "
             "renormalisation, a shared expert of 64 behind its sigmoid gate, untied",
    ),
}
MOE_CASES = ("qwen3_moe", "mixtral", "qwen2_moe")
# Phi-3's LongRoPE case: transformers picks the short or the long factors per forward call, long iff
# max(position_ids) + 1 > original_max_position_embeddings (12 here), so a forward of the 24-token
# input runs the long factors at every position, one of its first 12 the short ones; greedy decoding
# from the 10-token prompt crosses over, and there generate() drops its cache and recomputes the 13
# tokens with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation; checked below), so
# its tokens are a cache-free loop's. Its reference.npz adds `logits_short` (the first
# LONGROPE_ORIG tokens) and `greedy_long_ids` (8 new tokens after a LONG_PROMPT_LEN-token prompt,
# every position long).
LONGROPE_ORIG, LONG_PROMPT_LEN = 12, 16
_SHORT = np.random.default_rng(3).uniform(1.0, 2.0, 6).round(4).tolist()
_LONG = np.geomspace(1.0, 40.0, 6).round(4).tolist()
CASES["phi3"] = (
    Phi3ForCausalLM, Phi3Config,
    dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
         bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False),
    118, "Phi-3 (mini 4k), GQA 4/2, fused qkv_proj / gate_up_proj, sliding_window 8 on every layer, untied",
)
CASES["phi3_longrope"] = (
    Phi3ForCausalLM, Phi3Config,
    dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
         original_max_position_embeddings=LONGROPE_ORIG,
         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                          "short_factor": _SHORT, "long_factor": _LONG},
         bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=True),
    119, f"Phi-3.5 / Phi-4-mini style: GQA 4/2, fused weights, partial rotary 0.75 (12 of 16 dims), "
         f"LongRoPE (short factors in 1..2, long 1..40, original_max_position_embeddings {LONGROPE_ORIG}, "
         f"max 256: attention factor sqrt(1 + ln(256/{LONGROPE_ORIG}) / ln {LONGROPE_ORIG})), tied",
)


def config_kwargs(name: str, **changes) -> dict:
    """COMMON, the case's overrides, then `changes` (Gemma names its activation
    `hidden_activation` and takes no `hidden_act`)."""
    kw = dict(COMMON)
    kw.update(CASES[name][2])
    kw.update(changes)
    if "hidden_activation" in kw:
        kw.pop("hidden_act")
    return kw


def is_gemma(name: str) -> bool:
    return name.startswith("gemma")


def build(name: str):
    model_cls, config_cls, _, seed, _ = CASES[name]
    config = config_cls(**config_kwargs(name))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # Randomise every RMSNorm weight and every bias (init sets them to 1 / 0).
    gen = torch.Generator().manual_seed(seed + 10_000)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                lo, hi = GEMMA_NORM_RANGE if is_gemma(name) else NORM_RANGE
                p.copy_(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
            elif pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
    return model


def variant_model(name: str, model, **cfg_changes):
    """The same weights under a modified config."""
    model_cls, config_cls, _, _, _ = CASES[name]
    config = config_cls(**config_kwargs(name, **cfg_changes))
    config._attn_implementation = "eager"
    other = model_cls(config).to(torch.float32).eval()
    other.load_state_dict(model.state_dict())
    return other
