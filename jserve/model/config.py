"""Frozen configuration dataclasses: the model's shape and the engine's knobs.

`ModelConfig` is built from a Hugging Face `config.json` dict or from GGUF metadata and is
hashable, so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

# HF `architectures` entry (or GGUF `general.architecture`) -> our family name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(sorted(_HF_ARCHITECTURES))


# A decoder layer's matmul weights, in the order the model and the fused native layers take them.
LAYER_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: `llama3` (Llama 3.1/3.2) or `linear` (position interpolation)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r} (supported: llama3, linear)")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_window: int | None = None  # Mistral v0.1: attend to the last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.architecture not in _GGUF_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V bytes of one token over all layers: `dtype_bytes` per element, plus
        `scale_bytes` per KV head (a quantized cache's scale per token and head)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    # ----------------------------------------------------------------------------- builders

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; unsupported models raise ValueError."""
        archs = cfg.get("architectures") or []
        family = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        if family is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            kwargs = dict(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        # transformers 5 moved rope settings into `rope_parameters`; read both spellings.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        head_dim = cfg.get("head_dim") or hidden // num_heads
        sliding = cfg.get("sliding_window")
        if family == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=family,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_from_dict(scaling),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family in ("llama", "mistral") and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            **kwargs,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, has_output_tensor: bool,
                           has_qkv_bias: bool = False) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(sorted(_GGUF_ARCHITECTURES))}")

        def get(key, default=None, required=False):
            full = f"{arch}.{key}"
            if full not in meta:
                if required:
                    raise ValueError(f"GGUF metadata lacks required key {full!r}")
                return default
            return meta[full]

        hidden = int(get("embedding_length", required=True))
        num_heads = int(get("attention.head_count", required=True))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            raise ValueError("GGUF metadata gives no vocabulary size")
        scaling = None
        if get("rope.scaling.type") in ("linear",):
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=has_qkv_bias,
            qk_norm=arch == "qwen3",
            sliding_window=get("attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        d = json.loads(text)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


def _rope_scaling_from_dict(d: Mapping[str, Any] | None) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(d["factor"]),
                           low_freq_factor=float(d.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(d.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", factor=float(d["factor"]))
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def rope_inv_freq(config: ModelConfig) -> list[float]:
    """Rotary inverse frequencies (length head_dim/2), with Llama 3 / linear scaling applied."""
    dim = config.head_dim
    inv = [1.0 / (config.rope_theta ** (2 * i / dim)) for i in range(dim // 2)]
    s = config.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return [f / s.factor for f in inv]
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out
