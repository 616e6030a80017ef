"""LoRA adapters inside the model: fixed-shape slots per layer and target, selected per token.

Every target linear of a layer (`LORA_TARGETS`) gets slot stacks in the params, beside its base
weight: `lora_b_<target>` [max_loras, rank, out], and an A stack per group of targets that read the
same input (`GROUPS`: q/k/v, o, gate/up, down), `lora_a_<group>` [in, targets, max_loras, rank]
(a stacked layout adds the leading layer axis). Slot s (1 .. max_loras) holds one adapter, its
scaling folded into B and its rank padded with zeros; id 0 is the base model. A step gives each
token its slot id, and each target's output gains its slot's delta (`ModelOps.lora`); a step whose
tokens all run the base model skips it (`lax.cond`). The XLA form (`dense_delta`) is
`mask(x @ A_all) @ B_all`: one matmul into every slot's rank columns of the group's targets at
once, the columns of other slots zeroed, one matmul out per target, max_loras * rank * (in + out)
multiply-adds per token and target whatever the mix; the native CPU backend multiplies each token
by its own slot only (`pallas_kernels.native.lora`, and inside its fused decode layers). The
compiled shapes never depend on which adapters a step mixes, and any backend's base linear (packed,
quantized) is untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig
from jserve.model.lora_adapters import LORA_TARGETS, target_shapes

__all__ = ["GROUPS", "LORA_TARGETS", "LoraSpec", "add_slots", "apply", "carry_slots", "dense_delta", "slot_arrays",
           "slot_shapes", "strip_slots", "target_shapes"]

# The targets `DecoderLayer._linear` computes from one input, in its call order: one A stack each.
GROUPS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))


def group_name(targets: tuple[str, ...]) -> str:
    return "lora_a_" + "_".join(targets)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The slots a model holds: `max_loras` adapters resident at once, each of rank at most
    `max_rank`, over `targets` (a mixture-of-experts model: its attention's only), in `dtype` (a
    float dtype's name; None: the model's float weights')."""

    max_loras: int = 1
    max_rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS
    dtype: str | None = None

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_rank}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"unknown LoRA targets {sorted(unknown)}; known: {LORA_TARGETS}")
        split = [g for g in GROUPS if set(g) & set(self.targets) and not set(g) <= set(self.targets)]
        if split:
            raise ValueError(f"LoRA targets {split[0]} read one input and take slots together; got {self.targets}")

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return tuple(g for g in GROUPS if g[0] in self.targets)

    @classmethod
    def for_model(cls, config: ModelConfig, max_loras: int, max_rank: int, dtype: str | None = None) -> "LoraSpec":
        """The slots for `config`: every dense linear, or the attention's of a MoE model."""
        targets = LORA_TARGETS[:4] if config.moe else LORA_TARGETS
        return cls(max_loras, max_rank, targets, dtype)


def slot_shapes(config: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """One layer's slot stacks by param name: `lora_a_<group>` [in, G, S, r] (G the group's
    targets), `lora_b_<t>` [S, r, out]."""
    shapes = target_shapes(config)
    out = {}
    for group in spec.groups:
        out[group_name(group)] = (shapes[group[0]][0], len(group), spec.max_loras, spec.max_rank)
        for t in group:
            out[f"lora_b_{t}"] = (spec.max_loras, spec.max_rank, shapes[t][1])
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
          ids: jax.Array, ops: Any) -> tuple[jax.Array, ...]:
    """`outs` (the base linears `targets` of `layer` over x [B, T, in], one of `GROUPS`) plus each
    token's adapter delta (`ops.lora`: `dense_delta`, or a backend's own); `ids` int32 [B, T], the
    tokens' slots (0: none). A group without slots stays as it is."""
    a_var = getattr(layer, group_name(targets), None)
    if a_var is None:
        return outs

    def deltas(outs):
        bs = tuple(getattr(layer, f"lora_b_{t}")[...] for t in targets)
        return tuple(ops.lora(x, ids, a_var[...], bs, outs))

    return jax.lax.cond(jnp.any(ids > 0), deltas, lambda outs: tuple(outs), tuple(outs))


def dense_delta(x: jax.Array, ids: jax.Array, a: jax.Array, bs: tuple[jax.Array, ...],
                outs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each out_g plus its tokens' deltas, over every slot at once: x [..., in] @ A [in, G, S, r]
    into every slot's rank columns, the columns of slots other than the token's zeroed, then
    [..., S * r] @ B_g [S * r, out] per target (XLA's dots; the module docstring's cost)."""
    n_in, G, S, r = a.shape
    select = (ids[..., None] == jnp.arange(1, S + 1, dtype=ids.dtype)).astype(x.dtype)  # [..., S]
    xa = (x @ a.reshape(n_in, G * S * r)).reshape(*x.shape[:-1], G, S, r) * select[..., None, :, None]
    result = []
    for g, (b, out) in enumerate(zip(bs, outs)):
        delta = xa[..., g, :, :].reshape(*x.shape[:-1], S * r) @ b.reshape(S * r, -1)
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
