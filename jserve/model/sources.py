"""Reading a Hugging Face safetensors folder or a GGUF file into checkpoint-layout params.

`read_params(source)` gives (ModelConfig, {name: array}): our weight names, per-layer weights
stacked on a leading layer axis, linears as [in, out]. HF and GGUF names map through one table (a
mixture of experts' tensors through `jserve.model.sources_moe`); `read_params`'s docstring says
what is converted on the way (llama.cpp's rotary permutation, Gemma's norm weights, Phi-3's fused
weights, LongRoPE's factors). Float tensors come as numpy
arrays in the requested dtype; pre-quantized ones as `QuantizedWeight`s repacked by
`jserve.model.quant_import` / `quant_hf`, never through a float copy. See docs/architecture.md,
"The model" and "Quantization".
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jserve.model import quant
from jserve.model.config import GEMMA_FAMILIES, MOE_FAMILIES, ModelConfig
from jserve.model.llama import param_shapes
from jserve.model.sources_moe import GGUF_MOE_LAYER, HF_MOE_LAYER, place_expert

logger = logging.getLogger(__name__)

# Per-layer HF names (after "model.layers.{i}.") -> (our name, transpose?).
_HF_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
}
# Gemma 2 / 3 name their norms otherwise: HF's post_attention_layernorm is the attention output's
# norm there (Llama's pre-MLP norm), pre_feedforward_layernorm the pre-MLP one.
_HF_LAYER_GEMMA = {
    **_HF_LAYER,
    "post_attention_layernorm.weight": ("attn_post_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("mlp_post_norm", False),
}
# A Gemma 3 multimodal checkpoint's language model (transformers 4.5x, 5.x) and its other parts.
_HF_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                     "language_model.lm_head.": "lm_head."}
_HF_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_GLOBAL_NAMES = ("embed", "final_norm", "lm_head")
_HF_BARE = ("layers.", "embed_tokens.", "norm.")
_HF_GLOBAL = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("final_norm", False),
              "lm_head.weight": ("lm_head", True)}
# GGUF per-layer names (after "blk.{i}.") -> the HF name, so both paths share one table.
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_GEMMA = {
    **_GGUF_LAYER,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# Phi-3: HF's fused per-layer weights (after "model.layers.{i}.", [out, in]) -> our weights, in
# their order along the output axis, with each one's width (a function of the config).
_HF_FUSED = {
    "self_attn.qkv_proj.weight": (("wq", lambda c: c.num_heads * c.head_dim),
                                  ("wk", lambda c: c.num_kv_heads * c.head_dim),
                                  ("wv", lambda c: c.num_kv_heads * c.head_dim)),
    "mlp.gate_up_proj.weight": (("w_gate", lambda c: c.intermediate_size), ("w_up", lambda c: c.intermediate_size)),
}
# llama.cpp's phi3 names: attn_qkv is qkv_proj, and ffn_up holds gate_up_proj (gate first, as
# ggml's swiglu splits it); LongRoPE's factors are two global tensors, read into the config.
_GGUF_LAYER_PHI3 = {**_GGUF_LAYER, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                    "ffn_up.weight": "mlp.gate_up_proj.weight"}
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")

def numpy_dtype(name: str):
    if name == "float32":
        return np.dtype(np.float32)
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unsupported dtype {name!r} (choose float32 or bfloat16)")


def read_params(source: str | os.PathLike, *, dtype: str = "float32", progress: bool = False,
                keep_quantized: bool = False):
    """Read a GGUF file or a Hugging Face folder into (ModelConfig, {name: numpy array}); with
    `keep_quantized`, a GGUF's quantized matrices come as `QuantizedWeight`s, repacked without
    a float copy (`jserve.model.quant_import.from_gguf`).

    HF and GGUF names map through one table (GGUF names to HF names, HF names to ours, with Gemma's
    own names for its four norms); llama.cpp's Q/K rotary permutation is undone, and the 1 its
    converter adds to Gemma's norm weights is taken off again (the model keeps Hugging Face's
    convention: `ModelConfig.norm_offset`). Phi-3's fused `qkv_proj` (q, k, v on the output axis) and
    `gate_up_proj` (gate, up), llama.cpp's `attn_qkv` and phi3 `ffn_up`, are split into the layer's
    own wq / wk / wv and w_gate / w_up (quantized ones along their output channels, bit for bit), so
    the layer, its sharding (heads split over tp) and the fused native kernels stay the Llama
    layer's; LongRoPE's factors, GGUF tensors there, go to the config.
    """
    src = Path(source)
    if src.is_file() and src.suffix == ".gguf":
        config, tensors, count, _ = read_gguf(src, keep_quantized=keep_quantized)
    elif src.is_dir() and (src / "config.json").is_file():
        config, tensors, count = _read_hf(src)
    else:
        raise ValueError(f"cannot read {str(src)!r}: expected a .gguf file or a folder with "
                         f"config.json and *.safetensors")
    params = _assemble(config, tensors, count, numpy_dtype(dtype), progress=progress,
                       desc=f"reading {src.name}")
    return config, params


def _assemble(config: ModelConfig, tensors: Iterable[tuple[str, Callable[[], Any]]], count: int,
              dtype: np.dtype, *, progress: bool, desc: str) -> dict[str, Any]:
    """Place HF-named tensors into our stacked layout, validating every shape. A loader may give
    a `QuantizedWeight` (already [in, out]); a weight kind whose layers all come quantized in one
    format is stacked as one, a kind that mixes formats is dequantized (logged)."""
    from tqdm import tqdm

    shapes = param_shapes(config)
    params = {name: np.empty(shape, dtype) for name, shape in shapes.items()}
    filled: dict[str, set] = {name: set() for name in shapes}
    quantized: dict[str, dict[int | None, quant.QuantizedWeight]] = {}
    experts_filled: dict[tuple[str, int], set[int]] = {}  # (expert weight, layer) -> experts read
    for entry in tqdm(_entries(config, tensors), total=count, desc=desc, unit="tensor", disable=not progress):
        hf_name, load = entry[:2]
        if config.moe and place_expert(config, hf_name, load, params, experts_filled):
            continue
        target = _destination(config, entry, params)
        if target is None:
            continue
        name, layer, transpose = target
        array = load()
        if quant.is_quantized(array):
            want = tuple(shapes[name] if layer is None else shapes[name][1:])
            if name == "embed":  # a quantized embedding is held as its transpose (quant.embed_rows)
                want = want[::-1]
            if array.shape != want:
                raise ValueError(f"tensor {hf_name!r} has shape {array.shape} (as [in, out]), expected {want}")
            quantized.setdefault(name, {})[layer] = array
            filled[name].add(layer)
            continue
        if transpose:
            array = array.T
        target = params[name] if layer is None else params[name][layer]
        if array.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {array.shape}, expected {target.shape}")
        target[...] = array.astype(dtype)
        filled[name].add(layer)
    for (name, layer), got in experts_filled.items():
        if got == set(range(config.num_experts)):
            filled[name].add(layer)
    for name, got in filled.items():
        want = {None} if name in _GLOBAL_NAMES else set(range(config.num_layers))
        if got != want:
            missing = sorted(want - got, key=str)
            raise ValueError(f"checkpoint is missing weight {name!r}" + (
                f" for layers {missing}" if None not in want else ""))
    _stack_quantized(config, params, quantized, dtype)
    return params


def _entries(config: ModelConfig, tensors: Iterable[tuple[str, Callable[[], Any]]]):
    """(HF name, loader) of each weight the tensors hold; a fused one's parts as (HF name (part),
    loader, our name), split once however many parts are read."""
    for hf_name, load in tensors:
        parts = hf_name.split(".", 3)
        fused = _HF_FUSED.get(parts[3]) if len(parts) == 4 and parts[:2] == ["model", "layers"] else None
        if fused is None:
            yield hf_name, load
            continue
        widths = [width(config) for _, width in fused]
        split = _cached(lambda load=load, widths=widths, hf_name=hf_name: _split_outputs(load(), widths, hf_name))
        for j, (name, _) in enumerate(fused):
            yield f"{hf_name} ({name})", (lambda j=j, split=split: split()[j]), name


def _destination(config: ModelConfig, entry: tuple, params: Mapping[str, Any]) -> tuple[str, int | None, bool] | None:
    """(our name, layer or None, transpose?) of an entry, None for a tensor jserve skips;
    ValueError for one it does not know or a layer past the model's."""
    hf_name = entry[0]
    if len(entry) == 3:  # a part of a fused tensor (already [in, out] when quantized)
        name, layer, transpose = entry[2], int(hf_name.split(".")[2]), True
    else:
        name, layer, transpose = _map_hf_name(hf_name, config.architecture)
    if name is None or name not in params:
        if name == "lm_head" and config.tie_word_embeddings:
            return None  # tied models sometimes store a copy of the embedding
        if config.architecture == "gemma3" and hf_name.startswith(_HF_NOT_TEXT):
            return None  # a multimodal checkpoint's vision tower: the text model alone is served
        if name is None and (hf_name.endswith("rotary_emb.inv_freq") or "rope_freqs" in hf_name):
            return None
        raise ValueError(f"unexpected tensor {hf_name!r} for a {config.architecture} model")
    if layer is not None and layer >= config.num_layers:
        raise ValueError(f"tensor {hf_name!r} names layer {layer} but the model has {config.num_layers} layers")
    return name, layer, transpose


def _stack_quantized(config: ModelConfig, params: dict[str, Any],
                     quantized: Mapping[str, Mapping[int | None, quant.QuantizedWeight]], dtype: np.dtype) -> None:
    """Put the quantized weights read into `params`: a kind whose layers share one format stacked,
    one that mixes formats dequantized into its float array (logged)."""
    if quantized:
        from jserve.model import quant_import
    for name, parts in quantized.items():
        if None in parts:
            params[name] = parts[None]
            continue
        formats = {(w.scheme, w.group_size, w.symmetric, w.scales.dtype) for w in parts.values()}
        if len(parts) == config.num_layers and len(formats) == 1:
            params[name] = quant_import.stack_layers([parts[i] for i in range(config.num_layers)])
            continue
        logger.warning("%s mixes quantized formats over its layers (%s): read as %s floats", name,
                       ", ".join(sorted(map(str, formats))), np.dtype(dtype).name)
        for i, w in parts.items():
            params[name][i] = quant.dequantize(w).astype(dtype)


def _cached(load: Callable[[], Any]) -> Callable[[], Any]:
    """`load`, run once however often the result is asked for."""
    box: list[Any] = []

    def get():
        if not box:
            box.append(load())
        return box[0]
    return get


def _split_outputs(array: Any, widths: Sequence[int], hf_name: str) -> list[Any]:
    """A fused weight split along its output axis into `widths`: a float [out, in] (HF's layout)
    along its rows, a `QuantizedWeight` ([in, out]) along its output channels."""
    out = array.shape[-1] if quant.is_quantized(array) else array.shape[0]
    if out != sum(widths):
        raise ValueError(f"tensor {hf_name!r} has {out} output channels, expected {' + '.join(map(str, widths))}")
    bounds = np.cumsum([0, *widths])
    if quant.is_quantized(array):
        def cols(a, lo, hi):
            return None if a is None else np.asarray(a)[..., lo:hi]
        return [quant.QuantizedWeight(cols(array.values, lo, hi), cols(array.scales, lo, hi),
                                      cols(array.offsets, lo, hi), array.scheme, array.group_size)
                for lo, hi in zip(bounds[:-1], bounds[1:])]
    return [array[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _map_hf_name(hf_name: str, family: str = "llama") -> tuple[str | None, int | None, bool]:
    gemma = family in GEMMA_FAMILIES
    if hf_name.startswith(_HF_BARE):  # saved from the bare decoder (`Qwen3Model`: Qwen3-Embedding)
        hf_name = "model." + hf_name
    if gemma:
        for prefix, to in _HF_TEXT_PREFIXES.items():
            if hf_name.startswith(prefix):
                hf_name = to + hf_name[len(prefix):]
                break
    if hf_name in _HF_GLOBAL:
        name, t = _HF_GLOBAL[hf_name]
        return name, None, t
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        entry = (_HF_LAYER_GEMMA if gemma else _HF_LAYER).get(parts[3])
        if entry is None and family in MOE_FAMILIES:
            entry = HF_MOE_LAYER.get(parts[3].replace("block_sparse_moe.", "mlp.", 1))
        if entry:
            return entry[0], int(parts[2]), entry[1]
    return None, None, False


def _read_hf(folder: Path):
    """(config, [(HF name, loader)], count). An AWQ or GPTQ folder (`quantization_config` in
    config.json) gives each quantized linear as one entry, `<module>.weight`, whose loader repacks
    its qweight / qzeros / scales (/ g_idx) into a `QuantizedWeight` (`quant_import`)."""
    from safetensors import safe_open

    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    handles = [safe_open(str(f), framework="numpy") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    spec = None
    if "quantization_config" in hf_config:
        from jserve.model import quant_hf

        spec = quant_hf.quantization_spec_from_hf(hf_config)
    entries = []
    for name, h in where.items():
        if spec is not None and name.endswith((".qzeros", ".scales", ".g_idx")) and \
                name.rsplit(".", 1)[0] + ".qweight" in where:
            continue  # read with their module's qweight
        if spec is not None and name.endswith(".qweight"):
            module = name[:-len(".qweight")]
            entries.append((module + ".weight", (lambda m=module: _hf_quantized(where, m, spec))))
        else:
            entries.append((name, (lambda h=h, n=name: _to_numpy(h, n))))
    return config, entries, len(entries)


def _hf_quantized(where: Mapping[str, Any], module: str, spec: Mapping[str, Any]) -> quant.QuantizedWeight:
    """One AWQ / GPTQ linear (`module`'s qweight, qzeros, scales, g_idx) as a QuantizedWeight [in, out]."""
    from jserve.model import quant_hf

    def get(suffix):
        name = f"{module}.{suffix}"
        if name not in where:
            raise ValueError(f"{spec['quant_method']} checkpoint is missing {name!r}")
        return np.asarray(where[name].get_tensor(name))

    if spec["quant_method"] == "awq":
        return quant_hf.from_awq(get("qweight"), get("qzeros"), get("scales"), spec["group_size"], spec["bits"])
    g_idx = get("g_idx") if f"{module}.g_idx" in where else None
    return quant_hf.from_gptq(get("qweight"), get("qzeros"), get("scales"), g_idx, bits=spec["bits"],
                                  group_size=spec["group_size"], sym=spec["sym"],
                                  checkpoint_format=spec["checkpoint_format"])


def _to_numpy(handle, name: str) -> np.ndarray:
    return np.asarray(handle.get_tensor(name)).astype(np.float32)


def read_gguf(path: Path, keep_quantized: bool = False):
    import gguf

    if keep_quantized:
        from jserve.model import quant_import

    from jserve.model.gguf_file import GGUFFile

    reader = GGUFFile(path)  # gguf.GGUFReader's tensors, without its seconds per large vocabulary
    # the tokenizer reads its own (large) arrays
    meta = {key: value for key, value in reader.meta.items() if not key.startswith("tokenizer.ggml.")
            or key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")}
    meta["tokenizer.ggml.tokens"] = range(len(reader.meta.get("tokenizer.ggml.tokens", ())))
    names = {t.name for t in reader.tensors}
    factors = {t.name: t for t in reader.tensors if t.name in _GGUF_ROPE_FACTORS}
    rope_factors = None
    if factors:
        if len(factors) != 2:
            raise ValueError(f"GGUF has {sorted(factors)} but LongRoPE needs both of {list(_GGUF_ROPE_FACTORS)}")
        rope_factors = tuple(gguf.quants.dequantize(factors[n].data, factors[n].tensor_type).reshape(-1).tolist()
                             for n in _GGUF_ROPE_FACTORS)
    config = ModelConfig.from_gguf_metadata(meta, has_output_tensor="output.weight" in names,
                                            has_qkv_bias="blk.0.attn_q.bias" in names, rope_factors=rope_factors)
    # llama.cpp stores Q/K of "llama" models permuted for interleaved rotary pairs; undo it so
    # the rotate-half formulation applies (Qwen and Gemma GGUFs use NEOX rotary and are not permuted).
    permuted = meta["general.architecture"] in ("llama", "mistral")
    # llama.cpp's converter adds 1 to every Gemma "*norm.weight" (Gemma2Model / Gemma3Model
    # modify_tensors: llama.cpp's RMSNorm multiplies by the weight alone); the model keeps
    # Hugging Face's weights (`ModelConfig.norm_offset` 1), so it comes off here, in float32.
    gemma = config.architecture in GEMMA_FAMILIES

    def loader(tensor, hf_name):
        def load():
            if keep_quantized and tensor.tensor_type.name in quant_import.GGUF_TYPES and len(tensor.shape) == 2:
                w = quant_import.from_gguf(tensor.tensor_type, tensor.data, tuple(int(d) for d in tensor.shape))
                if permuted and ("q_proj" in hf_name or "k_proj" in hf_name):
                    heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                    order = unpermute_rotary(np.arange(w.shape[-1]), heads)
                    w = quant_import.permute_output_channels(w, order)
                return w
            a = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if gemma and tensor.name.endswith("norm.weight"):
                a = a - np.float32(1.0)
            if permuted and ("q_proj" in hf_name or "k_proj" in hf_name):
                heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                a = unpermute_rotary(a, heads)
            return a
        return load

    entries = []
    layer_names = _GGUF_LAYER_GEMMA if gemma else ({**_GGUF_LAYER, **GGUF_MOE_LAYER} if config.moe else _GGUF_LAYER)
    if config.architecture == "phi3":
        layer_names = _GGUF_LAYER_PHI3
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_FACTORS:
            continue  # in the config
        hf_name = _gguf_to_hf(t.name, layer_names)
        entries.append((hf_name, loader(t, hf_name)))
    return config, entries, len(entries), reader


def _gguf_to_hf(name: str, layer_names: Mapping[str, str] = _GGUF_LAYER) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return name  # unknown: _assemble reports it by its GGUF name


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs back to rotate-half order."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
