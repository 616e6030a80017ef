"""Attention over a contiguous per-sequence KV cache: the simple backend for offline generation.

The cache is one `(k, v)` pair per layer, each `[batch, num_kv_heads, max_len, head_dim]`; a
token at position p is written to slot p and attends to slots `0..p` (and, with a sliding
window, only the last `window` of them). Positions >= max_len mark padding: their writes drop.
A layer's `AttentionSpec` (scale, window, soft cap) overrides the attention's own window.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Callable attention over a contiguous cache (see `jserve.model.llama.Attention`).

    `stacked`: the cache is one `(k, v)` pair with a leading layer axis (`init_cache(...,
    stacked=True)`), for a scanned layer stack whose layer index is traced; else one pair per
    layer.
    """

    sliding_window: int | None = None
    stacked: bool = False

    def __call__(self, layer, q, k, v, cache, positions, spec=None):
        k_cache, v_cache = (cache[0][layer], cache[1][layer]) if self.stacked else cache[layer]
        write = jax.vmap(lambda c, new, pos: c.at[:, pos].set(new, mode="drop"))
        k_cache = write(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), positions)
        v_cache = write(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype), positions)
        if spec is None:
            out = dense_attention(q, k_cache, v_cache, positions, sliding_window=self.sliding_window)
        else:
            out = dense_attention(q, k_cache, v_cache, positions, sliding_window=spec.sliding_window,
                                  sm_scale=spec.sm_scale, soft_cap=spec.soft_cap)
        if self.stacked:
            return out, (cache[0].at[layer].set(k_cache), cache[1].at[layer].set(v_cache))
        return out, cache[:layer] + ((k_cache, v_cache),) + cache[layer + 1:]


def dense_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                    *, sliding_window: int | None = None, sm_scale: float | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Causal attention of queries at `positions` over a contiguous cache: logits
    `q.k * sm_scale` (default head_dim ** -0.5), soft-capped to `soft_cap * tanh(logits / soft_cap)`
    when given.

    Args:
      q: [batch, tokens, num_heads, head_dim].
      k_cache, v_cache: [batch, num_kv_heads, max_len, head_dim].
      positions: int32 [batch, tokens].
    Returns:
      [batch, tokens, num_heads, head_dim] in q's dtype.
    """
    B, T, H, D = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache,
                        preferred_element_type=jnp.float32) * (D ** -0.5 if sm_scale is None else sm_scale)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(S)[None, None, :]
    q_pos = positions[:, :, None]
    mask = key_pos <= q_pos  # [batch, tokens, max_len]
    if sliding_window is not None:
        mask &= key_pos > q_pos - sliding_window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no key (padding) give 0, not NaN
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)


def init_cache(num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype=jnp.float32, *, stacked: bool = False) -> tuple:
    """Zeroed `[batch, num_kv_heads, max_len, head_dim]` K and V per layer (`stacked`: one pair
    with a leading layer axis)."""
    shape = (batch, num_kv_heads, max_len, head_dim)
    if stacked:
        return (jnp.zeros((num_layers, *shape), dtype), jnp.zeros((num_layers, *shape), dtype))
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
