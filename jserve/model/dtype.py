"""The weights' dtype a model is served in (`--dtype`, `LLM(dtype=)`): one table, `resolve_dtype`.

jserve holds float weights as float32 or bfloat16. "auto" (the default) serves the checkpoint's own
dtype (a Hugging Face folder's `torch_dtype`, a GGUF's file type, a jserve checkpoint's source's),
except that a float32 source (or a quantized GGUF read as floats) is served as bfloat16 on a TPU or
GPU, float32 on a CPU. float16 is served as bfloat16 (the same memory). Whenever the served dtype is
not the one asked for or found, or is wider than the source's, a note says so.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["DTYPE_CHOICES", "check_dtype", "current_platform", "resolve_dtype", "source_dtype", "storage_dtype"]

DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "half", "float16")
_CANONICAL = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
              "half": "float16", "float16": "float16"}
_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
_ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")
# Hugging Face's torch_dtype spellings, safetensors' dtype codes and GGUF file types -> ours.
_NAMES = {"float32": "float32", "torch.float32": "float32", "float": "float32", "F32": "float32",
          "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16", "BF16": "bfloat16",
          "float16": "float16", "torch.float16": "float16", "half": "float16", "F16": "float16"}
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def check_dtype(requested: str | None) -> str:
    """The canonical name of a requested dtype ("auto" for None); ValueError naming a bad one."""
    if requested is None:
        return "auto"
    if requested not in _CANONICAL:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (or None: auto), got {requested!r}")
    return _CANONICAL[requested]


def current_platform() -> str:
    """JAX's default platform: "cpu", "tpu" or "gpu"."""
    import jax

    return jax.default_backend()


def resolve_dtype(requested: str | None, source: str | None, platform: str) -> tuple[str, str | None]:
    """(the dtype to serve: "float32" or "bfloat16", a one-line note to log or None).

    `source`: the checkpoint's float dtype ("float32", "bfloat16", "float16"; None where it has none
    of its own, as a quantized GGUF's, read like float32); `platform`: JAX's ("cpu", "tpu", "gpu")."""
    want = check_dtype(requested)
    accelerator = platform.lower() in _ACCELERATORS
    src = source or "float32"
    if want == "auto":
        if src == "float32":
            if not accelerator:
                return "float32", None
            what = "the float32 checkpoint is" if source else "the quantized checkpoint's weights are"
            return "bfloat16", (f"{what} served as bfloat16 on {platform} (--dtype float32 keeps float32, "
                                f"at twice the weights' memory)")
        want = src
    if want == "float16":
        why = ("jserve holds no float16 weights" if platform.lower() in ("gpu", "cuda", "rocm")
               else f"{platform} has no fast float16")
        asked = "float16 was asked for" if requested in ("half", "float16") else "the checkpoint is float16"
        return "bfloat16", f"{asked}: served as bfloat16 ({why}; the same memory)"
    note = None
    if source is not None and _WIDTH[want] > _WIDTH[source]:
        note = f"the {source} checkpoint is served as {want}: twice its weights' memory (--dtype auto keeps {source})"
    return want, note


def storage_dtype(requested: str | None, source: str | None, served: str) -> str:
    """The dtype a conversion writes into a folder not keyed by dtype (a later run may ask for
    another): the one asked for by name, else `served` where it loses nothing of the source,
    else float32 (the load casts to `served` while restoring)."""
    if check_dtype(requested) not in ("auto", "float16"):
        return served
    return served if served == (source or "float32") else "float32"


def source_dtype(source: str | Path) -> str | None:
    """The float dtype of a model's weights: a jserve checkpoint's source's (generation.json), a
    Hugging Face folder's (config.json's dtype / torch_dtype, else its first safetensors tensor's),
    a GGUF's file type (None for a quantized one); None where none is known."""
    p = Path(source)
    if p.is_file() and p.suffix == ".gguf":
        from jserve.text.tokenizer_gguf import read_gguf_kv

        file_type = read_gguf_kv(p)[0].get("general.file_type")
        return _GGUF_FILE_TYPES.get(int(file_type)) if file_type is not None else None
    if (p / "generation.json").is_file():
        generation = json.loads((p / "generation.json").read_text())
        if "source_dtype" in generation:  # (None: a quantized GGUF's)
            return generation["source_dtype"]
        return generation.get("dtype", "float32")  # converted before the source's was recorded
    if (p / "config.json").is_file():
        config = json.loads((p / "config.json").read_text())
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        named = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
        if named in _NAMES:
            return _NAMES[named]
        return _safetensors_dtype(p)
    return None


def _safetensors_dtype(folder: Path) -> str | None:
    """The dtype of the first float tensor in the folder's first safetensors file (its header alone)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    with open(files[0], "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    for name, entry in header.items():
        if name != "__metadata__" and entry.get("dtype") in _NAMES:
            return _NAMES[entry["dtype"]]
    return None
