"""The self-checks each case's model must pass before its goldens are written: finite, spread
logits, non-trivial norms and biases, and per case that the feature it covers changes the logits
(rope scaling, sliding windows, soft-capping, MoE routing, LongRoPE's factors)."""

from __future__ import annotations

import math

import numpy as np
import torch
from arch_cases import LONG_PROMPT_LEN, MOE_CASES, NEW_TOKENS, PROMPT_LEN, SEQ, is_gemma, variant_model
from arch_reference import forward_logits, routing, shorter_logits, variant_logits


def llama3_band_counts(config) -> tuple[int, int, int]:
    """(#unchanged high-freq, #smoothed, #divided-by-factor) rotary frequencies."""
    rp = config.rope_parameters
    dim = config.head_dim
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2) / dim))
    wl = 2 * math.pi / inv
    old = rp["original_max_position_embeddings"]
    hi_wl, lo_wl = old / rp["high_freq_factor"], old / rp["low_freq_factor"]
    return int((wl < hi_wl).sum()), int(((wl >= hi_wl) & (wl <= lo_wl)).sum()), int((wl > lo_wl).sum())


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
