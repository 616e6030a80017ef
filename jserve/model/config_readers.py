"""The families jserve serves, and `ModelConfig`'s fields read from a Hugging Face `config.json`
dict or from GGUF metadata (llama.cpp's keys): the per-family readers (Llama, Mistral, Qwen 2/3,
Gemma 2/3, Phi-3, the mixtures of experts) and the rope scaling they parse. Each reader returns the
fields as a dict; `ModelConfig.from_hf_config` / `from_gguf_metadata` build (and check) the config."""

from __future__ import annotations

import math
from typing import Any, Mapping

from jserve.model.config_moe import moe_from_gguf, moe_from_hf
from jserve.model.rope import ROPE_TYPES, RopeScaling

# HF `architectures` entry (or GGUF `general.architecture`) -> our family name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model (`text_config`) only
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",  # Phi-3 / Phi-3.5 mini and medium, Phi-4 and Phi-4-mini
}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma2": "gemma2", "gemma3": "gemma3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
                      "phi3": "phi3"}
SUPPORTED_ARCHITECTURES = tuple(sorted(HF_ARCHITECTURES))
GEMMA_FAMILIES = ("gemma2", "gemma3")
# Mixture-of-experts families (llama.cpp writes Mixtral as a "llama" GGUF with experts).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
FAMILIES = frozenset(GGUF_ARCHITECTURES.values()) | set(MOE_FAMILIES)  # ModelConfig.architecture

# `ModelConfig.layer_types` entries (Hugging Face's names).
SLIDING, FULL = "sliding_attention", "full_attention"


# Hugging Face's defaults for keys a Gemma config.json may leave out (Gemma2Config,
# Gemma3TextConfig): a Gemma 3 multimodal checkpoint's `text_config` gives little more than its sizes.
_GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1),
}
# The GELU's tanh approximation (what Gemma's `gelu_pytorch_tanh` computes).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def from_hf_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Build from a Hugging Face `config.json` dict; unsupported models raise ValueError."""
    archs = cfg.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None and not archs and cfg.get("model_type") in ("gemma2", "gemma3_text"):
        family = "gemma3" if cfg["model_type"] == "gemma3_text" else "gemma2"  # e.g. a text_config
    if family is None:
        raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if family in GEMMA_FAMILIES:
        return _from_hf_gemma(family, cfg)
    if family == "phi3":
        _check_phi3(cfg)
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
    # Partial rotary (Phi-3's key; transformers 5 moves it into rope_parameters).
    partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(int(head_dim) * partial)
    sliding = cfg.get("sliding_window")
    if family in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        sliding = None
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    return dict(
        architecture=family,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=_rope_scaling_from_dict(scaling, cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotary_dim=rotary_dim if rotary_dim != int(head_dim) else None,
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and cfg.get("qkv_bias", True)) or attention_bias,
        o_bias=family in ("llama", "mistral") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        **kwargs,
        **(moe_from_hf(family, cfg) if family in MOE_FAMILIES else {}),
    )


def _from_hf_gemma(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2 (`gemma2`) or Gemma 3's text model (`gemma3_text`, alone or as a multimodal
    checkpoint's `text_config`), with transformers' defaults for the keys a config leaves out."""
    cfg = _gemma_text_config(cfg)
    c = {**_GEMMA_DEFAULTS[family], **{k: v for k, v in cfg.items() if k in _GEMMA_DEFAULTS[family]
                                       and (v is not None or k.endswith("softcapping"))}}
    _check_gemma_variant(cfg, c)
    layers = int(c["num_hidden_layers"])
    types = _gemma_layer_types(family, cfg, layers)
    theta, scaling, local_theta = _gemma_rope(family, cfg, c)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = c["eos_token_id"]
    soft = c["attn_logit_softcapping"]
    final = c["final_logit_softcapping"]
    return dict(
        architecture=family,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=layers,
        num_heads=int(c["num_attention_heads"]),
        num_kv_heads=int(c["num_key_value_heads"]),
        head_dim=int(c["head_dim"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=_rope_scaling_from_dict(scaling),
        max_position_embeddings=int(c["max_position_embeddings"]),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=family == "gemma3",
        sliding_window=int(c["sliding_window"]) if SLIDING in types else None,
        bos_token_id=c["bos_token_id"],
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        layer_types=tuple(types),
        norm_offset=1.0,
        post_norms=True,
        embed_scale=True,
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
        attn_logit_softcap=float(soft) if soft else None,
        final_logit_softcap=float(final) if final else None,
        rope_local_theta=local_theta,
    )


def _gemma_text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Gemma 3 multimodal checkpoint's (Gemma3ForConditionalGeneration) language model's
    config, with the checkpoint's architectures; any other config itself."""
    if "text_config" not in cfg:
        return cfg
    cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    if cfg.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(f"unsupported Gemma 3 text_config model_type {cfg['model_type']!r}")
    return cfg


def _check_gemma_variant(cfg: Mapping[str, Any], c: Mapping[str, Any]) -> None:
    """Refuse the Gemma variants the layer does not implement (`c`: cfg over the defaults)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported Gemma variant: use_bidirectional_attention (an embedding "
                         "model, e.g. EmbeddingGemma) is not a causal decoder")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or c["hidden_activation"]
    if act not in _GELU_TANH:
        raise ValueError(f"unsupported Gemma hidden_activation {act!r} (supported: {', '.join(_GELU_TANH)})")


def _gemma_layer_types(family: str, cfg: Mapping[str, Any], layers: int) -> list[str]:
    """Each layer's kind (SLIDING or FULL): `layer_types`, or from an older config's pattern."""
    types = cfg.get("layer_types")
    if types is None:  # older configs: Gemma 2 alternates; Gemma 3 has one full layer in `pattern`
        pattern = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern")
                                                   or cfg.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"unsupported Gemma layer types {unknown} (supported: {SLIDING}, {FULL})")
    return types


def _gemma_rope(family: str, cfg: Mapping[str, Any], c: Mapping[str, Any]) -> tuple[float, Any, float | None]:
    """(rope_theta, the rope_scaling dict or None, Gemma 3's sliding layers' base or None).

    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4.x top-level
    rope_theta / rope_scaling / rope_local_base_freq."""
    rope = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    if family == "gemma3":
        full = dict(rope.get(FULL) or {})
        local = dict(rope.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rotary scaling on Gemma 3's sliding layers: {local!r}")
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq") or c["rope_local_base_freq"]))
        rope = full
    theta = float(rope.get("rope_theta", cfg.get("rope_theta") or c["rope_theta"]))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return theta, scaling, local_theta


def from_gguf_metadata(meta: Mapping[str, Any], *, has_output_tensor: bool,
                       has_qkv_bias: bool = False,
                       rope_factors: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Build from GGUF key/value metadata (already decoded to Python values). `rope_factors`:
    the (long, short) values of a Phi-3 GGUF's `rope_factors_long` / `rope_factors_short`
    tensors (LongRoPE), where it has them."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")

    get = _gguf_getter(meta, arch)
    hidden = int(get("embedding_length", required=True))
    num_heads = int(get("attention.head_count", required=True))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ValueError("GGUF metadata gives no vocabulary size")
    scaling = None
    if get("rope.scaling.type") in ("linear",):
        scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if arch in GEMMA_FAMILIES:
        return _from_gguf_gemma(arch, meta, get, vocab=int(vocab), scaling=scaling,
                                    has_output_tensor=has_output_tensor)
    phi3 = {}
    if arch == "phi3":
        phi3 = _phi3_from_gguf(get, hidden // num_heads, rope_factors)
        scaling = phi3.pop("rope_scaling")
    elif rope_factors is not None:
        raise ValueError(f"GGUF tensors rope_factors_long / rope_factors_short (LongRoPE) are supported "
                         f"for phi3 only, not {arch!r}")
    moe = moe_from_gguf(arch, get)
    family = "mixtral" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch]
    return dict(
        architecture=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", moe.get("moe_intermediate_size"), required=not moe)),
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
        qk_norm=arch in ("qwen3", "qwen3moe"),
        sliding_window=get("attention.sliding_window") or None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        **moe,
        **phi3,
    )


def _gguf_getter(meta: Mapping[str, Any], arch: str):
    """`get(key, default=None, required=False)`: metadata key `{arch}.{key}`; a missing required
    key is a ValueError naming it."""
    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ValueError(f"GGUF metadata lacks required key {full!r}")
            return default
        return meta[full]

    return get


def _from_gguf_gemma(arch: str, meta: Mapping[str, Any], get, *, vocab: int, scaling,
                     has_output_tensor: bool) -> dict[str, Any]:
    """Gemma 2 / 3 from llama.cpp's metadata. What its converter does not write, llama.cpp
    derives, and so does this: the sliding layers' pattern (Gemma 2 alternates, Gemma 3 has
    a full layer every 6th; an `attention.sliding_window_pattern` array, where given, wins),
    Gemma 3's local rotary base (10000, or `rope.freq_base_swa`) and the query scale
    (head_dim, except hidden / heads for the 27B models: 46 layers for Gemma 2, 62 for 3)."""
    hidden = int(get("embedding_length", required=True))
    num_heads = int(get("attention.head_count", required=True))
    layers = int(get("block_count", required=True))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    pattern = get("attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, (int, float)):
        swa = [bool(x) for x in pattern]
        if len(swa) != layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern has {len(swa)} entries "
                             f"for {layers} layers")
    else:
        period = int(pattern) if pattern else (2 if arch == "gemma2" else 6)
        swa = [(i + 1) % period != 0 for i in range(layers)]
    window = get("attention.sliding_window")
    if window is None and any(swa):
        raise ValueError(f"GGUF metadata lacks {arch}.attention.sliding_window")
    big = layers == (46 if arch == "gemma2" else 62)
    soft = get("attn_logit_softcapping")
    final = get("final_logit_softcapping")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0 if arch == "gemma2" else 1000000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 8192)),
        tie_word_embeddings=not has_output_tensor,
        qk_norm=arch == "gemma3",
        sliding_window=int(window) if any(swa) else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        layer_types=tuple(SLIDING if s else FULL for s in swa),
        norm_offset=1.0,
        post_norms=True,
        embed_scale=True,
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(hidden // num_heads if big else head_dim),
        attn_logit_softcap=float(soft) if soft else None,
        final_logit_softcap=float(final) if final else None,
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    )


def _check_phi3(cfg: Mapping[str, Any]) -> None:
    """Phi-3's config keys that jserve's layer does not implement, named."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported phi3 hidden_act {cfg.get('hidden_act')!r} (supported: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"unsupported phi3 variant: {key}")


def _phi3_from_gguf(get, head_dim: int, rope_factors) -> dict[str, Any]:
    """What llama.cpp's converter writes for Phi-3 beyond the Llama keys: rope.dimension_count
    (partial rotary), the LongRoPE factors as two tensors with rope.scaling.original_context_length
    and rope.scaling.attn_factor (the sliding window is 0 where the model has none, as Phi-4's)."""
    rope_dim = int(get("rope.dimension_count", head_dim))
    scaling = None
    if rope_factors is not None:
        long, short = (tuple(float(x) for x in f) for f in rope_factors)
        orig = get("rope.scaling.original_context_length")
        if orig is None:
            raise ValueError("GGUF phi3 with LongRoPE factors lacks phi3.rope.scaling.original_context_length")
        ctx = int(get("context_length", orig))
        attn = get("rope.scaling.attn_factor")
        scaling = RopeScaling("longrope", factor=ctx / int(orig), original_max_position_embeddings=int(orig),
                              short_factor=short, long_factor=long,
                              attention_factor=float(attn) if attn is not None else _longrope_attention(
                                  ctx / int(orig), int(orig)))
    return dict(rope_scaling=scaling, rotary_dim=rope_dim if rope_dim != head_dim else None)


def _longrope_attention(factor: float, original: int) -> float:
    """LongRoPE's default attention factor (transformers' and llama.cpp's): sqrt(1 + ln(s) / ln(original))."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _rope_scaling_from_dict(d: Mapping[str, Any] | None, cfg: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """A config's rope_scaling (transformers 4) / rope_parameters (5) as a RopeScaling; `cfg` the
    whole config (LongRoPE reads its max_position_embeddings and original_max_position_embeddings,
    Phi-3's top-level keys, which transformers prefers to the rope dict's)."""
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):  # "su": Phi-3's first name for it
        cfg = cfg or {}
        if "short_factor" not in d or "long_factor" not in d:
            raise ValueError("longrope rope_scaling needs short_factor and long_factor")
        for key in ("short_mscale", "long_mscale"):
            if d.get(key) is not None:
                raise ValueError(f"unsupported longrope key {key!r} (transformers does not read it either)")
        orig = cfg.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") \
            or cfg.get("max_position_embeddings")
        if not orig:
            raise ValueError("longrope rope_scaling needs original_max_position_embeddings")
        orig = int(orig)
        factor = d.get("factor") or int(cfg.get("max_position_embeddings", orig)) / orig
        attention = d.get("attention_factor")
        return RopeScaling("longrope", factor=float(factor), original_max_position_embeddings=orig,
                           short_factor=tuple(d["short_factor"]), long_factor=tuple(d["long_factor"]),
                           attention_factor=float(attention) if attention is not None
                           else _longrope_attention(float(factor), orig))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(d["factor"]),
                           low_freq_factor=float(d.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(d.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", factor=float(d["factor"]))
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)}, su)")
