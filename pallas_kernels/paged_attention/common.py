"""Helpers shared by the paged-attention kernels: query packing, key ranges and masks.

Every kernel sees queries packed as rows: `q_rows[b, h, r]` is token `r // groups` of row b,
query head `h * groups + r % groups`, at absolute position `q_start[b] + r // groups`. A
decode step is the one-token case (`q_start = lengths - 1`, `q_lens = lengths > 0`). The
masks avoid vector integer division (Mosaic lowers it poorly) by multiplying by `groups`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Quantized K/V pages: codes of one of these dtypes, with float32 scales [num_kv_heads,
# num_pages, page_size] (one per token and KV head): a key or value row is `codes * scale`.
# The value is the largest code magnitude a row's absolute maximum maps to.
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
QUANT_DTYPES = tuple(QUANT_MAX)

# Finite, so a fully masked block leaves the running max finite and exp() of the
# correction factor well defined (no inf - inf).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pack_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[batch, tokens, num_q_heads, head_dim] -> [batch, num_kv_heads, tokens * groups, head_dim]."""
    batch, tokens, num_q_heads, head_dim = q.shape
    groups = num_q_heads // num_kv_heads
    q = q.reshape(batch, tokens, num_kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return q.reshape(batch, num_kv_heads, tokens * groups, head_dim)


def unpack_rows(o: jax.Array, tokens: int) -> jax.Array:
    """Inverse of `pack_rows` (extra padded rows past tokens * groups are dropped)."""
    batch, num_kv_heads, rows, head_dim = o.shape
    groups = rows // tokens
    o = o[:, :, :tokens * groups].reshape(batch, num_kv_heads, tokens, groups, head_dim)
    return o.transpose(0, 2, 1, 3, 4).reshape(batch, tokens, num_kv_heads * groups, head_dim)


def key_range(q_start, q_len, first_token, last_token, *, sliding_window: int | None):
    """[begin, end) of key positions attended by tokens first_token..last_token of a row.

    Tokens at or past q_len are padding and attend nothing; an empty range has end <= begin.
    """
    last_token = jnp.minimum(last_token, q_len - 1)
    end = jnp.where(first_token <= last_token, q_start + last_token + 1, 0)
    if sliding_window is None:
        return jnp.int32(0), end
    return jnp.maximum(q_start + first_token - sliding_window + 1, 0), end


def attention_mask(key_pos, row, q_start, q_len, *, groups: int, sliding_window: int | None):
    """Which (row, key) pairs attend: causal, in the window, and the row's token is real.

    Args:
      key_pos: int32 [1, keys] absolute key positions.
      row: int32 [rows, 1] packed row numbers (token = row // groups).
    Returns:
      bool [rows, keys].
    """
    rel = key_pos - q_start  # key position relative to the row's first token
    mask = (rel * groups <= row) & (row < q_len * groups)  # key <= token's position; real token
    if sliding_window is not None:
        mask &= row < (rel + sliding_window) * groups  # position - key < sliding_window
    return mask


def dequantize(codes: jax.Array, scales: jax.Array | None) -> jax.Array:
    """float32 rows from pages (`scales` None: float pages) or codes [..., head_dim] and their
    scales [...]."""
    x = codes.astype(jnp.float32)
    return x if scales is None else x * scales[..., None]


def online_softmax_update(s, mask, v, m_ref, l_ref, acc_ref, rows=..., v_scales=None) -> None:
    """One key block of the TPU kernels' online softmax (float32, in VMEM scratch).

    s: scores [rows, keys]; mask: which of them attend; v: the block's values [keys, head_dim];
    m_ref, l_ref: running max and denominator [.., 128], replicated across lanes (the layout
    JAX's ragged paged attention uses); acc_ref [.., head_dim]; `rows` indexes all three.
    v_scales: None (float pages), or a function loading the value scales [1, keys] of quantized
    pages, called where they multiply the probabilities (after the denominator's update).
    """
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[rows]
    m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    m_ref[rows] = m_next
    l_ref[rows] = alpha * l_ref[rows] + p.sum(axis=-1, keepdims=True)
    if v_scales is not None:
        p = p * v_scales()
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_ref[rows] = alpha[:, :1] * acc_ref[rows] + pv
