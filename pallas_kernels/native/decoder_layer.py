"""The fused decoder layer (`decoder_layer.cc`): built on first use (`pallas_kernels.native.build`),
called as an XLA FFI target.

`decoder_layers(...)` runs Llama layers (each: RMSNorm, q/k/v, rotary, the K/V write, paged
decode attention, o, RMSNorm, gate/up, SiLU, down, both residuals) for one new token per row,
over weights packed by `pallas_kernels.native.matmul.pack` (or quantized ones packed by
`pack_quantized`: all seven of a layer, every layer alike), as one call: the paged runner's
decode steps on CPU (`jserve.runtime.backends.native_cpu`). Layers with biases or q/k norms, and
prefill chunks, stay on the model's own path. With `lora_ids`, each layer also takes its LoRA
slot stacks (`LayerArgs.lora`, `jserve.model.lora`'s layout) and each row gets its slot's delta,
reading only the slots the step's rows use (`lora_delta.h`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import paged_attention as native_attention
from pallas_kernels.native.build import NativeLibrary
from pallas_kernels.native.matmul import PackedQuantized, quads_bits

TARGET = "jserve_decoder_layers"
TARGET_LORA = "jserve_decoder_layers_lora"
PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
NUM_WEIGHTS = 7  # a layer's matmul weights: wq, wk, wv, wo, w_gate, w_up, w_down
_META = 7  # the call's arguments before the layers': x, cos, sin, slots, q_start, q_lens, page_indices


class LayerArgs(NamedTuple):
    """One layer's weights and pages for `decoder_layers`, in the order the call takes them
    (`flat`): the layout of each layer's arguments is this structure's, and the library's
    constants are checked against it when it loads."""

    attn_norm: jax.Array  # [hidden]
    mlp_norm: jax.Array  # [hidden]
    # wq, wk, wv, wo, w_gate, w_up, w_down, each `pack(w)` of [in, out], or each a `PackedQuantized`
    weights: tuple
    k_pages: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array
    # LoRA slots, where the call has `lora_ids`: A [K, G, S, r] of the groups (q/k/v, o, gate/up,
    # down), then B [S, r, N] of the seven targets, all float32 or all bfloat16 (`jserve.model.lora`)
    lora: tuple = ()

    @property
    def quantized(self) -> bool:
        """Whether the weights are quantized (all seven; a mix is refused)."""
        kinds = {isinstance(w, PackedQuantized) for w in self.weights}
        if len(kinds) > 1:
            raise ValueError("decoder_layers needs a layer's seven weights all quantized or all float")
        return kinds == {True}

    def flat(self) -> tuple:
        """The call's arguments for this layer: quantized weights' codes in the weights' places,
        their scales after the pages."""
        if self.quantized:
            return (self.attn_norm, self.mlp_norm, *(w.codes for w in self.weights), self.k_pages, self.v_pages,
                    *(w.scales for w in self.weights), *self.lora)
        return (self.attn_norm, self.mlp_norm, *self.weights, self.k_pages, self.v_pages, *self.lora)


# Where each layer's arguments sit, from the structure above (the C++ side's kArgsPerLayer,
# kKPagesArg, kArgsPerQuantizedLayer and kScalesArg must agree: checked at load).
_SHAPE = LayerArgs("attn_norm", "mlp_norm", ("w",) * NUM_WEIGHTS, "k_pages", "v_pages").flat()
_PER_LAYER, _K_PAGES = len(_SHAPE), _SHAPE.index("k_pages")
_SHAPE_Q = LayerArgs("attn_norm", "mlp_norm", (PackedQuantized("codes", "scales"),) * NUM_WEIGHTS,
                     "k_pages", "v_pages").flat()
_PER_QUANTIZED_LAYER, _SCALES = len(_SHAPE_Q), _SHAPE_Q.index("scales")
assert _SHAPE_Q.index("k_pages") == _K_PAGES
LORA_ARGS = 4 + NUM_WEIGHTS  # a layer's LoRA stacks: A of the 4 groups, B of the 7 targets
_LIBRARY = NativeLibrary("decoder_layer", Path(__file__).with_name("decoder_layer.cc"),
                         {TARGET: "JserveDecoderLayers", TARGET_LORA: "JserveDecoderLayersLora"},
                         what="native CPU decoder layer",
                         fallback="running the layers as XLA ops and native matmul/attention calls",
                         constants={"JserveArgsPerLayer": _PER_LAYER, "JserveKPagesArg": _K_PAGES,
                                    "JserveArgsPerQuantizedLayer": _PER_QUANTIZED_LAYER,
                                    "JserveScalesArg": _SCALES, "JserveLoraArgsPerLayer": LORA_ARGS,
                                    "JserveMaxGroups": native_attention.MAX_GROUPS,
                                    "JserveMaxHeadDim": native_attention.MAX_HEAD_DIM})


def available(quantized: bool = False) -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed.
    `quantized`: its build with the quantized kernels too (`build.NativeLibrary`)."""
    return _LIBRARY.available(quantized)


def unavailable_reason(quantized: bool = False) -> str | None:
    return _LIBRARY.unavailable_reason(quantized)


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes these attention shapes: those of the native attention's decode
    (the same decode_attention.h), whose head_dim must be a multiple of 8."""
    return (num_kv_heads >= 1 and num_heads % num_kv_heads == 0 and head_dim % 8 == 0
            and native_attention.supports(num_heads // num_kv_heads, head_dim))


def decoder_layers(x: jax.Array, cos: jax.Array, sin: jax.Array, layers: Sequence[LayerArgs],
                   slots: jax.Array, q_start: jax.Array, q_lens: jax.Array, page_indices: jax.Array, *,
                   num_heads: int, eps: float, sm_scale: float, sliding_window: int | None,
                   lora_ids: jax.Array | None = None) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """The decoder layers, one after the other, for rows x [M, hidden] at one new token each.

    Args:
      cos, sin: [M, head_dim], the rotary tables at the rows' positions.
      layers: each layer's weights (float panels, or `PackedQuantized`: all of a layer, every
        layer alike) and pages; the rows' new K/V are written into the pages (in place where the
        caller donates them).
      slots, q_start, q_lens, page_indices: as `jserve.runtime.paged_attention.PagedMeta` for a
        decode step (q_lens 1 for a live row, 0 for a padded one).
      lora_ids: int [M], each row's LoRA slot (0: none; s: slot s of every layer's `lora` stacks),
        or None (the layers' `lora` must then be empty).
    Returns:
      (x_out [M, hidden] float32, [(k_pages, v_pages) per layer]).
    """
    if not available():
        raise RuntimeError(f"native CPU decoder layer unavailable: {unavailable_reason()}")
    if not layers or any(len(layer.weights) != NUM_WEIGHTS for layer in layers):
        raise ValueError("decoder_layers needs at least one layer, each with 7 packed weights "
                         "(wq, wk, wv, wo, w_gate, w_up, w_down)")
    if len({layer.quantized for layer in layers}) > 1:
        raise ValueError("decoder_layers needs every layer's weights alike: all quantized or all float")
    per_layer = _PER_QUANTIZED_LAYER if layers[0].quantized else _PER_LAYER
    if any(len(layer.lora) != (0 if lora_ids is None else LORA_ARGS) for layer in layers):
        raise ValueError(f"decoder_layers needs {LORA_ARGS} LoRA stacks per layer with lora_ids, none without")
    meta = _META + (lora_ids is not None)
    per_layer += 0 if lora_ids is None else LORA_ARGS
    M = x.shape[0]
    pages = [p for layer in layers for p in (layer.k_pages, layer.v_pages)]
    flat = [a for layer in layers for a in layer.flat()]
    aliases = {}
    for i in range(len(layers)):  # each layer's k_pages and v_pages are written in place
        aliases[meta + per_layer * i + _K_PAGES] = 1 + 2 * i
        aliases[meta + per_layer * i + _K_PAGES + 1] = 2 + 2 * i
    call = jax.ffi.ffi_call(
        _LIBRARY.target(TARGET if lora_ids is None else TARGET_LORA, layers[0].quantized),
        (jax.ShapeDtypeStruct((M, x.shape[1]), jnp.float32),
         *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages)),
        input_output_aliases=aliases, vmap_method="sequential")
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    out, *new_pages = call(x.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32),
                           i32(slots), i32(q_start), i32(q_lens), i32(page_indices),
                           *(() if lora_ids is None else (i32(lora_ids),)), *flat,
                           num_heads=np.int32(num_heads), eps=np.float32(eps),
                           sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                           int8_rows=np.int32(_int8_rows(layers)), quads=np.int32(quads_bits(_quantized(layers))))
    return out, list(zip(new_pages[::2], new_pages[1::2]))


def _quantized(layers: Sequence[LayerArgs]) -> list[PackedQuantized]:
    return [w for layer in layers if layer.quantized for w in layer.weights]


def _int8_rows(layers: Sequence[LayerArgs]) -> int:
    """The quantized weights' fewest `PackedQuantized.int8_rows` (0 for float weights): from this many
    rows on the matmuls' inputs are quantized to int8 for integer dot products (every layer's: a
    GGUF's layers may differ in scheme, and codes stored as quads need the integer path)."""
    return min((w.int8_rows for w in _quantized(layers)), default=0)
