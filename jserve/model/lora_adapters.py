"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) read into jserve's layout.

`load_adapter(source, config)` gives a `LoraAdapter`: per target weight of the decoder layer
(`LORA_TARGETS`, the names of `jserve.model.config.LAYER_MATMULS`), `A` [num_layers, in, rank] and
`B` [num_layers, rank, out] in float32 with PEFT's scaling (alpha / r, alpha / sqrt(r) with rsLoRA,
per module through `rank_pattern` / `alpha_pattern`) folded into B, so that the layer's
`x @ w[l] + (x @ A[l]) @ B[l]` is PEFT's `base(x) + lora_B(lora_A(x)) * scaling`. Layers and rank
columns an adapter does not touch are zeros. Phi-3's fused `qkv_proj` / `gate_up_proj` split B's
output rows as `jserve.model.sources` splits the base weights, each part keeping the shared A.
A source is a folder or a Hub id (`jserve.model.hub`); every refusal is a one-line `LoraError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jserve.model.config import LAYER_MATMULS, ModelConfig
from jserve.model.hub import HubError, parse_hub_id

__all__ = ["LORA_TARGETS", "LoraAdapter", "LoraError", "load_adapter", "target_shapes", "write_random_adapter"]

LORA_TARGETS = LAYER_MATMULS
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_ATTENTION = ("wq", "wk", "wv", "wo")
# HF module (after "model.layers.{i}.") -> the targets it feeds, in order along its output axis.
_MODULES = {
    "self_attn.q_proj": ("wq",), "self_attn.k_proj": ("wk",), "self_attn.v_proj": ("wv",),
    "self_attn.o_proj": ("wo",), "mlp.gate_proj": ("w_gate",), "mlp.up_proj": ("w_up",),
    "mlp.down_proj": ("w_down",), "self_attn.qkv_proj": ("wq", "wk", "wv"), "mlp.gate_up_proj": ("w_gate", "w_up"),
}
# A LoRA tensor's name as PEFT saves it: the module's path in the causal LM (Gemma 3's multimodal
# one holds the decoder under language_model), then lora_A / lora_B.
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>(?:model\.)?(?:language_model\.)?(?:model\.)?"
                  r"layers\.(?P<layer>\d+)\.(?P<rest>.+))\.lora_(?P<ab>[AB])\.weight")
# Options that change what the adapter computes, beyond x @ A.T @ B.T * scaling.
_UNSUPPORTED = ("use_dora", "lora_bias", "use_qalora", "alora_invocation_tokens", "trainable_token_indices",
                "layer_replication", "target_parameters", "arrow_config", "use_bdlora", "velora_config",
                "monteclora_config", "kasa_config")


class LoraError(ValueError):
    """An adapter jserve cannot read or apply; the message names the bad value."""


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter in jserve's layout (see the module docstring)."""

    name: str
    path: str  # the folder read (a Hub snapshot's folder for a Hub id)
    rank: int  # the largest rank over its modules
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L, in, rank], B [L, rank, out])


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target weight of a layer; a mixture of experts' layers have attention ones only."""
    d, q, kv, f = (config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                   config.intermediate_size)
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
    if not config.moe:
        shapes.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return shapes


def load_adapter(source: str | os.PathLike, config: ModelConfig, *, name: str | None = None,
                 max_rank: int | None = None, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None) -> LoraAdapter:
    """Read the PEFT LoRA adapter at `source` (a folder, or a Hub id) for a model of `config`;
    LoraError (HubError for a failed download) naming what does not fit."""
    folder = _resolve(source, revision, download_dir)
    cfg = _read_config(folder)
    modules = _read_modules(folder / WEIGHTS_FILE)
    layers = cfg.get("layers_to_transform")
    layers = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
    shapes = target_shapes(config)
    rank = max(a.shape[0] for a, _ in modules.values())
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"adapter {str(source)!r} has rank {rank}, above max_rank {max_rank}")
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    filled: set[tuple[str, int]] = set()
    for module, (a, b) in sorted(modules.items()):
        targets, layer = _place(module, config, layers)
        scale = _scaling(cfg, module, a.shape[0])
        widths = [shapes[t][1] for t in targets]
        _check_shape(f"{module}.lora_A.weight", a.shape, (a.shape[0], shapes[targets[0]][0]))
        _check_shape(f"{module}.lora_B.weight", b.shape, (sum(widths), a.shape[0]))
        for t, lo, hi in zip(targets, np.cumsum([0, *widths[:-1]]), np.cumsum(widths)):
            if (t, layer) in filled:
                raise LoraError(f"adapter sets {t} of layer {layer} twice (again at {module!r})")
            filled.add((t, layer))
            if t not in weights:
                weights[t] = (np.zeros((config.num_layers, shapes[t][0], rank), np.float32),
                              np.zeros((config.num_layers, rank, shapes[t][1]), np.float32))
            weights[t][0][layer, :, :a.shape[0]] = a.T
            weights[t][1][layer, :a.shape[0]] = b[lo:hi].T * np.float32(scale)
    return LoraAdapter(name=name or _default_name(source), path=str(folder), rank=rank, weights=weights)


def _check_shape(tensor: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise LoraError(f"adapter tensor {tensor!r} has shape {list(shape)}, expected {list(want)} for the base model")


def _resolve(source: str | os.PathLike, revision: str | None, download_dir: str | os.PathLike | None) -> Path:
    """The local folder of `source`: itself, or a Hub repo's snapshot of the adapter's two files."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoraError(f"LoRA adapter {str(source)!r} is a file: give its folder ({CONFIG_FILE} + {WEIGHTS_FILE})")
        return path
    hub_model = parse_hub_id(source)
    if hub_model is None or hub_model.gguf_file is not None:
        raise LoraError(f"LoRA adapter {str(source)!r} is neither a folder nor a Hugging Face Hub id (org/name)")
    from jserve.model.hub import _snapshot

    folder = _snapshot(hub_model, revision, download_dir, [CONFIG_FILE, WEIGHTS_FILE])
    if not (folder / CONFIG_FILE).is_file():
        raise HubError(f"{hub_model.repo_id} has no {CONFIG_FILE}: it is not a PEFT adapter")
    return folder


def _read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json, refused where it asks for anything beyond a plain LoRA on linears."""
    if not (folder / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter folder {str(folder)!r} has no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraError(f"LoRA adapter {str(folder)!r} has only adapter_model.bin, a pickle jserve does not "
                            f"load: convert it to {WEIGHTS_FILE} (PEFT save_pretrained(safe_serialization=True))")
        raise LoraError(f"LoRA adapter folder {str(folder)!r} has no {WEIGHTS_FILE} (an adapter_model.bin "
                        f"pickle is not read: convert it to safetensors)")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot read {folder / CONFIG_FILE}: {e}") from None
    where = f"{folder / CONFIG_FILE}"
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{where}: modules_to_save {cfg['modules_to_save']!r} (whole modules the adapter "
                        f"replaces) is not supported; only LoRA on the layers' linears is")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise LoraError(f"{where}: {key} = {cfg[key]!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise LoraError(f"{where}: {key} must be a positive number, got {cfg.get(key)!r}")
    return cfg


def _read_modules(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module path -> (lora_A [r, in], lora_B [out, r]) as float32; LoraError for any other tensor."""
    from safetensors import safe_open

    parts: dict[str, dict[str, np.ndarray]] = {}
    with safe_open(str(path), framework="numpy") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None:
                module = re.sub(r"\.(lora_\w+|weight|bias)(\.\w+)*$", "", key.removeprefix("base_model.model."))
                raise LoraError(f"adapter tensor {key!r} targets {module!r}, which jserve cannot apply (LoRA "
                                f"applies to the decoder layers' q/k/v/o and gate/up/down projections only)")
            array = np.asarray(f.get_tensor(key))
            if array.ndim != 2:
                raise LoraError(f"adapter tensor {key!r} has shape {list(array.shape)}, expected a matrix")
            parts.setdefault(m["module"], {})[m["ab"]] = array.astype(np.float32)
    if not parts:
        raise LoraError(f"{path} holds no LoRA tensors")
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter has {module}.lora_{''.join(ab)} without its lora_{'B' if 'A' in ab else 'A'}")
        if ab["A"].shape[0] != ab["B"].shape[1]:
            raise LoraError(f"adapter tensors {module}.lora_A {list(ab['A'].shape)} and lora_B "
                            f"{list(ab['B'].shape)} disagree on the rank")
    return {module: (ab["A"], ab["B"]) for module, ab in parts.items()}


def _place(module: str, config: ModelConfig, layers: set[int] | None) -> tuple[tuple[str, ...], int]:
    """(targets, layer) of a module path; LoraError for one past the model or outside layers_to_transform."""
    m = re.search(r"layers\.(\d+)\.(.+)$", module)
    layer, rest = int(m[1]), m[2]
    targets = _MODULES.get(rest)
    if targets is None or (config.moe and not set(targets) <= set(_ATTENTION)):
        what = "experts' and routers' MLPs" if config.moe and rest.startswith(("mlp.", "block_sparse_moe.")) else \
            "this module"
        raise LoraError(f"adapter targets {module!r}: jserve cannot apply LoRA to {what} of a "
                        f"{config.architecture} model")
    if layer >= config.num_layers:
        raise LoraError(f"adapter targets {module!r}, layer {layer}, but the model has {config.num_layers} layers")
    if layers is not None and layer not in layers:
        raise LoraError(f"adapter targets {module!r}, a layer outside its layers_to_transform {sorted(layers)}")
    return targets, layer


def _scaling(cfg: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of `module`: its alpha over its rank (sqrt of it with rsLoRA), the rank and
    alpha taken from rank_pattern / alpha_pattern where a key matches the module's path, as PEFT does."""
    r = _pattern(cfg.get("rank_pattern"), module, cfg["r"])
    alpha = _pattern(cfg.get("alpha_pattern"), module, cfg["lora_alpha"])
    if r != rank:
        raise LoraError(f"adapter tensors of {module!r} have rank {rank} but adapter_config.json gives it r = {r}")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _pattern(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first key that matches the end of the module's path (at a dot)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _default_name(source: str | os.PathLike) -> str:
    path = Path(source)
    return path.name if path.exists() else str(source)


def write_random_adapter(folder: str | os.PathLike, config: ModelConfig, rank: int, seed: int = 0, *,
                         modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"), scale: float = 0.05) -> str:
    """A PEFT LoRA adapter of random A and B ~ N(0, scale) on `modules` of every layer of a model
    of `config` (alpha = 2 * rank), saved as PEFT saves one: for benchmarks and tests, as
    `--load-format dummy` is for a model. Returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none",
        "use_rslora": False, "task_type": "CAUSAL_LM"}))
    rng = np.random.default_rng(seed)
    paths = {path.rsplit(".", 1)[-1]: (path, targets[0]) for path, targets in _MODULES.items() if len(targets) == 1}
    shapes = target_shapes(config)
    tensors = {}
    for i in range(config.num_layers):
        for module in modules:
            path, target = paths[module]
            n_in, n_out = shapes[target]
            key = f"base_model.model.model.layers.{i}.{path}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, scale, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, scale, (n_out, rank)).astype(np.float32)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return str(folder)
