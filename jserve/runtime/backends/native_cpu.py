"""The native CPU backend: C++ kernels behind XLA FFI calls, for a CPU host.

Attention on the native paged-attention kernel, every linear and the tied head on the packed
matmul kernel over weights packed once at load (float32, bfloat16, int8 / int4 panels), and a
decode step's Llama layers as one fused native call; `NativeCpuBackend`'s docstring says what runs
where. See docs/architecture.md, "The backend seam".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jserve.model import lora as lora_model
from jserve.model import quant
from jserve.model.config import ModelConfig
from jserve.model.llama import LAYER_MATMULS, XlaOps, unrolled_layers, xla_linear
from jserve.runtime.backends.base import EIGEN_DOTS, Backend
from jserve.runtime.paged_attention import PagedAttention
from pallas_kernels.native import decoder_layer as native_layer
from pallas_kernels.native import lora as native_lora
from pallas_kernels.native import matmul as native_matmul
from pallas_kernels.native import paged_attention as native_attention

# Where the packed matmuls are off: Eigen's dots instead of YNNPACK's for decode at 8 and 16 rows
# (with the native attention) and prefill of one row.
EIGEN_DECODE_BATCHES = (8, 16)
EIGEN_PREFILL_BATCHES = (1,)


class NativeCpuBackend(Backend):
    """Native C++ kernels on the CPU.

    - Attention: the native paged-attention kernel (`pallas_kernels.native.paged_attention`), decode
      and prefill chunks alike; Pallas interpret mode where it cannot build or past its shapes.
    - Linears and the tied LM head: the packed matmul kernel (`pallas_kernels.native.matmul`) over weights
      (and the tied embedding, transposed) packed once at load into [N / P, K, P] panels, float32 or
      bfloat16 as loaded. XLA's dots cannot read that layout, and a second, natural copy would double
      the weights' memory, so every matmul and the head run on the kernel, decode and prefill.
      Quantized weights (`jserve.model.quant.QuantizedWeight`: int8 and int4) pack into quantized
      panels (`pack_quantized`) that the kernel reads as codes; a quantized tied embedding (held as
      its transpose) is the head's weight and the lookup's table both. fp8 stays as loaded, on XLA
      (`quant.xla_quantized_linear`, `quant.embed_rows`).
    - The layer stack: unrolled over per-layer weights and per-layer KV pages; a decode step (one
      token per row) runs all the layers as one fused native call
      (`pallas_kernels.native.decoder_layer`), an implementation of `jserve.model.llama.DecoderLayer`'s
      contract for plain Llama layers without biases or q/k norms (tests/test_decoder_layer.py checks
      it against the model's own layers); other steps, and every step of another layer (Gemma 2 / 3:
      `ModelConfig.llama_layer` is False), run the model's own layers unrolled, on the native
      matmuls and the native attention (which takes each layer's window and soft cap). Mixture-of-
      experts layers run so too: their attention on the native matmuls, their experts as XLA's
      gather grouped matmul (`jserve.model.moe`: a decode step reads only the selected experts' weights).
    - Pages: 64 tokens each by default; without the packed matmuls some step shapes compile with
      XLA's Eigen dots instead of YNNPACK's (docs/performance.md has the measurements).

    Args:
      native_matmuls: pack the layer weights and a tied embedding for the native matmul kernel
        (with a mesh, or without a compiler, they stay XLA dots); False keeps XLA's dots, for
        tests and benchmarks that compare the two.
      int8_activations: quantized weights' matmuls (and a quantized head) at
        `native_matmul.default_int8_rows(scheme)` rows or more quantize their input to int8 per
        block of 32 and take integer dot products (`PackedQuantized.int8_rows`; where the build has
        them, `native_matmul.int_dot_available()`); False, or batch_invariant (whose rows must not
        depend on the batch's size), dequantizes the weights to float32 at every row count.
    """

    name = "native"
    param_layout = "list"
    kv_layout = "per_layer"
    default_page_size = 64  # scattered pages read faster in larger chunks (docs/performance.md)

    def __init__(self, kernel: str = "cpu", *, mesh: Any = None, huge_pages: bool = True,
                 native_matmuls: bool = True, batch_invariant: bool = False, int8_activations: bool = True):
        super().__init__(kernel, mesh=mesh, huge_pages=huge_pages, batch_invariant=batch_invariant)
        self.int8_activations = int8_activations and not batch_invariant
        if batch_invariant and (mesh is not None or not native_matmuls):
            raise ValueError("batch_invariant needs the native matmuls, which run without a mesh (XLA's dots "
                             "pick their reduction order by the step's shape)")
        # Built now, not while tracing a step.
        self.native_attention = native_attention.available()
        self.want_native_matmuls = native_matmuls and mesh is None and native_matmul.available()
        self.native_matmuls = self.native_head = False  # what prepare_params packed
        self.uniform_layers = False  # every layer's matmul weights of one kind (all float or all quantized)

    def batch_buckets(self, buckets: Sequence[int]) -> tuple[int, ...]:
        # Batch 1 pays off with the native kernel only (the Pallas interpret kernel takes seconds).
        if not self.native_attention and 1 in buckets and len(buckets) > 1:
            return tuple(b for b in buckets if b != 1)
        return tuple(buckets)

    def prepare_params(self, config: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
        params = super().prepare_params(config, params)
        if not self.want_native_matmuls:
            return params
        layers = params["layers"]
        # A MoE layer has no dense MLP: its attention matmuls pack, its experts stay XLA arrays.
        weights = [layer[name] for layer in layers.values() for name in LAYER_MATMULS if name in layer]
        floats = [w for w in weights if not quant.is_quantized(w)]
        pack_floats = all(w.ndim == 2 and w.dtype in native_matmul.WEIGHT_DTYPES for w in floats)

        def packed(w):
            if quant.is_quantized(w):
                return self._pack_quantized(w) if native_matmul.can_pack_quantized(w) else w
            return native_matmul.pack(w) if pack_floats else w

        params = {**params, "layers": {
            i: {name: packed(w) if name in LAYER_MATMULS else w for name, w in layer.items()}
            for i, layer in layers.items()}}
        kinds = {_weight_kind(layer[name]) for layer in params["layers"].values() for name in LAYER_MATMULS
                 if name in layer}
        self.native_matmuls = "xla" not in kinds
        self.uniform_layers = len(kinds) == 1  # the fused call takes layers all float or all quantized
        embed = params["embed"]
        if config.tie_word_embeddings:
            if quant.is_quantized(embed):  # held as its transpose [hidden, vocab]
                if native_matmul.can_pack_quantized(embed):
                    params = {**params, "embed": self._pack_quantized(embed)}
                    self.native_head = True
            elif embed.ndim == 2 and embed.dtype in native_matmul.WEIGHT_DTYPES:
                params = {**params, "embed": native_matmul.pack(embed.T)}
                self.native_head = True
        elif native_matmul.can_pack_quantized(params.get("lm_head")):
            params = {**params, "lm_head": self._pack_quantized(params["lm_head"])}
            self.native_head = True
        elif self.batch_invariant and params["lm_head"].dtype in native_matmul.WEIGHT_DTYPES:
            params = {**params, "lm_head": native_matmul.pack(params["lm_head"])}  # XLA's dot is not invariant
            self.native_head = True
        return params

    def _pack_quantized(self, w) -> native_matmul.PackedQuantized:
        packed = native_matmul.pack_quantized(w)
        return packed.with_int8_rows(native_matmul.default_int8_rows(packed.scheme) if self.int8_activations else 0)

    def ops(self, config: ModelConfig) -> "NativeCpuOps":
        attention = PagedAttention(self.kernel, config.sliding_window, self.mesh, self.kv_layout)
        fused = (self.native_matmuls and self.uniform_layers and self.native_attention
                 and fused_layers_supported(config))
        if self.batch_invariant:
            self._check_invariant(config)
            # The fused layers compute norms, rotary and activations in C++, the unfused ones in XLA: a
            # token would round differently in a decode step than in a mixed one.
            attention, fused = dataclasses.replace(attention, batch_invariant=True), False
        # MoE layers (never fused): only the selected experts' weights read ("gather"), as XLA:CPU
        # has no grouped matmul (jserve.model.moe).
        return NativeCpuOps(attention, config=config, fused=fused, grouped_matmul="gather", mesh=self.mesh,
                            batch_invariant=self.batch_invariant)

    def _check_invariant(self, config: ModelConfig) -> None:
        """A ValueError naming what keeps this model off batch-invariant mode: every matmul and the
        head on the native kernel (row by row, one order over K), the native attention."""
        needs = (("the native matmuls (weights of a kind they do not pack)", self.native_matmuls),
                 ("the native head", self.native_head), ("the native attention kernel", self.native_attention),
                 ("dense MLPs (mixture-of-experts layers run XLA's grouped matmul)", not config.moe))
        missing = [what for what, ok in needs if not ok]
        if missing:
            raise ValueError(f"batch_invariant needs {', '.join(missing)}")

    def compiler_options(self, rows: int, tokens: int) -> dict[str, str] | None:
        if self.native_matmuls:
            return None  # no XLA dot is left to pick a library for
        if tokens == 1:
            eigen = self.native_attention and rows in EIGEN_DECODE_BATCHES
        else:
            eigen = rows in EIGEN_PREFILL_BATCHES
        return EIGEN_DOTS if eigen else None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "native_attention": self.native_attention,
                "native_matmuls": self.native_matmuls, "native_head": self.native_head,
                "int_dot": native_matmul.int_dot_isa() if self.int8_activations else None}


def fused_layers_supported(config: ModelConfig) -> bool:
    """Whether the fused native decoder layers compute this model's layers."""
    c = config
    return (native_layer.available() and native_layer.supports(c.num_heads, c.num_kv_heads, c.head_dim)
            and c.llama_layer and not (c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm))


def _weight_kind(w) -> str:
    """How a layer weight as prepared runs: "float" or "quantized" panels, or "xla" (unpacked)."""
    if isinstance(w, native_matmul.PackedQuantized):
        return "quantized"
    return "xla" if quant.is_quantized(w) or w.ndim != 3 else "float"


def _packed(w) -> bool:
    return _weight_kind(w) != "xla"


def native_linear(x: jax.Array, w, out_features):
    """A layer matmul over a packed weight (`pallas_kernels.native.matmul.pack`) on the native
    kernel; a plain [in, out] weight stays an XLA dot. A tuple of packed weights (and of widths)
    runs as one call (`matmul_packed_many`): q/k/v and gate/up are 2 calls a layer, not 5. The
    products come back in x's dtype, as an XLA dot of x and a weight of that dtype would give them
    (the kernel computes in float32: bfloat16 activations are rounded once, at the end). Packed
    quantized weights (`PackedQuantized`) run on the kernel too; a `QuantizedWeight` that did not
    pack (fp8) runs as `quant.xla_quantized_linear`."""
    if isinstance(w, tuple):
        if all(_packed(wi) for wi in w):
            return tuple(o.astype(x.dtype) for o in native_matmul.matmul_packed_many(x, w, out_features))
        return tuple(native_linear(x, wi, n) for wi, n in zip(w, out_features))
    if _packed(w):
        return native_matmul.matmul_packed(x, w, out_features).astype(x.dtype)
    if quant.is_quantized(w):
        return quant.xla_quantized_linear(x, w)
    return xla_linear(x, w, out_features)


@dataclasses.dataclass(frozen=True)
class NativeCpuOps(XlaOps):
    """`ModelOps` over packed weights; the decode stack as one fused native call."""

    config: ModelConfig | None = None
    fused: bool = False  # decode steps run the fused native decoder layers
    native_lora: bool = True  # unfused steps' LoRA deltas per slot (`lora`); False: the dense XLA form

    def linear(self, x, w, out_features):
        return native_linear(x, w, out_features)

    def embed(self, table, tokens):
        """Rows of the table as the params hold it: [vocab, hidden], or packed as [vocab / P,
        hidden, P] panels of its transpose (token t is panel t // P, lane t % P); a quantized
        table (its transpose, packed or not) dequantized to float32 (the model casts the rows to
        its activations' dtype)."""
        if isinstance(table, native_matmul.PackedQuantized):
            return native_matmul.quantized_rows(table, tokens, jnp.float32)
        if quant.is_quantized(table):
            return quant.embed_rows(table, tokens, jnp.float32)
        if table.ndim == 3:
            lanes = table.shape[2]
            return table[tokens // lanes, :, tokens % lanes]
        return table[tokens]

    def head(self, x, table, tied):
        if isinstance(table, native_matmul.PackedQuantized):  # tied (E^T) or lm_head, [hidden, vocab]
            return native_matmul.matmul_packed(x, table, self.config.vocab_size)
        if quant.is_quantized(table):
            return quant.xla_quantized_linear(x, table, jnp.float32)
        if table.ndim == 3:  # packed: a tied embedding (E^T), or lm_head in batch-invariant mode
            return native_matmul.matmul_packed(x, table, self.config.vocab_size)
        return super().head(x, table, tied)

    def lora(self, x, ids, a, bs, outs):
        """Each token's delta from its own slot only (`pallas_kernels.native.lora`), where the
        kernel takes the stacks and no mesh splits them (the call has no sharding rule); else the
        dense form over every slot."""
        if self.native_lora and self.mesh is None and native_lora.takes(x, a, bs):
            return native_lora.lora_delta(x, ids, a, bs, outs)
        return super().lora(x, ids, a, bs, outs)

    def with_attention(self, attention):
        return dataclasses.replace(self, attention=attention, fused=False)

    def takes_fused(self, x, cache, layers=()) -> bool:
        """Whether this step runs the fused layers: one token per row, float32 or bfloat16 pages;
        with LoRA slots (`lora_ids`), slots on all seven linears of every layer (the fused call
        takes each layer's stacks; a subset of targets runs unfused)."""
        return (self.fused and x.shape[1] == 1 and (self.lora_ids is None or fused_lora_slots(layers))
                and all(p.dtype in native_layer.PAGE_DTYPES for kv in cache for p in kv))

    def run_layers(self, layers, x, cos, sin, cache, meta):
        if self.takes_fused(x, cache, layers):
            return fused_decoder_layers(self.config, layers, x, cos, sin, cache, meta, self.lora_ids)
        return unrolled_layers(layers, x, cos, sin, cache, meta, self)


def _lora_stacks(layer) -> tuple:
    """A layer's LoRA stacks in the fused call's order (`native_layer.LayerArgs.lora`): A of each
    group, then B of each target; () where it lacks any."""
    names = [lora_model.group_name(g) for g in lora_model.GROUPS] + [f"lora_b_{t}" for t in LAYER_MATMULS]
    stacks = [getattr(layer, n, None) for n in names]
    return () if any(s is None for s in stacks) else tuple(s[...] for s in stacks)


def fused_lora_slots(layers) -> bool:
    """Whether the layers' LoRA slots fit the fused call: every group's, of a dtype it reads."""
    stacks = [_lora_stacks(layer) for layer in layers]
    return bool(stacks) and all(s and all(a.dtype in native_layer.PAGE_DTYPES for a in s) for s in stacks)


def fused_decoder_layers(config: ModelConfig, layers, x, cos, sin, cache, meta, lora_ids=None):
    """All the layers of a one-token-per-row step as one native call, over the layers' packed
    weights (`DecoderLayer.matmul_weights`) and per-layer pages; with `lora_ids` [M, 1] (the rows'
    LoRA slots), each layer's slot stacks too."""
    c = config
    args = [native_layer.LayerArgs(layer.attn_norm[...], layer.mlp_norm[...], layer.matmul_weights(), *cache[i],
                                   lora=() if lora_ids is None else _lora_stacks(layer))
            for i, layer in enumerate(layers)]
    out, pages = native_layer.decoder_layers(
        x[:, 0], cos[:, 0, 0], sin[:, 0, 0], args, meta.slots, meta.q_start, meta.q_lens,
        meta.page_indices, num_heads=c.num_heads, eps=c.rms_norm_eps, sm_scale=c.head_dim ** -0.5,
        sliding_window=c.sliding_window, lora_ids=None if lora_ids is None else lora_ids[:, 0])
    return out[:, None].astype(x.dtype), tuple(pages) + tuple(cache[len(args):])


