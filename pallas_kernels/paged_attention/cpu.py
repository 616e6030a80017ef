"""CPU paged-attention kernel: Pallas interpret mode with a coarse grid.

One grid step per batch row (`grid=(batch,)`, all KV heads at once); the whole page pool is
one block, and a `fori_loop` walks only the row's live pages, `pages_per_block` at a time,
with an online softmax in float32. Interpret mode turns this into XLA while loops that slice
only the live pages (no copy of the pool: checked in the compiled HLO), which beats a jnp
gather of the whole page table (DESIGN §5). Queries come packed as rows (`common.pack_rows`),
so one kernel serves decode and chunked prefill.
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
    o_ref,              # [num_kv_heads, rows, head_dim]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
):
    b = pl.program_id(0)
    q_start, q_len = q_start_ref[b], q_lens_ref[b]
    num_kv_heads, rows, head_dim = q_ref.shape
    page_size = k_ref.shape[2]
    max_pages = page_indices_ref.shape[1]
    block_len = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32) * sm_scale  # [kv_heads, rows, head_dim]
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    begin, end = key_range(q_start, q_len, 0, (rows - 1) // groups, sliding_window=sliding_window)

    def load(ref, j):  # -> [kv_heads, block_len, head_dim] float32
        pages = []
        for i in range(pages_per_block):
            # Slots past the table's end only hold positions >= every length: clamp, then mask.
            slot = jnp.minimum(j * pages_per_block + i, max_pages - 1)
            pages.append(ref[:, page_indices_ref[b, slot]])  # [kv_heads, page_size, head_dim]
        return jnp.concatenate(pages, axis=1).astype(jnp.float32)

    def body(j, carry):
        m, l, acc = carry  # [kv_heads, rows, 1] x2, [kv_heads, rows, head_dim]
        s = jnp.einsum("krd,ktd->krt", q, load(k_ref, j))
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
        acc = alpha * acc + jnp.einsum("krt,ktd->krd", p, load(v_ref, j))
        return m_new, l, acc

    init = (jnp.full((num_kv_heads, rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, rows, 1), jnp.float32),
            jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(begin // block_len, pl.cdiv(end, block_len), body, init)
    # Padded tokens (and rows with no key) saw no key: l == 0 -> output 0.
    o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


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
) -> jax.Array:
    """Runs the interpret-mode kernel; returns [batch, num_kv_heads, rows, head_dim] in q's dtype."""
    batch, num_kv_heads, rows, head_dim = q.shape
    kernel = functools.partial(_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, groups=groups,
                               pages_per_block=pages_per_block)
    whole = lambda x: pl.BlockSpec(x.shape, lambda b: (0,) * x.ndim)
    row_block = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b: (b, 0, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[whole(q_start), whole(q_lens), whole(page_indices), row_block,
                  whole(k_pages), whole(v_pages)],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=True,
    )(q_start, q_lens, page_indices, q, k_pages, v_pages)
