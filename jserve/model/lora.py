"""LoRA adapters inside the model: fixed-shape slots per layer and target, selected per token.

Every target linear of a layer (`LORA_TARGETS`) gets two slot stacks in the params, beside its base
weight: `lora_a_<target>` [in, max_loras, rank] and `lora_b_<target>` [max_loras, rank, out]
(a stacked layout adds the leading layer axis). Slot s (1 .. max_loras) holds one adapter, its
scaling folded into B and its rank padded with zeros; id 0 is the base model. A step gives each
token its slot id, and a target's output gains `mask(x @ A_all) @ B_all`: one matmul into every
slot's rank columns at once, the columns of other slots zeroed, one matmul out. The compiled
shapes never depend on which adapters a step mixes, and any backend's base linear (packed,
quantized) is untouched. The cost per token is max_loras * rank * (in + out) multiply-adds per
target, whatever the mix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig
from jserve.model.lora_adapters import LORA_TARGETS, target_shapes

__all__ = ["LORA_TARGETS", "LoraSpec", "add_slots", "apply", "carry_slots", "slot_arrays", "slot_shapes",
           "strip_slots", "target_shapes"]


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The slots a model holds: `max_loras` adapters resident at once, each of rank at most
    `max_rank`, over `targets` (a mixture-of-experts model: its attention's only)."""

    max_loras: int = 1
    max_rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_rank}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"unknown LoRA targets {sorted(unknown)}; known: {LORA_TARGETS}")

    @classmethod
    def for_model(cls, config: ModelConfig, max_loras: int, max_rank: int) -> "LoraSpec":
        """The slots for `config`: every dense linear, or the attention's of a MoE model."""
        targets = LORA_TARGETS[:4] if config.moe else LORA_TARGETS
        return cls(max_loras, max_rank, targets)


def slot_shapes(config: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """One layer's slot stacks by param name: `lora_a_<t>` [in, S, r], `lora_b_<t>` [S, r, out]."""
    shapes = target_shapes(config)
    out = {}
    for t in spec.targets:
        n_in, n_out = shapes[t]
        out[f"lora_a_{t}"] = (n_in, spec.max_loras, spec.max_rank)
        out[f"lora_b_{t}"] = (spec.max_loras, spec.max_rank, n_out)
    return out


def add_slots(params: dict[str, Any], config: ModelConfig, spec: LoraSpec, dtype: Any,
              put=lambda x: x) -> dict[str, Any]:
    """A model state (`model_params`' result, either layout) with empty slots in every layer;
    `put` places each zero array (on the params' device or mesh)."""
    shapes = slot_shapes(config, spec)
    layers = params["layers"]
    if 0 in layers:  # one dict per layer
        new = {i: {**layer, **{k: put(np.zeros(s, dtype)) for k, s in shapes.items()}} for i, layer in layers.items()}
    else:
        new = {**layers, **{k: put(np.zeros((config.num_layers, *s), dtype)) for k, s in shapes.items()}}
    return {**params, "layers": new}


def strip_slots(tree: dict[str, Any]) -> dict[str, Any]:
    """A model state without its LoRA slots (what a checkpoint holds)."""
    layers = tree["layers"]
    if 0 in layers:
        new = {i: {k: v for k, v in layer.items() if not k.startswith("lora_")} for i, layer in layers.items()}
    else:
        new = {k: v for k, v in layers.items() if not k.startswith("lora_")}
    return {**tree, "layers": new}


def apply(layer: Any, targets: tuple[str, ...], x: jax.Array, outs: tuple[jax.Array, ...],
          ids: jax.Array) -> tuple[jax.Array, ...]:
    """`outs` (the base linears `targets` of `layer` over x [B, T, in]) plus each token's adapter
    delta; `ids` int32 [B, T], the tokens' slots (0: none). A target without slots stays as it is."""
    select = None  # [B, T, S]: 1 where the token's slot is s + 1
    result = []
    for t, out in zip(targets, outs):
        a_var = getattr(layer, f"lora_a_{t}", None)
        if a_var is None:
            result.append(out)
            continue
        a, b = a_var[...], getattr(layer, f"lora_b_{t}")[...]
        n_in, S, r = a.shape
        if select is None:
            select = (ids[..., None] == jnp.arange(1, S + 1, dtype=ids.dtype)).astype(x.dtype)
        xa = (x @ a.reshape(n_in, S * r)).reshape(*x.shape[:-1], S, r) * select[..., None]
        delta = xa.reshape(*x.shape[:-1], S * r) @ b.reshape(S * r, -1)
        result.append(out + delta.astype(out.dtype))
    return tuple(result)


def slot_arrays(weights: dict[str, tuple[np.ndarray, np.ndarray]], config: ModelConfig,
                spec: LoraSpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """An adapter's (A [L, in, r], B [L, r, out]) per target padded to the slots' rank:
    (A [L, in, max_rank], B [L, max_rank, out]), zeros for a target it lacks. ValueError naming a
    target the slots do not hold, or a rank or shape that does not fit."""
    shapes = target_shapes(config)
    unknown = sorted(set(weights) - set(spec.targets))
    if unknown:
        raise ValueError(f"the adapter targets {unknown}, which this model's LoRA slots do not hold "
                         f"(targets: {list(spec.targets)})")
    L, R = config.num_layers, spec.max_rank
    out = {}
    for t in spec.targets:
        n_in, n_out = shapes[t]
        pa, pb = np.zeros((L, n_in, R), np.float32), np.zeros((L, R, n_out), np.float32)
        if t in weights:
            a, b = weights[t]
            r = a.shape[-1]
            if r > R:
                raise ValueError(f"the adapter's rank {r} ({t}) exceeds max_lora_rank {R}")
            if a.shape != (L, n_in, r) or b.shape != (L, r, n_out):
                raise ValueError(f"the adapter's {t} matrices are {a.shape} and {b.shape}; this model "
                                 f"needs {(L, n_in, r)} and {(L, r, n_out)}")
            pa[..., :r], pb[:, :r] = a, b
        out[t] = (pa, pb)
    return out


def carry_slots(new: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """New base weights (`new`, without slots) with the served params' LoRA slots: what a weight
    update swaps in (the adapters stay loaded)."""
    layers, slots = new["layers"], served["layers"]
    if 0 in slots:
        merged = {i: {**layers[i], **{k: v for k, v in slots[i].items() if k.startswith("lora_")}} for i in layers}
    else:
        merged = {**layers, **{k: v for k, v in slots.items() if k.startswith("lora_")}}
    return {**new, "layers": merged}
