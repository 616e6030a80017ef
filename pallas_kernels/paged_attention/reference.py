"""Pure-jnp references for paged attention: gather each row's pages, then dense masked softmax.

These define the semantics the kernels must match (and serve as `backend="reference"`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.common import dequantize


def _gather_pages(pages: jax.Array, page_indices: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    """[num_kv_heads, num_pages, page_size, head_dim] (codes with `scales` [num_kv_heads,
    num_pages, page_size] when quantized) -> float32 [batch, num_kv_heads, max_len, head_dim]."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    batch, max_pages = page_indices.shape
    # [kv_heads, batch, max_pages, page_size, head_dim]
    gathered = dequantize(pages[:, page_indices], None if scales is None else scales[:, page_indices])
    gathered = gathered.reshape(num_kv_heads, batch, max_pages * page_size, head_dim)
    return gathered.transpose(1, 0, 2, 3)


def paged_prefill_attention_reference(
    q: jax.Array,             # [batch, tokens, num_q_heads, head_dim]
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    q_start: jax.Array,       # int32[batch]: absolute position of q[b, 0]
    q_lens: jax.Array,        # int32[batch]: real tokens of row b; the rest output zeros
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a chunk of queries over paged K/V (the chunk's own K/V already paged).

    Query token t of row b sits at position p = q_start[b] + t and attends keys k with
    k <= p (and p - k < sliding_window when a window is set). Logits are `q.k * sm_scale`,
    then `soft_cap * tanh(logits / soft_cap)` when a soft cap is set. Rows/tokens with no
    key to attend (t >= q_lens[b]) output zeros. Returns [batch, tokens, num_q_heads, head_dim]
    in q's dtype; all arithmetic in float32. Quantized pages (int8 or float8_e4m3fn codes) come
    with their scales: key row `k_pages[h, p, s] * k_scales[h, p, s]`, values alike.
    """
    batch, tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    k = _gather_pages(k_pages, page_indices, k_scales)  # [batch, kv_heads, max_len, head_dim]
    v = _gather_pages(v_pages, page_indices, v_scales)
    qg = q.astype(jnp.float32).reshape(batch, tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key_pos = jnp.arange(k.shape[2])[None, None, :]
    token = jnp.arange(tokens)[None, :, None]
    q_pos = q_start[:, None, None] + token  # [batch, tokens, 1]
    mask = (key_pos <= q_pos) & (token < q_lens[:, None, None])  # [batch, tokens, max_len]
    if sliding_window is not None:
        mask &= key_pos > q_pos - sliding_window
    mask = mask[:, None, None]  # [batch, 1, 1, tokens, max_len]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bksd->btkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_attention_reference(
    q: jax.Array,             # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    lengths: jax.Array,       # int32[batch]; 0 marks a padded row (output zeros)
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Decode attention: the query of row b sits at position lengths[b] - 1.

    Returns [batch, num_q_heads, head_dim] in q's dtype.
    """
    q_lens = (lengths > 0).astype(jnp.int32)
    q_start = jnp.maximum(lengths - 1, 0)
    out = paged_prefill_attention_reference(
        q[:, None], k_pages, v_pages, q_start, q_lens, page_indices,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        k_scales=k_scales, v_scales=v_scales)
    return out[:, 0]
