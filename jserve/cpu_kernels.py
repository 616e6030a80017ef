"""Which CPU kernels a paged step runs: XLA's dot library per step shape, or the native matmuls
over weights packed once at load (`pallas_kernels.matmul`)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jserve.config import ModelConfig
from jserve.model.llama import LAYER_MATMULS
from pallas_kernels.decoder_layer import native as native_layer
from pallas_kernels.matmul import native as native_matmul

# Without the native matmuls (no compiler, weights neither float32 nor bfloat16,
# `native_matmuls=False`):
# XLA:CPU sends dots to YNNPACK by default; some CPU steps run faster with its Eigen dots
# (SmolLM2, 2-core AMD EPYC with AVX2, each pair interleaved in one process with
# scripts/bench_decode_step.py or an uncommitted harness of the same kind; medians in ms, YNNPACK
# vs Eigen):
# - decode with the native attention kernel and the XLA head: batch 8 72 vs 66, batch 16 100 vs
#   85 (256 context), 135 vs 117 (1024); batch 1 35 vs 36 and batch 32 180 vs 187 (no gain);
#   batch 2 and 4 51 vs 141 and 64 vs 163: a logits dot over 2-4 rows takes ~120 ms in Eigen,
#   11-13 ms in YNNPACK.
# - prefill of one row: 16 tokens 84 vs 55, 64 tokens 196 vs 184, 256 tokens 553 vs 525, 512
#   tokens 1382 vs 1238 (128: 279 vs 292, noise); several rows hit the logits dot above.
EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}
EIGEN_DECODE_BATCHES = (8, 16)
EIGEN_PREFILL_BATCHES = (1,)
#
# With the native CPU kernels the layer weights (and a tied embedding, transposed) are held packed
# as [N / P, K, P] panels (P: 24 columns with AVX2, 48 with AVX-512) and every layer matmul and
# the LM head, decode and prefill alike, run on pallas_kernels.matmul's packed kernel (XLA's dots
# cannot read that layout, and a second, natural copy would double the weights' memory). 30
# SmolLM2 layers at M rows on a 2-core Zen 3 (AVX2), ms, packed / YNNPACK / Eigen (interleaved, an
# uncommitted harness): M=1 16.7 / 19.8 / 19.3, 8 17.4 / 39.9 / 29.0, 16 31.3 / 54.8 / 35.5, 64
# 110 / 126 / 124; at M=512 (long prefill chunks) 823 / 712 / 759 in that run, but 774 vs 769 ms
# packed vs YNNPACK in a later one (fifth session, docs/performance.md), where an einsum over the
# packed layout took 971 ms.
# The tied LM head on the native CPU kernel, over the embedding packed like the layer weights
# (its transpose; the embedding lookup reads the panels, llama.embed_rows): SmolLM2's 49152 x 576
# head at 1 / 4 / 16 / 32 rows, ms, packed vs XLA's dot (YNNPACK), interleaved on a quiet machine
# (an uncommitted harness): 4.1 / 4.5 / 6.0 / 10.7 vs 4.8 / 7.7 / 11.8 / 17.4.


def native_matmul_params(config: ModelConfig, params: dict[str, Any], *, enabled: bool
                         ) -> tuple[dict[str, Any], Callable | None, Callable | None]:
    """`(params, linear, tied_head)` for a runner: with `enabled` and the kernel built, the layer
    weights and a tied embedding (transposed), float32 or bfloat16 (kept as they are), packed
    once into the kernel's panels, and the model hooks that read them (None where a weight stays
    plain, for XLA's dots). Whoever merges the returned params into the model must pass the
    hooks."""
    enabled = enabled and native_matmul.available()
    layers = params["layers"]
    packed_layers = enabled and all(
        layer[name].dtype in native_matmul.WEIGHT_DTYPES for layer in layers.values() for name in LAYER_MATMULS)
    packed_head = enabled and config.tie_word_embeddings and params["embed"].dtype in native_matmul.WEIGHT_DTYPES
    if packed_layers:
        params = {**params, "layers": {
            i: {name: native_matmul.pack(w) if name in LAYER_MATMULS else w for name, w in layer.items()}
            for i, layer in layers.items()}}
    if packed_head:
        params = {**params, "embed": native_matmul.pack(params["embed"].T)}
    return (params, native_linear if packed_layers else None,
            functools.partial(native_tied_head, vocab=config.vocab_size) if packed_head else None)


def native_tied_head(x: jax.Array, embed: jax.Array, *, vocab: int) -> jax.Array:
    """The tied LM head on the native CPU kernel: the embedding packed as `pack(embed.T)`."""
    return native_matmul.matmul_packed(x, embed, vocab)


def native_linear(x: jax.Array, w, out_features):
    """A layer matmul over a packed weight (`pallas_kernels.matmul.native.pack`) on the native
    CPU kernel; a plain [in, out] weight stays an XLA dot. A tuple of packed weights (and of
    widths) runs as one call (`matmul_packed_many`), so q/k/v and gate/up are 2 calls a layer, not
    5: the SmolLM2 decode step at 16 rows x 384 cached tokens 59.6 / 69.0 / 59.7 -> 57.7 / 64.0 /
    57.7 ms in three interleaved runs of 30-60 steps; at 8 rows 37.2 -> 36.8, at 4 and at 16 x
    1024 no difference beyond the noise (*measured*, an uncommitted harness). The products come
    back in x's dtype, as an XLA dot of x and a weight of that dtype would give them (the kernel
    computes in float32: bfloat16 activations are rounded once, at the end)."""
    if isinstance(w, tuple):
        if all(wi.ndim == 3 for wi in w):
            return tuple(o.astype(x.dtype) for o in native_matmul.matmul_packed_many(x, w, out_features))
        return tuple(native_linear(x, wi, n) for wi, n in zip(w, out_features))
    if w.ndim == 3:
        return native_matmul.matmul_packed(x, w, out_features).astype(x.dtype)
    return x @ w


def native_decoder_layers(config: ModelConfig, *, enabled: bool) -> Callable | None:
    """The model's `decoder_layers` hook for the paged runner's CPU decode steps: all the layers of
    a one-token-per-row step as one native call (`pallas_kernels.decoder_layer`), over the packed
    weights (`native_matmul_params`) and the paged cache (`jserve.model.paged_attention`); None
    (no hook) where the kernel is unavailable or the model has what it does not compute (biases,
    q/k norms). For prefill chunks, weights that are not packed or pages neither float32 nor
    bfloat16, the hook returns None and the model runs the layers itself.

    SmolLM2 decode at 16 rows x 384 cached tokens (scripts/bench_decode_step.py, 2-core Xeon,
    each pair interleaved in one run): one call per layer 48.6 ms vs 54.1 as XLA ops around
    native matmul and attention calls; with the rotary and K/V write inside the attention's
    phase and the sampler's argmax as two reductions (jserve.sampler.argmax) 45.5 vs 51.2; all
    layers in one call 45.5 vs 51.5 (1 row: 24.5 vs 27.0; 32 rows: 77.3 vs 84.5). See
    docs/performance.md, eleventh session."""
    c = config
    if not (enabled and native_layer.available() and native_layer.supports(c.num_heads, c.num_kv_heads, c.head_dim)
            and not (c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm)):
        return None

    def layers(ws, x, cos, sin, cache, meta):
        if x.shape[1] != 1 or any(p.dtype not in native_layer.PAGE_DTYPES for kv in cache for p in kv):
            return None
        args = []
        for i, w in enumerate(ws):
            weights = tuple(getattr(w, name)[...] for name in LAYER_MATMULS)
            if any(wi.ndim != 3 for wi in weights):
                return None
            args.append(native_layer.LayerArgs(w.attn_norm[...], w.mlp_norm[...], weights, *cache[i]))
        out, pages = native_layer.decoder_layers(
            x[:, 0], cos[:, 0, 0], sin[:, 0, 0], args, meta.slots, meta.q_start, meta.q_lens,
            meta.page_indices, num_heads=c.num_heads, eps=c.rms_norm_eps, sm_scale=c.head_dim ** -0.5,
            sliding_window=c.sliding_window)
        return out[:, None].astype(x.dtype), tuple(pages) + tuple(cache[len(ws):])

    return layers
