"""A mixture-of-experts model's `ModelConfig` fields (experts, top-k, widths, shared expert) read
from a Hugging Face `config.json` dict or from GGUF metadata: `config_readers`' readers add them to
a Qwen3-MoE, Qwen2-MoE or Mixtral config (docs/architecture.md, "The model")."""

from __future__ import annotations

from typing import Any, Mapping


def moe_from_hf(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The experts of a Qwen3-MoE, Qwen2-MoE or Mixtral config.json. Supported: every layer sparse
    (the checkpoint layout stacks one kind of layer), SwiGLU experts, softmax routing."""
    if family == "mixtral":
        experts, width, norm = cfg.get("num_local_experts", 8), cfg["intermediate_size"], True
    else:  # transformers 5 saves Qwen's num_experts as num_local_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        width, norm = cfg.get("moe_intermediate_size", 0), bool(cfg.get("norm_topk_prob", False))
        if experts and (int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers")):
            raise ValueError(f"unsupported {family} variant: dense MLP layers among the sparse ones "
                             f"(decoder_sparse_step {cfg.get('decoder_sparse_step')}, mlp_only_layers "
                             f"{cfg.get('mlp_only_layers')}); only every layer sparse is supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported {family} hidden_act {cfg.get('hidden_act')!r} (supported: silu)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(num_experts=int(experts), num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                norm_topk_prob=norm, moe_intermediate_size=int(width), shared_expert_intermediate_size=shared,
                shared_expert_gate=shared > 0)


def moe_from_gguf(arch: str, get) -> dict[str, Any]:
    """The experts llama.cpp's converter records ({arch}.expert_count, expert_used_count,
    expert_feed_forward_length, expert_shared_feed_forward_length); llama.cpp renormalises the
    top-k weights for Mixtral and Qwen3-MoE and not for Qwen2-MoE (`expert_weights_norm`, where
    written, wins)."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        if arch in ("qwen3moe", "qwen2moe"):
            raise ValueError(f"GGUF metadata lacks {arch}.expert_count")
        return {}
    if arch not in ("llama", "qwen3moe", "qwen2moe"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} with experts (supported: llama (Mixtral), "
                         f"qwen3moe, qwen2moe)")
    width = get("expert_feed_forward_length") if arch != "llama" else get("feed_forward_length")
    if width is None:
        raise ValueError(f"GGUF metadata lacks {arch}.expert_feed_forward_length")
    shared = int(get("expert_shared_feed_forward_length", 0) or 0) if arch == "qwen2moe" else 0
    return dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count", required=True)),
                norm_topk_prob=bool(get("expert_weights_norm", arch != "qwen2moe")),
                moe_intermediate_size=int(width), shared_expert_intermediate_size=shared,
                shared_expert_gate=shared > 0)
