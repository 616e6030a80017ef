#!/usr/bin/env python3
"""Generate tiny Hugging Face reference checkpoints + golden outputs for jserve.

For every supported architecture this writes a TINY random-weight float32
model (hidden 64, 2 layers, vocab 256, intermediate 128, max positions 256)
to ``tests/data/arch/<name>/`` as ``config.json`` + ``model.safetensors``
(exactly what ``save_pretrained(..., safe_serialization=True)`` writes;
``generation_config.json`` is deleted because nothing reads it), plus
``reference.npz`` with:

* ``input_ids``  int32   [2, 24]       fixed random ids (numpy seed)
* ``logits``     float32 [2, 24, 256]  one forward pass, attention_mask all ones
* ``greedy_ids`` int32   [1, 8]        the 8 NEW tokens of
  ``model.generate(input_ids[:1, :10], max_new_tokens=8, do_sample=False)``
  with eos disabled (generation never stops early; the ids may contain the
  config's eos id, a serving engine must ignore eos to reproduce them)

All runs use ``attn_implementation="eager"`` and one CPU thread. Every
RMSNorm weight (incl. Qwen3 q_norm/k_norm) is drawn from U(0.5, 1.5) and
every bias from N(0, 0.2), so norm/bias bugs change the logits.

Cases: llama2, llama3, llama_bias, mistral, qwen2, qwen3, smollm2, gemma2,
gemma3, the mixtures of experts qwen3_moe, mixtral, qwen2_moe, and phi3,
phi3_longrope (see ``CASES`` below and tests/data/arch/README.md;
phi3_longrope's reference.npz adds ``logits_short`` [2, 12, 256], the first
12 tokens alone, and ``greedy_long_ids`` [1, 8], after a 16-token prompt). Self-checks run each time:
the saved folder reloads to bit-identical logits, the greedy ids equal a
no-cache argmax loop, logits std > 1e-2, biases/norms are not trivial,
llama3's rope scaling changes the logits versus an unscaled copy (with
head_dim 16, rope_theta 500000 and original_max_position_embeddings 64 the
8 rotary frequencies fall into all three llama3 bands: 1 unchanged
high-frequency, 1 smoothed, 6 divided by ``factor``; the script asserts
this), mistral's sliding_window 8 changes the logits versus
sliding_window None, and for Gemma: the sliding layers' window 8 changes the
logits at positions >= 8 only (vs a 4096 window), query_pre_attn_scalar
differs from head_dim and matters, Gemma 2's attention and final logit
soft-capping each change the logits, and Gemma 3's local rotary base and its
global layers' linear scaling each do. Gemma's RMSNorm scales by (1 + w), so
its norm weights are drawn from U(-0.5, 0.5) instead. Phi-3: the sliding window
8 changes the logits at positions >= 8 only; LongRoPE's long factors, short
factors and attention factor each change the logits, the first 12 tokens' logits
differ from the same positions' in the 24-token forward (short vs long factors),
and generate() is seen recomputing positions 0..12 when the sequence passes 12.

The test suite never needs torch; only this generator does. Set up its own
virtualenv (Python 3.11, CPU torch wheel that lies on the dev machine's disk;
install torch FIRST and pinned so pip never pulls a CUDA build)::

    cd /work/main   # repo root
    PYENV_VERSION=3.11.7 python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0
    .venv-ref/bin/pip install transformers safetensors numpy

Run (regenerates tests/data/arch/ in place; deterministic, byte-identical
across runs on the same torch/transformers versions)::

    .venv-ref/bin/python tests/tools/make_arch_goldens.py
    .venv-ref/bin/python tests/tools/make_arch_goldens.py --out /tmp/arch --only llama3 mistral

Generated with torch 2.13.0+cpu and transformers 5.24.0.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
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


def make_input_ids() -> np.ndarray:
    rng = np.random.default_rng(INPUT_SEED)
    return rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64).astype(np.int32)


@torch.no_grad()
def forward_logits(model, ids: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(ids.astype(np.int64))
    out = model(input_ids=t, attention_mask=torch.ones_like(t), use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(prompt.astype(np.int64))
    # eos disabled: generate() fills None fields of a passed GenerationConfig
    # from model.generation_config (which carries the config's eos id), so clear
    # it there too. No min_new_tokens: that would mask the eos logit instead.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), generation_config=gc)
    new = out[:, t.shape[1]:].numpy().astype(np.int32)
    assert new.shape == (1, NEW_TOKENS), new.shape
    # Cross-check against a cache-free argmax loop.
    seq = t.clone()
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    loop = seq[:, t.shape[1]:].numpy().astype(np.int32)
    assert np.array_equal(new, loop), (name_of(model), new, loop)
    return new


def rotary_positions(model, prompt: np.ndarray) -> list[list[int]]:
    """The position_ids of each rotary-embedding call during `greedy(model, prompt)`."""
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True)
    greedy(model, prompt)
    hook.remove()
    return seen


@torch.no_grad()
def cached_loop(model, prompt: np.ndarray) -> np.ndarray:
    """Greedy tokens by single-token steps over one DynamicCache that is never dropped."""
    from transformers import DynamicCache

    t = torch.from_numpy(prompt.astype(np.int64))
    out = model(input_ids=t, use_cache=True, cache=DynamicCache(config=model.config))
    new = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(NEW_TOKENS - 1):
        out = model(input_ids=new[-1], position_ids=torch.tensor([[t.shape[1] + i]]), use_cache=True,
                    cache=out.cache)
        new.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(new, dim=1).numpy().astype(np.int32)


def name_of(model) -> str:
    return type(model).__name__


def llama3_band_counts(config) -> tuple[int, int, int]:
    """(#unchanged high-freq, #smoothed, #divided-by-factor) rotary frequencies."""
    rp = config.rope_parameters
    dim = config.head_dim
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2) / dim))
    wl = 2 * math.pi / inv
    old = rp["original_max_position_embeddings"]
    hi_wl, lo_wl = old / rp["high_freq_factor"], old / rp["low_freq_factor"]
    return int((wl < hi_wl).sum()), int(((wl >= hi_wl) & (wl <= lo_wl)).sum()), int((wl > lo_wl).sum())


def variant_model(name: str, model, **cfg_changes):
    """The same weights under a modified config."""
    model_cls, config_cls, _, _, _ = CASES[name]
    config = config_cls(**config_kwargs(name, **cfg_changes))
    config._attn_implementation = "eager"
    other = model_cls(config).to(torch.float32).eval()
    other.load_state_dict(model.state_dict())
    return other


def variant_logits(name: str, model, ids: np.ndarray, **cfg_changes) -> np.ndarray:
    """Logits of the same weights under a modified config."""
    return forward_logits(variant_model(name, model, **cfg_changes), ids)


@torch.no_grad()
def routing(model, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each MoE layer's (router probabilities [tokens, experts], chosen experts [tokens, k]) on `ids`."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: got.append(out))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    forward_logits(model, ids)
    for h in hooks:
        h.remove()
    return [(torch.softmax(lg.float(), -1).numpy(), idx.numpy()) for lg, _, idx in got]


def moe_checks(name: str, model, ids: np.ndarray, logits: np.ndarray) -> list[str]:
    """Routing matters: every layer spreads its tokens over most experts in many different top-k
    sets, no expert takes most tokens, the k-th and (k+1)-th probabilities never nearly tie (so
    float rounding cannot flip a choice between implementations), and top-1 instead of top-2
    changes the logits."""
    notes = []
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    k = cfg.num_experts_per_tok
    layers = routing(model, ids)
    assert len(layers) == cfg.num_hidden_layers, len(layers)
    for i, (probs, idx) in enumerate(layers):
        used = np.bincount(idx.reshape(-1), minlength=experts)
        sets = {tuple(sorted(r)) for r in idx.tolist()}
        top = np.sort(probs, axis=-1)[:, ::-1]
        gap = float((top[:, k - 1] - top[:, k]).min())
        assert (used > 0).sum() >= experts - 1, (name, i, used)
        assert used.max() < 0.6 * len(idx), (name, i, used)
        assert len(sets) >= 8, (name, i, sets)
        assert gap > 1e-5, (name, i, gap)
        notes.append(f"layer {i}: tokens per expert {used.tolist()}, {len(sets)} distinct top-{k} sets, "
                     f"min gap p[{k}] - p[{k + 1}] {gap:.1e}")
    d = float(np.abs(variant_logits(name, model, ids, num_experts_per_tok=1) - logits).max())
    assert d > 1e-2, d
    notes.append(f"max|dlogit| vs top-1 routing: {d:.3f}")
    if hasattr(cfg, "norm_topk_prob"):
        d = float(np.abs(variant_logits(name, model, ids, norm_topk_prob=not cfg.norm_topk_prob) - logits).max())
        assert d > 1e-2, d
        notes.append(f"max|dlogit| vs norm_topk_prob={not cfg.norm_topk_prob}: {d:.3f}")
    for pname, p in model.named_parameters():
        if "experts" in pname or pname.endswith("gate.weight"):
            std = float(p.detach().std())
            assert 0.05 < std < 0.2, (pname, std)  # initialised, not torch.empty
    return notes


def longrope_checks(name: str, model, ids: np.ndarray, logits: np.ndarray) -> list[str]:
    """LongRoPE matters: the long factors (the 24-token forward), the short ones (the first
    LONGROPE_ORIG tokens), the attention factor, and the partial rotary (6 frequencies)."""
    notes = []
    rope = dict(model.config.rope_parameters)
    orig = rope["original_max_position_embeddings"]
    assert SEQ > orig and PROMPT_LEN <= orig < PROMPT_LEN + NEW_TOKENS - 1 and LONG_PROMPT_LEN > orig
    assert model.model.rotary_emb.inv_freq.shape == (6,)  # 12 of head_dim 16 rotate
    scaling = model.model.rotary_emb.attention_scaling
    assert abs(scaling - math.sqrt(1 + math.log(256 / orig) / math.log(orig))) < 1e-12, scaling
    short = shorter_logits(model, ids)
    assert np.abs(short - logits[:, :orig]).max() > 1e-2  # the same tokens, short factors
    for what, change, use_short in (("long_factor = short_factor", {"long_factor": rope["short_factor"]}, False),
                                    ("short_factor = 1", {"short_factor": [1.0] * 6}, True),
                                    ("attention_factor = 1", {"attention_factor": 1.0}, False)):
        other = variant_model(name, model, rope_parameters={**rope, **change})
        got = shorter_logits(other, ids) if use_short else forward_logits(other, ids)
        d = float(np.abs(got - (short if use_short else logits)).max())
        assert d > 1e-2, (what, d)
        notes.append(f"max|dlogit| vs {what}: {d:.3f}")
    notes.append(f"attention factor {scaling:.4f}; max|dlogit| of the first {orig} tokens, short vs long: "
                 f"{float(np.abs(short - logits[:, :orig]).max()):.3f}")
    return notes


def shorter_logits(model, ids: np.ndarray) -> np.ndarray:
    """Logits of the first original_max_position_embeddings tokens alone (LongRoPE's short factors)."""
    return forward_logits(model, ids[:, :model.config.rope_parameters["original_max_position_embeddings"]])


def checks(name: str, model, ids: np.ndarray, logits: np.ndarray) -> list[str]:
    notes = []
    assert np.isfinite(logits).all(), name
    assert logits.std() > 1e-2, (name, logits.std())
    for pname, p in model.named_parameters():
        if pname.endswith("norm.weight") or pname.endswith(".bias"):
            assert p.detach().abs().min() > 0 and not torch.allclose(p, torch.ones_like(p)), pname
    if name == "llama3":
        hi, mid, lo = llama3_band_counts(model.config)
        assert hi >= 1 and mid >= 1 and lo >= 1, (hi, mid, lo)
        plain = variant_logits(name, model, ids,
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        d = float(np.abs(plain - logits).max())
        assert d > 1e-2, d
        notes.append(f"rope bands hi/mid/lo={hi}/{mid}/{lo}; max|dlogit| vs unscaled={d:.3f}")
    if name == "mistral":
        full = variant_logits(name, model, ids, sliding_window=None)
        diff = np.abs(full - logits).max(axis=(0, 2))  # per position
        W = model.config.sliding_window
        assert diff[:W].max() < 1e-5, diff[:W]  # positions < W see everything anyway
        assert diff[W:].max() > 1e-2, diff[W:]
        notes.append(f"max|dlogit| vs sliding_window=None: pos<{W} {diff[:W].max():.1e}, "
                     f"pos>={W} {diff[W:].max():.3f}")
    if name in ("qwen2", "llama_bias"):
        biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
        assert biases, name
        notes.append(f"{len(biases)} bias tensors, all non-zero")
    if name == "qwen3":
        assert model.config.head_dim == 32
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    if name in MOE_CASES:
        notes += moe_checks(name, model, ids, logits)
    if name == "phi3":
        full = variant_logits(name, model, ids, sliding_window=None)
        diff = np.abs(full - logits).max(axis=(0, 2))
        W = model.config.sliding_window
        assert diff[:W].max() < 1e-5, diff[:W]
        assert diff[W:].max() > 1e-2, diff[W:]
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
        notes.append(f"max|dlogit| vs sliding_window=None: pos<{W} {diff[:W].max():.1e}, "
                     f"pos>={W} {diff[W:].max():.3f}")
    if name == "phi3_longrope":
        notes += longrope_checks(name, model, ids, logits)
    if is_gemma(name):
        cfg = model.config
        W = cfg.sliding_window
        assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types, cfg.layer_types
        assert cfg.query_pre_attn_scalar != cfg.head_dim
        # A window wider than the input keeps the local layers' own rotary base (Gemma 3).
        wide = variant_logits(name, model, ids, sliding_window=4096)
        diff = np.abs(wide - logits).max(axis=(0, 2))
        assert diff[:W].max() < 1e-5, diff[:W]
        assert diff[W:].max() > 1e-2, diff[W:]
        notes.append(f"layer_types {cfg.layer_types}; max|dlogit| vs sliding_window=4096: "
                     f"pos<{W} {diff[:W].max():.1e}, pos>={W} {diff[W:].max():.3f}")
        d = float(np.abs(variant_logits(name, model, ids, query_pre_attn_scalar=cfg.head_dim) - logits).max())
        assert d > 1e-2, d
        notes.append(f"max|dlogit| vs query_pre_attn_scalar=head_dim: {d:.3f}")
    if name == "gemma2":
        cfg = model.config
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            d = float(np.abs(variant_logits(name, model, ids, **{key: None}) - logits).max())
            assert d > 1e-2, (key, d)
            notes.append(f"max|dlogit| vs {key}=None: {d:.3f}")
        assert np.abs(logits).max() < cfg.final_logit_softcapping
    if name == "gemma3":
        rope = model.config.rope_parameters
        for kind, change in (("sliding_attention", {"rope_type": "default", "rope_theta": 1000000.0}),
                             ("full_attention", {"rope_type": "default", "rope_theta": 1000000.0})):
            d = float(np.abs(variant_logits(name, model, ids, rope_parameters={**rope, kind: change})
                             - logits).max())
            assert d > 1e-2, (kind, d)
            notes.append(f"max|dlogit| vs {kind} rope {change}: {d:.3f}")
        q_norm = model.model.layers[0].self_attn.q_norm.weight
        assert q_norm.shape == (32,) and q_norm.abs().min() > 0
    return notes


def write_case(name: str, out_dir: Path) -> dict:
    model = build(name)
    ids = make_input_ids()
    logits = forward_logits(model, ids)
    greedy_ids = greedy(model, ids[:1, :PROMPT_LEN])
    notes = checks(name, model, ids, logits)

    d = out_dir / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    gc_path = d / "generation_config.json"
    if gc_path.exists():
        gc_path.unlink()
    extra = {}
    if name == "phi3_longrope":
        extra = dict(logits_short=shorter_logits(model, ids).astype(np.float32),
                     greedy_long_ids=greedy(model, ids[:1, :LONG_PROMPT_LEN]))
        seen = rotary_positions(model, ids[:1, :PROMPT_LEN])
        assert list(range(LONGROPE_ORIG + 1)) in seen, seen  # generate() recomputed at the crossing
        short_cache = cached_loop(model, ids[:1, :PROMPT_LEN])  # what keeping the cache would give
        notes.append(f"generate() recomputes positions 0..{LONGROPE_ORIG} when the sequence passes "
                     f"{LONGROPE_ORIG} tokens; keeping the short-rotated cache instead would give "
                     f"{short_cache[0].tolist()} (vs {greedy_ids[0].tolist()})")
    np.savez(d / "reference.npz", input_ids=ids, logits=logits.astype(np.float32),
             greedy_ids=greedy_ids, **extra)

    # Round trip: the saved folder must reproduce the logits exactly.
    model_cls = CASES[name][0]
    reloaded = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    re_logits = forward_logits(reloaded, ids)
    assert np.array_equal(re_logits, logits), (name, np.abs(re_logits - logits).max())
    assert np.array_equal(greedy(reloaded, ids[:1, :PROMPT_LEN]), greedy_ids), name
    for key, value in extra.items():
        if key == "logits_short":
            assert np.array_equal(shorter_logits(reloaded, ids), value), name

    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in d.iterdir())
    return dict(name=name, params=n_params, std=float(logits.std()),
                maxabs=float(np.abs(logits).max()), size_kb=size / 1024,
                greedy=greedy_ids[0].tolist(), notes=notes,
                eos=model.config.eos_token_id,
                files=sorted(f.name for f in d.iterdir()))


def write_readme(out_dir: Path, rows: list[dict]) -> None:
    lines = [
        "# Tiny architecture goldens",
        "",
        "Generated by `tests/tools/make_arch_goldens.py` with "
        f"torch {torch.__version__} and transformers {transformers.__version__} "
        "(float32, CPU, eager attention, 1 thread). Random weights, fixed seeds; "
        "every RMSNorm weight ~ U(0.5, 1.5) (Gemma's, which scale by 1 + w, ~ U(-0.5, 0.5)) "
        "and every bias ~ N(0, 0.2).",
        "",
        "Each folder holds `config.json` + `model.safetensors` exactly as "
        "`save_pretrained(..., safe_serialization=True)` writes them "
        "(`generation_config.json` deleted; tied models store no `lm_head.weight`) "
        "and `reference.npz`:",
        "",
        f"- `input_ids` int32 [{BATCH}, {SEQ}]: fixed ids, `numpy.random.default_rng({INPUT_SEED})`",
        f"- `logits` float32 [{BATCH}, {SEQ}, {VOCAB}]: one forward pass, attention_mask all ones",
        f"- `greedy_ids` int32 [1, {NEW_TOKENS}]: the {NEW_TOKENS} new tokens of "
        f"`generate(input_ids[:1, :{PROMPT_LEN}], max_new_tokens={NEW_TOKENS}, do_sample=False)` "
        "with eos disabled (ignore eos when reproducing them)",
        "",
        "Common config: hidden_size 64, 2 layers (gemma2 3, gemma3 4), vocab_size 256, intermediate_size 128, "
        "max_position_embeddings 256, initializer_range 0.1, rms_norm_eps 1e-6 unless noted.",
        "",
        "Transformers 5 writes rope settings as `rope_parameters` "
        "(`{\"rope_type\": ..., \"rope_theta\": ..., <scaling keys>}`); there is no "
        "top-level `rope_theta` or `rope_scaling` in these config.json files. "
        "Checkpoints written by transformers 4.x use top-level `rope_theta` and `rope_scaling`.",
        "",
        "| case | class | what it covers | params | logits std | max abs logit |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        cls, desc = CASES[r["name"]][0].__name__, CASES[r["name"]][4]
        lines.append(f"| `{r['name']}` | {cls} | {desc} | {r['params']:,} | "
                     f"{r['std']:.3f} | {r['maxabs']:.3f} |")
    eos_hits = [f"`{r['name']}` (eos {r['eos']})" for r in rows
                if r["eos"] is not None and r["eos"] in r["greedy"]]
    if eos_hits:
        lines += ["", "greedy_ids that contain the config's eos_token_id (a reproducer must not "
                  "stop at eos): " + ", ".join(eos_hits) + "."]
    lines += [
        "",
        "Checked by the generator on every run: the saved folder reloads to bit-identical logits; "
        "greedy ids equal a cache-free argmax loop; llama3's scaling changes logits vs an "
        "unscaled copy (rotary frequencies land in all three llama3 bands at head_dim 16 with "
        "original_max_position_embeddings 64); mistral's sliding window (key j visible to query "
        "i iff i-8 < j <= i) changes logits at positions >= 8 only; so does Gemma's on its "
        "sliding layers (vs a 4096 window); Gemma 2's attention and final soft-capping, "
        "query_pre_attn_scalar (vs head_dim), and Gemma 3's local rotary base and global "
        "linear scaling each change the logits. The MoE cases (qwen3_moe, mixtral, qwen2_moe): in every "
        "layer the 48 tokens use at least 7 of the 8 experts, no expert takes 60% of them, at least 8 "
        "distinct top-2 sets occur, the 2nd and 3rd router probabilities never come within 1e-5 (so "
        "rounding cannot flip a choice), and top-1 routing (and flipping norm_topk_prob, for the Qwens) "
        "changes the logits. phi3: its sliding window changes logits at positions >= 8 only. phi3_longrope "
        f"(LongRoPE, original_max_position_embeddings {LONGROPE_ORIG}): transformers rotates a sequence of "
        f"more than {LONGROPE_ORIG} tokens by the long factors at every position, so `logits` (24 tokens) are "
        f"long throughout; `reference.npz` adds `logits_short` [{BATCH}, {LONGROPE_ORIG}, {VOCAB}] (the first "
        f"{LONGROPE_ORIG} tokens alone: short factors) and `greedy_long_ids` [1, {NEW_TOKENS}] (after a "
        f"{LONG_PROMPT_LEN}-token prompt); `greedy_ids` cross over at {LONGROPE_ORIG} tokens, where generate() "
        "recomputes the cache with the long factors (the generator sees it do so), so they equal a cache-free "
        "loop's. The long factors, the short factors and the attention factor each change the logits.",
        "",
        "Another CPU may give float32 logits that differ in their last bits (up to ~1.5e-6 "
        "was seen for these folders, well inside the tests' 1e-4); a regeneration that only adds "
        "a case can keep the other folders as committed.",
        "",
        "Regenerate (from the repo root; venv setup is in the script's docstring):",
        "",
        "```sh",
        "PYENV_VERSION=3.11.7 python3 -m venv .venv-ref",
        ".venv-ref/bin/pip install torch==2.13.0",
        ".venv-ref/bin/pip install transformers safetensors numpy",
        ".venv-ref/bin/python tests/tools/make_arch_goldens.py",
        "```",
        "",
    ]
    (out_dir / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), default=None)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)

    names = args.only or list(CASES)
    rows = [write_case(n, args.out) for n in names]
    if not args.no_readme and args.only is None:
        write_readme(args.out, rows)

    print(f"torch {torch.__version__}, transformers {transformers.__version__} -> {args.out}")
    print(f"{'name':<11} {'params':>8} {'logits std':>10} {'max|logit|':>10} {'KB':>6}  greedy_ids")
    for r in rows:
        print(f"{r['name']:<11} {r['params']:>8,} {r['std']:>10.4f} {r['maxabs']:>10.4f} "
              f"{r['size_kb']:>6.0f}  {r['greedy']}")
        for n in r["notes"]:
            print(f"{'':<11} - {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
