"""Writing an adapter into one of the model's LoRA slots on the device (`jserve.model.lora`).

A slot of every `lora_a_<t>` / `lora_b_<t>` stack is overwritten in place (the stack donated, its
sharding kept) by a jitted update whose slot index is traced: one small program per stack shape, compiled when the
writer is made (it clears slot 1 then), none when adapters come and go while serving.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model import lora, quant
from jserve.model.config import ModelConfig


def _set(stack: jax.Array, index: jax.Array, value: jax.Array, at: tuple) -> jax.Array:
    """`stack` with `value` at `at` (a static index whose None is the traced slot `index`)."""
    where = tuple(index if i is None else i for i in at)
    return stack.at[where].set(value.astype(stack.dtype))


@functools.lru_cache(maxsize=None)
def _writer(sharding: Any):
    """`_set` jitted to return the stack where it was (its sharding on a mesh), donated."""
    return jax.jit(_set, static_argnames="at", donate_argnums=0, out_shardings=sharding)


def _write(stack: jax.Array, index: Any, value: np.ndarray, at: tuple) -> jax.Array:
    return _writer(stack.sharding)(stack, index, value, at=at)


class LoraSlotWriter:
    """Puts adapters into a model state's slots; `write` returns the state with the new arrays."""

    def __init__(self, config: ModelConfig, spec: lora.LoraSpec):
        self.config = config
        self.spec = spec

    def add_slots(self, params: dict[str, Any], put, mesh: Any = None) -> dict[str, Any]:
        """`params` (the backend's model state) with empty slots in the spec's dtype (default: the
        float weights'), each array placed by `put`, or over `mesh` sharded like its base linear
        (`sharding.PARTITION_RULES`); the writes' programs compiled (slot 1 cleared)."""
        dtype = jnp.dtype(self.spec.dtype) if self.spec.dtype else quant.float_dtype(params)
        if mesh is None:
            return self.write(lora.add_slots(params, self.config, self.spec, dtype, put), 1, None)
        from jserve.runtime.sharding import param_sharding

        params = lora.add_slots(params, self.config, self.spec, dtype)
        layers = params["layers"]
        stacked = 0 not in layers

        def place(layer: dict) -> dict:
            return {k: jax.device_put(v, param_sharding(mesh, k, v.shape, stacked=stacked))
                    if k.startswith("lora_") else v for k, v in layer.items()}

        layers = place(layers) if stacked else {i: place(layer) for i, layer in layers.items()}
        return self.write({**params, "layers": layers}, 1, None)

    def write(self, params: dict[str, Any], slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]] | None,
              ) -> dict[str, Any]:
        """`params` with slot `slot` (1 .. max_loras) holding the adapter `weights` (target ->
        (A [L, in, r], B [L, r, out]), the scaling folded into B; `lora.slot_arrays` checks and
        pads them), or emptied (None)."""
        if not 1 <= slot <= self.spec.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 1 .. {self.spec.max_loras}")
        padded = lora.slot_arrays(weights or {}, self.config, self.spec)
        index = np.int32(slot - 1)
        layers = params["layers"]
        stacked = 0 not in layers
        new_layers = dict(layers) if stacked else {i: dict(layer) for i, layer in layers.items()}
        for group in self.spec.groups:
            for g, t in enumerate(group):
                a, b = padded[t]
                # A [.., in, G, S, r] at (g, slot); B [.., S, r, out] at the slot (stacked: after the layer axis)
                writes = ((lora.group_name(group), a, (slice(None), g, None)), (f"lora_b_{t}", b, (None,)))
                for name, value, at in writes:
                    if stacked:
                        new_layers[name] = _write(new_layers[name], index, value, at=(slice(None), *at))
                        continue
                    for i in new_layers:
                        new_layers[i][name] = _write(new_layers[i][name], index, value[i], at=at)
        return {**params, "layers": new_layers}
