"""Public paged-attention entry points: validate, pack queries as rows, dispatch on `backend`.
`_attend` lists the backends ("cpu", "cpu_pallas", "tpu", "gpu", "reference") and what each takes.

All backends share one layout contract: K/V pages [num_kv_heads, num_pages, page_size, head_dim]
per layer (float32, bfloat16, float16, or quantized: int8 or float8_e4m3fn codes with float32
`k_scales` / `v_scales` [num_kv_heads, num_pages, page_size], one per token and KV head, a row
being `codes * scale`); page tables int32[batch, max_pages_per_seq] whose padded slots point to page 0, the
null page (never -1: JAX gathers wrap negative indices); lengths int32[batch], 0 for a padded row.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.native import paged_attention as native
from pallas_kernels.paged_attention import cpu, gpu, reference, tpu
from pallas_kernels.paged_attention.common import QUANT_DTYPES, pack_rows, unpack_rows

BACKENDS = ("cpu", "cpu_pallas", "tpu", "gpu", "reference")
# Keys per compute block: 128 fills a TPU lane row, and on CPU no block size measured better.
_DEFAULT_BLOCK_KEYS = 128
_STATIC = ("backend", "sm_scale", "soft_cap", "sliding_window", "pages_per_block", "batch_invariant")


def _check(name: str, x, ndim: int, dtypes=None) -> None:
    if not hasattr(x, "shape") or x.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {getattr(x, 'shape', x)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, "
                         f"got {x.dtype} (shape {x.shape})")


FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_pages(k_pages, v_pages, k_scales, v_scales) -> None:
    """K/V pages (and a quantized cache's scales) as every kernel takes them; ValueError naming the bad one."""
    _check("k_pages", k_pages, 4, FLOAT_DTYPES + QUANT_DTYPES)
    _check("v_pages", v_pages, 4, FLOAT_DTYPES + QUANT_DTYPES)
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype} must match "
                         f"k_pages {k_pages.shape} {k_pages.dtype}")
    quantized = k_pages.dtype in QUANT_DTYPES
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if not quantized:
            if x is not None:
                raise ValueError(f"{name} given for {k_pages.dtype} pages (only int8 and "
                                 "float8_e4m3fn pages take scales)")
            continue
        if x is None:
            raise ValueError(f"{k_pages.dtype} pages need k_scales and v_scales")
        _check(name, x, 3, (jnp.dtype(jnp.float32),))
        if x.shape != k_pages.shape[:3]:
            raise ValueError(f"{name} shape {x.shape} must be k_pages' first three dims "
                             f"{k_pages.shape[:3]}")


def check_options(sm_scale, soft_cap, sliding_window) -> None:
    """The attention's static options; ValueError naming the bad one."""
    if not isinstance(sm_scale, numbers.Real) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if soft_cap is not None and (not isinstance(soft_cap, numbers.Real) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and (not isinstance(sliding_window, numbers.Integral)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def _validate(q, k_pages, v_pages, page_indices, per_row: dict, *, backend, sm_scale, soft_cap,
              sliding_window, pages_per_block, q_shape, k_scales=None, v_scales=None) -> None:
    """Raises ValueError naming the bad argument.

    q is [batch, tokens, num_q_heads, head_dim]; messages show the caller's `q_shape`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    floats = FLOAT_DTYPES
    check_pages(k_pages, v_pages, k_scales, v_scales)
    num_kv_heads, _, _, head_dim = k_pages.shape
    batch, _, num_q_heads, q_head_dim = q.shape
    if q.dtype not in floats:
        raise ValueError(f"q must have a float dtype, got {q.dtype} (shape {q_shape})")
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} (shape {q_shape}) != k_pages head_dim "
                         f"{head_dim} (shape {k_pages.shape})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads (shape {q_shape}), not a multiple of "
                         f"k_pages' {num_kv_heads} KV heads (shape {k_pages.shape})")
    _check("page_indices", page_indices, 2, (jnp.dtype(jnp.int32),))
    if page_indices.shape[0] != batch:
        raise ValueError(f"page_indices shape {page_indices.shape} must have batch {batch} "
                         f"(q shape {q_shape})")
    for name, x in per_row.items():
        _check(name, x, 1, (jnp.dtype(jnp.int32),))
        if x.shape != (batch,):
            raise ValueError(f"{name} shape {x.shape} must be ({batch},) (q shape {q_shape})")
    check_options(sm_scale, soft_cap, sliding_window)
    if pages_per_block is not None and (not isinstance(pages_per_block, numbers.Integral)
                                        or pages_per_block < 1):
        raise ValueError(f"pages_per_block must be a positive int or None, got {pages_per_block!r}")


def _attend(q, k_pages, v_pages, q_start, q_lens, page_indices, *, backend, sm_scale, soft_cap,
            sliding_window, pages_per_block, k_scales=None, v_scales=None, batch_invariant=False):
    """q [batch, tokens, num_q_heads, head_dim] -> same shape, in q's dtype.

    Backends: "cpu" (the native kernel, `pallas_kernels.native.paged_attention`, decode
    and prefill chunks of any length, when it builds; without a compiler, or past `native.MAX_GROUPS`
    query heads per KV head, Pallas interpret mode, coarse grid), "cpu_pallas" (Pallas interpret mode
    always), "tpu" (Mosaic TPU kernel), "gpu" (Mosaic GPU kernel for Hopper, `gpu.py`, with
    bfloat16/float16 K/V or int8/float8_e4m3fn codes with scales, head_dim a multiple of 64 and
    page_size a multiple of 8; anything else runs the reference's XLA path, which gathers every slot
    of the page table) and "reference".
    `batch_invariant`: each token's output independent of the call's other rows and tokens; the
    native kernel's mode (`native.paged_attention_rows`), a ValueError for the other kernels.
    """
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    groups = q.shape[2] // num_kv_heads
    scales = {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)
    native_kernel = backend == "cpu" and native.supports(groups, q.shape[3], k_pages.dtype) and native.available()
    if batch_invariant and not native_kernel:
        raise ValueError(f"batch_invariant attention runs on the native CPU kernel only, not on {backend!r} "
                         f"(groups {groups}, head_dim {q.shape[3]}, pages {k_pages.dtype})")
    if backend == "gpu" and gpu.supports(k_pages.dtype, head_dim, page_size):
        # Keys per pipeline stage: a multiple of 64 (wgmma), at least 64, at most what fits
        # in shared memory.
        if pages_per_block is None:
            pages_per_block = max(1, gpu.DEFAULT_BLOCK_KEYS // page_size)
        pages_per_block = gpu.fit_pages_per_block(pages_per_block, page_size, head_dim,
                                                  page_indices.shape[1], k_pages.dtype)
        out = gpu.paged_attention_rows(pack_rows(q, num_kv_heads), k_pages, v_pages, q_start,
                                       q_lens, page_indices, sm_scale=float(sm_scale),
                                       soft_cap=soft_cap, sliding_window=sliding_window,
                                       groups=groups, pages_per_block=pages_per_block, **scales)
        return unpack_rows(out, q.shape[1]).astype(q.dtype)
    if backend in ("reference", "gpu"):
        return reference.paged_prefill_attention_reference(
            q, k_pages, v_pages, q_start, q_lens, page_indices,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, **scales)
    if native_kernel:
        out = native.paged_attention_rows(pack_rows(q, num_kv_heads), k_pages, v_pages, q_start,
                                          q_lens, page_indices, groups=groups, sm_scale=sm_scale,
                                          soft_cap=soft_cap, sliding_window=sliding_window,
                                          batch_invariant=batch_invariant, **scales)
        return unpack_rows(out, q.shape[1]).astype(q.dtype)
    if pages_per_block is None:
        pages_per_block = max(1, _DEFAULT_BLOCK_KEYS // page_size)
    pages_per_block = min(pages_per_block, page_indices.shape[1])
    impl = tpu.paged_attention_rows if backend == "tpu" else cpu.paged_attention_rows
    out = impl(pack_rows(q, num_kv_heads), k_pages, v_pages, q_start, q_lens, page_indices,
               sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window,
               groups=groups, pages_per_block=pages_per_block, **scales)
    return unpack_rows(out, q.shape[1])


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(
    q: jax.Array,             # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    lengths: jax.Array,       # int32[batch]; 0 marks a padded row
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]; padded slots -> page 0
    *,
    backend: str,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
    batch_invariant: bool = False,  # the native kernel's batch-invariant mode (`_attend`)
) -> jax.Array:
    """Decode attention over a paged KV cache (grouped-query: any query-per-KV-head ratio).

    The query of row b sits at position lengths[b] - 1 and attends keys 0..lengths[b]-1 (only
    the last `sliding_window` of them when set). Logits are `q.k * sm_scale`, then
    `soft_cap * tanh(logits / soft_cap)` when set; softmax and accumulation in float32.

    Args:
      pages_per_block: pages per compute block (default: 128 keys' worth), clamped to the
        page table's width.
      k_scales, v_scales: the scales of int8 / float8_e4m3fn pages (required with them, None
        with float pages): key row `k_pages[h, p, s] * k_scales[h, p, s]`.
    Returns:
      [batch, num_q_heads, head_dim] in q's dtype; rows with length 0 are zeros.
    """
    _check("q", q, 3)
    _check("lengths", lengths, 1)
    _validate(q[:, None], k_pages, v_pages, page_indices, {"lengths": lengths}, backend=backend,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              pages_per_block=pages_per_block, q_shape=q.shape, k_scales=k_scales, v_scales=v_scales)
    q_start = jnp.maximum(lengths - 1, 0)
    q_lens = (lengths > 0).astype(jnp.int32)
    out = _attend(q[:, None], k_pages, v_pages, q_start, q_lens, page_indices, backend=backend,
                  sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                  pages_per_block=pages_per_block, k_scales=k_scales, v_scales=v_scales,
                  batch_invariant=batch_invariant)
    return out[:, 0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_prefill_attention(
    q: jax.Array,             # [batch, tokens, num_q_heads, head_dim]
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    q_start: jax.Array,       # int32[batch]: absolute position of q[b, 0]
    q_lens: jax.Array,        # int32[batch]: real tokens of row b (0 for a padded row)
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]; padded slots -> page 0
    *,
    backend: str,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
    batch_invariant: bool = False,  # the native kernel's batch-invariant mode (`_attend`)
) -> jax.Array:
    """Causal attention of a chunk of new tokens per row over the row's pages.

    Serves chunked prefill and prefix-cache hits: the chunk's own K/V must already be written
    into the pages, so row b's pages hold keys 0..q_start[b] + q_lens[b] - 1 (its KV length).
    Token t of row b sits at position p = q_start[b] + t and attends keys 0..p (only the last
    `sliding_window` of them when set). Semantics otherwise as `paged_attention`, which is the
    one-token case (q_start = lengths - 1).

    Returns:
      [batch, tokens, num_q_heads, head_dim] in q's dtype; tokens t >= q_lens[b] are zeros.
    """
    _check("q", q, 4)
    _validate(q, k_pages, v_pages, page_indices, {"q_start": q_start, "q_lens": q_lens},
              backend=backend, sm_scale=sm_scale, soft_cap=soft_cap,
              sliding_window=sliding_window, pages_per_block=pages_per_block, q_shape=q.shape,
              k_scales=k_scales, v_scales=v_scales)
    return _attend(q, k_pages, v_pages, q_start, q_lens, page_indices, backend=backend,
                   sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                   pages_per_block=pages_per_block, k_scales=k_scales, v_scales=v_scales,
                   batch_invariant=batch_invariant)
