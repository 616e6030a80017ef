"""TPU paged-attention kernel (Mosaic): scalar-prefetched page tables, double-buffered page DMAs.

Scalar-prefetched page tables in SMEM, pages DMA'd from HBM into a two-slot VMEM buffer, one grid
step per (row, KV head, row block); `_kernel`'s docstring gives the details, quantized pages
included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.common import MASK_VALUE, attention_mask, key_range, online_softmax_update


def _kernel(
    q_start_ref,        # SMEM int32[batch]
    q_lens_ref,         # SMEM int32[batch]
    page_indices_ref,   # SMEM int32[batch * max_pages_per_seq] (flattened: 2-D SMEM pads badly)
    q_ref,              # VMEM [block_rows, head_dim]
    k_hbm_ref,          # ANY  [num_kv_heads, num_pages, page_size, head_dim]
    v_hbm_ref,          # ANY  [num_kv_heads, num_pages, page_size, head_dim]
    *refs,              # quantized: k/v scales of the row's keys, VMEM f32 [1, blocks * block_len];
                        # then o_ref VMEM [block_rows, head_dim],
                        # k_buf, v_buf VMEM [2, pages_per_block, page_size, head_dim],
                        # sems: DMA semaphores [2 (k, v), 2 (slot)],
                        # m_ref, l_ref VMEM f32[block_rows, 128]: running max and softmax
                        # denominator, replicated across lanes; acc_ref f32[block_rows, head_dim]
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
    max_pages: int,
):
    """Grid `(batch, num_kv_heads, row_blocks)`, all "parallel" (megacore may split any axis): each
    step owns one block of packed query rows (`common.pack_rows`) of one KV head, walks the live
    pages of its row `pages_per_block` pages at a time, and prefetches the next block of pages
    into the other half of a two-slot VMEM buffer while it computes on the current one. Pages
    are DMA'd straight from the pool in HBM (`memory_space=ANY`); page tables, starts and lengths
    sit in SMEM via scalar prefetch. Row blocks past a row's real tokens, and pages outside the
    causal (and sliding-window) range of a row block, are skipped. Unlike JAX's own kernel it
    does not prefetch across grid steps, so each step pays one exposed DMA latency.

    Quantized pages (int8 / float8_e4m3fn codes) come with their scales [num_kv_heads, num_pages,
    page_size]: XLA gathers each row's scales in key order first ([batch, num_kv_heads, 1, keys]: 4
    bytes per key and head, next to the key's head_dim code bytes), so a grid step holds its row's
    scales in VMEM as one lane vector and slices a block's keys from it (lane-aligned when a block is
    a multiple of 128 keys), with no per-page DMA of a few scales. The codes are widened to the
    query's dtype, the key scales multiply the scores of their keys and the value scales the
    probabilities before P.V.
    """
    if quantized:
        ks_ref, vs_ref, o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    else:
        (o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref), ks_ref, vs_ref = refs, None, None
    b, h, rb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start, q_len = q_start_ref[b], q_lens_ref[b]
    row0, first, stop = _key_block_range(rb, q_ref.shape[0], pages_per_block * k_buf.shape[2], q_start,
                                    q_len, groups=groups, sliding_window=sliding_window)
    copies = functools.partial(_page_copies, page_indices_ref, (k_hbm_ref, v_hbm_ref), (k_buf, v_buf),
                               sems, b, h, pages_per_block=pages_per_block, max_pages=max_pages)

    @pl.when(first < stop)
    def _():
        for c in copies(first, 0):
            c.start()

    attend = _block_attention(q_ref, row0, q_start, q_len, (k_buf, v_buf), (ks_ref, vs_ref),
                              (m_ref, l_ref, acc_ref), sm_scale=sm_scale, soft_cap=soft_cap,
                              sliding_window=sliding_window, groups=groups)
    lax.fori_loop(first, stop, functools.partial(_pipelined_key_block, first=first, stop=stop,
                                                 copies=copies, attend=attend), 0)
    _write_normalised(o_ref, l_ref, acc_ref)


def _key_block_range(rb, block_rows: int, block_len: int, q_start, q_len, *, groups: int,
                sliding_window: int | None):
    """Row block rb's first packed row and the key blocks [first, stop) its real tokens attend."""
    row0 = rb * block_rows
    # lax.div, not //: every operand is >= 0, and floor division lowers to sign() on Mosaic.
    begin, end = key_range(q_start, q_len, lax.div(row0, groups),
                           lax.div(row0 + block_rows - 1, groups), sliding_window=sliding_window)
    return row0, lax.div(begin, block_len), lax.div(end + block_len - 1, block_len)


def _page_copies(page_indices_ref, hbm_refs, bufs, sems, b, h, j, slot, *, pages_per_block: int,
                 max_pages: int):
    """The DMAs of key block j of row b, KV head h: each of its pages' K and V into `slot`."""
    (k_hbm_ref, v_hbm_ref), (k_buf, v_buf) = hbm_refs, bufs
    out = []
    for i in range(pages_per_block):
        # Slots past the table's end only hold positions >= every length: clamp, then mask.
        page_slot = jnp.minimum(j * pages_per_block + i, max_pages - 1)
        page = page_indices_ref[b * max_pages + page_slot]
        for ref, buf, sem in ((k_hbm_ref, k_buf, sems.at[0, slot]),
                              (v_hbm_ref, v_buf, sems.at[1, slot])):
            out.append(pltpu.make_async_copy(ref.at[h, page], buf.at[slot, i], sem))
    return out


def _pipelined_key_block(j, carry, *, first, stop, copies, attend):
    """fori_loop body: start key block j + 1's copies into the other slot, wait for block j's,
    attend to it."""
    slot = lax.rem(j - first, 2)

    @pl.when(j + 1 < stop)
    def _():
        for c in copies(j + 1, 1 - slot):
            c.start()

    for c in copies(j, slot):
        c.wait()
    attend(j, slot)
    return carry


def _block_attention(q_ref, row0, q_start, q_len, bufs, scale_refs, state_refs, *, sm_scale: float,
                     soft_cap: float | None, sliding_window: int | None, groups: int):
    """Loads the row block's queries, resets the softmax state; returns attend(j, slot), the
    online-softmax update of key block j from buffer slot `slot`."""
    (k_buf, v_buf), (ks_ref, vs_ref), (m_ref, l_ref, acc_ref) = bufs, scale_refs, state_refs
    quantized = ks_ref is not None
    block_rows, head_dim = q_ref.shape
    block_len = k_buf.shape[1] * k_buf.shape[2]
    q = q_ref[...]
    if q.dtype == jnp.float32 or k_buf.dtype == jnp.float32:
        q = q.astype(jnp.float32)
    if quantized and q.dtype not in (jnp.float32, jnp.bfloat16):
        q = q.astype(jnp.float32)  # codes widen exactly into bfloat16 or float32
    row = row0 + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    # Softmax state lives in VMEM scratch (common.online_softmax_update); the loop carries no vectors.
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(j, slot):
        k = k_buf[slot].reshape(block_len, head_dim).astype(q.dtype)
        v = v_buf[slot].reshape(block_len, head_dim)
        if quantized:
            v = v.astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [block_rows, block_len]
        if quantized:
            keys = pl.ds(pl.multiple_of(j * block_len, block_len), block_len)
            s = s * ks_ref[:, keys]  # [1, block_len]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = j * block_len + lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
        mask = attention_mask(key_pos, row, q_start, q_len, groups=groups,
                              sliding_window=sliding_window)
        online_softmax_update(s, mask, v, m_ref, l_ref, acc_ref,
                              v_scales=(lambda: vs_ref[:, keys]) if quantized else None)

    return attend


def _write_normalised(o_ref, l_ref, acc_ref) -> None:
    """The epilogue: o = acc / l, in o's dtype."""
    l = l_ref[:, :1]
    out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)  # no key -> zeros
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "groups",
                                             "pages_per_block", "block_rows"))
def paged_attention_rows(
    q: jax.Array,             # [batch, num_kv_heads, rows, head_dim] (common.pack_rows)
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    q_start: jax.Array,       # int32[batch]
    q_lens: jax.Array,        # int32[batch]
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
    block_rows: int | None = None,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Runs the Mosaic kernel; returns [batch, num_kv_heads, rows, head_dim] in q's dtype.

    `block_rows` (default: all rows up to 512) splits long prefill chunks into row blocks; it
    must be a multiple of 8 unless it covers every row. Rows are padded up to a multiple of it.
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    _, _, page_size, _ = k_pages.shape
    max_pages = page_indices.shape[1]
    if block_rows is None:
        block_rows = rows if rows <= 512 else 512
    padded_rows = pl.cdiv(rows, block_rows) * block_rows
    if padded_rows != rows:  # the extra rows are tokens past q_lens: they output zeros
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    quantized = k_scales is not None
    scales = ()
    if quantized:  # each row's scales in key order, padded to whole blocks: [batch, kv_heads, 1, keys]
        blocks = pl.cdiv(max_pages, pages_per_block)
        table = jnp.pad(page_indices, ((0, 0), (0, blocks * pages_per_block - max_pages)))
        scales = tuple(x[:, table].transpose(1, 0, 2, 3).reshape(batch, num_kv_heads, 1, -1)
                       for x in (k_scales, v_scales))
    kernel = functools.partial(_kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, groups=groups,
                               pages_per_block=pages_per_block, max_pages=max_pages)
    row_block = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, rb, *_: (b, h, rb, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    scale_spec = [pl.BlockSpec((None, None, 1, x.shape[3]), lambda b, h, rb, *_: (b, h, 0, 0)) for x in scales]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, num_kv_heads, padded_rows // block_rows),
            in_specs=[row_block] + [pl.BlockSpec(memory_space=pl.ANY)] * 2 + scale_spec,
            out_specs=row_block,
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((block_rows, 128), jnp.float32),
                            pltpu.VMEM((block_rows, 128), jnp.float32),
                            pltpu.VMEM((block_rows, head_dim), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    )(q_start, q_lens, page_indices.reshape(-1), q, k_pages, v_pages, *scales)
    return out[:, :, :rows]
