"""CPU paged-attention kernels: Pallas interpret mode with a coarse grid.

Interpret mode turns a kernel into XLA while loops; on CPU every op in a loop body costs a few
microseconds and XLA's small batched dots and gathers run far below memory bandwidth, so the
kernels do few, large steps over live pages only, and see the whole page pool as one block
(no copy of the pool: checked in the compiled HLO).
`paged_attention_rows`'s docstring gives the two kernels (decode as a work list over all rows'
live blocks, chunked prefill per row) and how quantized pages are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention.common import MASK_VALUE, attention_mask, key_range


def _kernel(
    q_start_ref,        # int32[batch]
    q_lens_ref,         # int32[batch]
    page_indices_ref,   # int32[batch, max_pages_per_seq]
    q_ref,              # [num_kv_heads, rows, head_dim]: this batch row's block
    k_ref,              # [num_kv_heads, num_pages, page_size, head_dim]: the whole pool
    v_ref,              # [num_kv_heads, num_pages, page_size, head_dim]
    *refs,              # (k_scales_ref, v_scales_ref [num_kv_heads, num_pages, page_size],)? o_ref
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
):
    *scale_refs, o_ref = refs
    ks_ref, vs_ref = scale_refs or (None, None)
    b = pl.program_id(0)
    q_start, q_len = q_start_ref[b], q_lens_ref[b]
    num_kv_heads, rows, head_dim = q_ref.shape
    page_size = k_ref.shape[2]
    max_pages = page_indices_ref.shape[1]
    block_len = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32) * sm_scale  # [kv_heads, rows, head_dim]
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    begin, end = key_range(q_start, q_len, 0, (rows - 1) // groups, sliding_window=sliding_window)

    def load(ref, j):  # -> [kv_heads, block_len, ...] (head_dim for pages; none for scales)
        pages = []
        for i in range(pages_per_block):
            # Slots past the table's end only hold positions >= every length: clamp, then mask.
            slot = jnp.minimum(j * pages_per_block + i, max_pages - 1)
            pages.append(ref[:, page_indices_ref[b, slot]])  # [kv_heads, page_size, ...]
        return jnp.concatenate(pages, axis=1).astype(jnp.float32)

    def body(j, carry):
        m, l, acc = carry  # [kv_heads, rows, 1] x2, [kv_heads, rows, head_dim]
        s = jnp.einsum("krd,ktd->krt", q, load(k_ref, j))
        if ks_ref is not None:
            s = s * load(ks_ref, j)[:, None, :]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = j * block_len + lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
        mask = attention_mask(key_pos, row, q_start, q_len, groups=groups,
                              sliding_window=sliding_window)  # [rows, block_len]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=-1, keepdims=True)
        if vs_ref is not None:
            p = p * load(vs_ref, j)[:, None, :]
        acc = alpha * acc + jnp.einsum("krt,ktd->krd", p, load(v_ref, j))
        return m_new, l, acc

    init = (jnp.full((num_kv_heads, rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, rows, 1), jnp.float32),
            jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(begin // block_len, pl.cdiv(end, block_len), body, init)
    # Padded tokens (and rows with no key) saw no key: l == 0 -> output 0.
    o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


# Decode: a work list of (row, key block) items over all rows, CHUNK items per loop step.
_CHUNK_KEYS = 2048  # keys gathered per loop step (all KV heads): ~1.5 MiB of f32 K at head_dim 64


def _decode_kernel(
    q_start_ref,        # int32[batch]
    q_lens_ref,         # int32[batch]: 0 (padded row) or 1
    page_indices_ref,   # int32[batch, max_pages_per_seq]
    q_ref,              # [batch, num_kv_heads, groups, head_dim]
    k_ref,              # [num_kv_heads, num_pages, page_size, head_dim]: the whole pool
    v_ref,              # [num_kv_heads, num_pages, page_size, head_dim]
    *refs,              # (k_scales_ref, v_scales_ref,)? o_ref [batch, num_kv_heads, groups, head_dim]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    chunk: int,
):
    *scale_refs, o_ref = refs
    batch, num_kv_heads, groups, head_dim = q_ref.shape
    _, num_pages, page_size, _ = k_ref.shape
    max_pages = page_indices_ref.shape[1]
    block_len = pages_per_block * page_size
    max_blocks = pl.cdiv(max_pages, pages_per_block)
    num_items = pl.cdiv(batch * max_blocks, chunk) * chunk  # static bound on live blocks
    q_start, q_len = q_start_ref[...], q_lens_ref[...]
    starts, count, ends, item_row, item_block = _work_list(
        q_start, q_len, block_len=block_len, max_blocks=max_blocks, num_items=num_items,
        sliding_window=sliding_window)

    table = page_indices_ref[...]
    table = jnp.pad(table, ((0, 0), (0, max_blocks * pages_per_block - max_pages)))
    table = table.reshape(batch, max_blocks, pages_per_block)
    # The pool as rows of one page of one head: a row gather moves whole pages.
    k_rows = k_ref[...].reshape(num_kv_heads * num_pages, page_size * head_dim)
    v_rows = v_ref[...].reshape(num_kv_heads * num_pages, page_size * head_dim)
    # Quantized pages: their scales as rows alike, [num_kv_heads * num_pages, page_size].
    scale_rows = [ref[...].reshape(num_kv_heads * num_pages, page_size) for ref in scale_refs]
    head_offset = lax.broadcasted_iota(jnp.int32, (1, num_kv_heads, 1), 1) * num_pages
    q = q_ref[...].astype(jnp.float32) * sm_scale
    row = lax.broadcasted_iota(jnp.int32, (1, 1, groups, 1), 2)

    def body(c, bufs):
        r = lax.dynamic_slice_in_dim(item_row, c * chunk, chunk)
        j = lax.dynamic_slice_in_dim(item_block, c * chunk, chunk)
        rows = (table[r, j][:, None, :] + head_offset).reshape(-1)  # [chunk * kv_heads * ppb]
        partials = _attend_items(r, j, rows, (q, q_start, q_len, row), (k_rows, v_rows, scale_rows),
                                 block_len=block_len, soft_cap=soft_cap, sliding_window=sliding_window)
        return tuple(lax.dynamic_update_slice_in_dim(buf, x, c * chunk, 0)
                     for buf, x in zip(bufs, partials))

    init = (jnp.full((num_items, num_kv_heads, groups, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((num_items, num_kv_heads, groups, 1), jnp.float32),
            jnp.zeros((num_items, num_kv_heads, groups, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(0, pl.cdiv(ends[-1], chunk), body, init)
    o_ref[...] = _combine_items(m, l, acc, starts, count, max_blocks).astype(o_ref.dtype)


def _work_list(q_start, q_len, *, block_len: int, max_blocks: int, num_items: int,
               sliding_window: int | None):
    """Row b's live keys [begin, end) -> its blocks first[b] .. first[b] + count[b] - 1, which
    are items starts[b] .. ends[b] - 1 of the work list; returns starts, count, ends and each
    item's row and key block."""
    begin, end = key_range(q_start, q_len, 0, 0, sliding_window=sliding_window)
    begin = jnp.broadcast_to(begin, end.shape)
    first = begin // block_len
    count = jnp.where(end > begin, pl.cdiv(end, block_len) - first, 0)
    ends = jnp.cumsum(count)
    starts = ends - count
    item = lax.broadcasted_iota(jnp.int32, (num_items, 1), 0)
    item_row = jnp.minimum(jnp.sum(item >= ends[None, :], axis=1), q_start.shape[0] - 1)
    item_block = jnp.clip(item[:, 0] - starts[item_row] + first[item_row], 0, max_blocks - 1)
    return starts, count, ends, item_row, item_block


def _attend_items(r, j, rows, queries, pool, *, block_len: int, soft_cap: float | None,
                  sliding_window: int | None):
    """A chunk of work items (item w: row r[w], key block j[w], whose pages are `rows` of the
    pool's page rows) -> each item's partial softmax: max m, sum l, unnormalised P.V acc."""
    (q, q_start, q_len, row), (k_rows, v_rows, scale_rows) = queries, pool
    chunk, (_, num_kv_heads, groups, head_dim) = r.shape[0], q.shape
    shape = (chunk, num_kv_heads, block_len, head_dim)
    k = k_rows[rows].reshape(shape).astype(jnp.float32)
    s = jnp.einsum("wkgd,wktd->wkgt", q[r], k)
    scales = [x[rows].reshape(shape[:3])[:, :, None, :] for x in scale_rows]  # [w, k, 1, t]
    if scales:
        s = s * scales[0]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = j[:, None, None, None] * block_len + lax.broadcasted_iota(
        jnp.int32, (1, 1, 1, block_len), 3)
    mask = attention_mask(key_pos, row, q_start[r][:, None, None, None],
                          q_len[r][:, None, None, None], groups=groups,
                          sliding_window=sliding_window)  # [chunk, 1, groups, block_len]
    s = jnp.where(mask, s, MASK_VALUE)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    v = v_rows[rows].reshape(shape).astype(jnp.float32)
    l = p.sum(axis=-1, keepdims=True)
    if scales:
        p = p * scales[1]
    # Multiply-then-sum lets XLA fuse the V gather into the reduction (no gathered copy).
    acc = (p[..., None] * v[:, :, None]).sum(axis=3)
    return m, l, acc


def _combine_items(m, l, acc, starts, count, max_blocks: int):
    """Each row's items merged (flash-decoding): rescaled to the row's max, summed, normalised."""
    blk = lax.broadcasted_iota(jnp.int32, (1, max_blocks), 1)
    sel = jnp.minimum(starts[:, None] + blk, m.shape[0] - 1)  # [batch, max_blocks]
    valid = (blk < count[:, None])[..., None, None, None]
    m = jnp.where(valid, m[sel], MASK_VALUE)
    w = jnp.where(valid, jnp.exp(m - m.max(axis=1, keepdims=True)), 0.0)
    l = (w * l[sel]).sum(axis=1)
    acc = (w * acc[sel]).sum(axis=1)
    # Padded rows (and rows with no key) have l == 0 -> output 0.
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "groups",
                                             "pages_per_block"))
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
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Runs the interpret-mode kernel; returns [batch, num_kv_heads, rows, head_dim] in q's dtype.

    - Decode (one token per row, `_decode_kernel`, `grid=()`): a work list of (row, key block)
      items covering only the live blocks of all rows; each loop step gathers the pages of about
      one block per row (all KV heads, one row gather) and computes a partial softmax per item;
      a flash-decoding combine merges each row's items at the end. It is faster than a kernel of
      one grid step per row and than a jnp gather of exactly the live pages, let alone of the page
      table the engine passes (max_model_len / page_size slots per row).
    - Chunked prefill (`_kernel`, `grid=(batch,)`): one grid step per batch row, a `fori_loop`
      over the row's live pages `pages_per_block` at a time, online softmax in float32; here each
      step is a real matmul (tokens x groups query rows), so per-row steps are cheap enough.

    Queries come packed as rows (`common.pack_rows`). Quantized pages (int8 / float8_e4m3fn codes)
    come with scale refs [num_kv_heads, num_pages, page_size], gathered with their pages: the key
    scales multiply the scores of their keys and the value scales the probabilities, so the codes
    are only widened, never multiplied out row by row.
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    scales = () if k_scales is None else (k_scales, v_scales)
    args = (q_start, q_lens, page_indices, q, k_pages, v_pages, *scales)
    if rows == groups:  # decode: one token per row
        return _decode_call(args, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                            pages_per_block=pages_per_block)
    kernel = functools.partial(_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, groups=groups,
                               pages_per_block=pages_per_block)
    row_block = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b: (b, 0, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[_whole(q_start), _whole(q_lens), _whole(page_indices), row_block,
                  _whole(k_pages), _whole(v_pages), *map(_whole, scales)],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=True,
    )(*args)


def _whole(x) -> pl.BlockSpec:
    """x as a single block: the whole array at every grid step."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _decode_call(args, *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                 pages_per_block: int):
    """`_decode_kernel` on the kernel's arguments `args`, in one step (`grid=()`)."""
    q, k_pages = args[3], args[4]
    # About one block per row per step (so the last step wastes less than one block per
    # row), at most _CHUNK_KEYS keys.
    chunk = max(1, min(q.shape[0], _CHUNK_KEYS // (pages_per_block * k_pages.shape[2])))
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               chunk=chunk)
    return pl.pallas_call(
        kernel,
        grid=(),
        in_specs=[_whole(x) for x in args],
        out_specs=_whole(q),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=True,
    )(*args)
