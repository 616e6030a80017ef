"""The model's shape: `ModelConfig`, a frozen dataclass, hashable, so it can be a static argument
of jitted functions, with the derived quantities the layers read (layer kinds, rotary tables).

It is built from a Hugging Face `config.json` dict or from GGUF metadata by the readers in
`jserve.model.config_readers`, which also list the families; the rotary scaling is
`jserve.model.rope`'s. Both modules' public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jserve.model import config_readers
from jserve.model.config_readers import (  # noqa: F401 (re-exported)
    FAMILIES,
    FULL,
    GEMMA_FAMILIES,
    MOE_FAMILIES,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
)
from jserve.model.rope import LONG_ROPE_FLAG, ROPE_TYPES, RopeScaling, rope_inv_freq  # noqa: F401 (re-exported)

# A decoder layer's matmul weights, in the order the model and the fused native layers take them.
LAYER_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | phi3 | the MoE families
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
    rotary_dim: int | None = None  # rotate the first rotary_dim dims of each head, pass the rest
    #   (Phi-3's partial_rotary_factor, e.g. Phi-4-mini's 0.75); None: all head_dim
    sliding_window: int | None = None  # Mistral v0.1, Phi-3: attend to the last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / 3 (defaults: the Llama layer).
    layer_types: tuple[str, ...] | None = None  # per layer SLIDING or FULL; None: every layer
    #   windowed iff sliding_window is set
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1 for Gemma (HF's weights)
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs before each residual add
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcap: float | None = None  # output logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # sliding layers' rotary base, unscaled (Gemma 3);
    #   None: rope_theta and rope_scaling on every layer
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): every layer's MLP is routed over
    # num_experts SwiGLU experts (jserve.model.moe); 0 experts: the dense MLP (intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    norm_topk_prob: bool = False  # the top-k router probabilities renormalised to sum to 1
    moe_intermediate_size: int = 0  # each expert's width
    shared_expert_intermediate_size: int = 0  # a shared expert every token runs (0: none)
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x @ w) (Qwen2-MoE)

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
        if self.architecture not in FAMILIES:
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: silu, gelu_tanh)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
                raise ValueError(f"layer_types must give {SLIDING!r} or {FULL!r} for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types!r}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config {name} must be positive or None, got {value!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                                 f"got {self.num_experts_per_tok!r}")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")
            if self.hidden_act != "silu" or self.mlp_bias:
                raise ValueError("mixture-of-experts layers are SwiGLU without biases")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate without a shared expert (shared_expert_intermediate_size)")
        if self.rotary_dim is not None and not (isinstance(self.rotary_dim, int) and 0 < self.rotary_dim
                                                <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be an even integer in 2..head_dim ({self.head_dim}), "
                             f"got {self.rotary_dim!r}")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope" and len(s.short_factor) != self.rope_dim // 2:
            raise ValueError(f"longrope's short_factor and long_factor must have rotary_dim / 2 = "
                             f"{self.rope_dim // 2} entries, got {len(s.short_factor)}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_dim(self) -> int:
        """The dims of each head that rotate (the first ones): `rotary_dim`, else head_dim."""
        return self.rotary_dim or self.head_dim

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's switch: a sequence of more tokens than this (its original context) rotates
        every position by the long factors, one of at most this many by the short ones, as
        transformers does (its generate() recomputes the cache when a sequence grows past it);
        None without LongRoPE."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s is not None and s.rope_type == "longrope" else None

    def long_rope(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens (prompt and output) rotates by the long factors."""
        after = self.long_rope_after
        return after is not None and num_tokens > after

    @property
    def attention_scale(self) -> float:
        """The attention logits' scale: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (and, with rope_local_theta,
        rotates by the local base)."""
        if self.layer_types is None:
            return self.sliding_window is not None
        return self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_is_sliding(layer) else None

    @property
    def mixed_layers(self) -> bool:
        """Whether the layers are of two kinds (sliding and full attention, Gemma 2 / 3): a layer's
        window (and rotary base) is then its own, not one for the whole stack."""
        return len({self.layer_is_sliding(i) for i in range(self.num_layers)}) > 1

    @property
    def shared_window(self) -> int | None:
        """The sliding window every layer attends through (Mistral, Phi-3), or None when some
        layer sees every position (Gemma's full layers): the page table gives back the pages
        behind a shared window (`jserve.core.page_table`)."""
        return self.sliding_window if self.layer_is_sliding(0) and not self.mixed_layers else None

    def layer_period(self) -> int:
        """The smallest p such that layer i's kind is layer (i mod p)'s for every i below
        (num_layers // p) * p: a scanned stack runs groups of p layers, each of a fixed kind, and
        the num_layers % p left after the last whole group on their own. 1 for one kind of layer;
        2 for Gemma 2; 6 for Gemma 3 (5 sliding, then a full one)."""
        kinds = [self.layer_is_sliding(i) for i in range(self.num_layers)]
        for p in range(1, self.num_layers + 1):
            whole = self.num_layers // p * p
            if all(kinds[i] == kinds[i % p] for i in range(whole)):
                return p
        return self.num_layers

    @property
    def moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (every layer's: mixed stacks are refused)."""
        return self.num_experts > 0

    @property
    def llama_layer(self) -> bool:
        """Whether a layer is the plain Llama layer (pre-norms x * w, SwiGLU, head_dim ** -0.5,
        no soft-capping, one window and rotary base for all layers, every head dim rotating), as fused
        kernels implement it."""
        return (not self.norm_offset and not self.post_norms and self.hidden_act == "silu"
                and self.query_pre_attn_scalar is None and self.attn_logit_softcap is None
                and not self.mixed_layers and self.rope_local_theta is None and not self.moe
                and self.rope_dim == self.head_dim)

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
        if self.moe:
            mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts + self._shared_params()
        per_layer = attn + mlp + (4 if self.post_norms else 2) * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def _shared_params(self) -> int:
        fs = self.shared_expert_intermediate_size
        return 3 * self.hidden_size * fs + (self.hidden_size if self.shared_expert_gate else 0)

    def expert_params(self) -> int:
        """Parameters of all layers' routed experts (0 for a dense model)."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def active_params(self) -> int:
        """Parameters one token's forward pass reads: all but the experts it is not routed to."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_params() - self.num_layers * unused * 3 * self.hidden_size * self.moe_intermediate_size

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V bytes of one token over all layers: `dtype_bytes` per element, plus
        `scale_bytes` per KV head (a quantized cache's scale per token and head)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    # ----------------------------------------------------------------------------- builders
    # (jserve.model.config_readers: the Hugging Face and GGUF readers)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; unsupported models raise ValueError."""
        return cls(**config_readers.from_hf_config(cfg))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, has_output_tensor: bool,
                           has_qkv_bias: bool = False,
                           rope_factors: tuple[Any, Any] | None = None) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values). `rope_factors`:
        the (long, short) values of a Phi-3 GGUF's `rope_factors_long` / `rope_factors_short`
        tensors (LongRoPE), where it has them."""
        return cls(**config_readers.from_gguf_metadata(meta, has_output_tensor=has_output_tensor,
                                                       has_qkv_bias=has_qkv_bias, rope_factors=rope_factors))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        d = json.loads(text)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)
