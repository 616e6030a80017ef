"""RMSNorm, the logits' soft cap, and a sum whose order is fixed by the row alone.

`fixed_order_sum` is batch-invariant mode's reduction (`EngineConfig.batch_invariant`): XLA picks
a reduction's order from the whole array's shape (on a CPU a row of 576 sums in one order at 4
rows and another at 8), so a token's norm would depend on how many tokens share its step. A
pairwise tree of elementwise adds over the last axis fixes the order by the row's length alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, as `keepdims=True`) as a pairwise tree: zero-padded to a power
    of two, then halved by elementwise adds, so each row's result is the same whatever the other
    axes' sizes (adding the zeros is exact)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, invariant: bool = False) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as Hugging Face does: `weight * x` after the
    cast (Llama), or with `offset` (Gemma: 1) `x * (offset + weight)` in float32 before it.
    `invariant`: the mean of squares by `fixed_order_sum` (batch-invariant mode)."""
    x32 = x.astype(jnp.float32)
    sq = x32 * x32
    if invariant:  # rounded before the sum (`rotary.apply_rotary`: XLA:CPU's FMA contraction varies by fusion)
        sq = jax.lax.optimization_barrier(sq)
    ms = fixed_order_sum(sq) / sq.shape[-1] if invariant else jnp.mean(sq, axis=-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt(ms + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping); x itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def log_softmax(x: jax.Array, invariant: bool = False) -> jax.Array:
    """`jax.nn.log_softmax` over the last axis; `invariant`: its normaliser by `fixed_order_sum`
    (the max is exact in any order)."""
    if not invariant:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(fixed_order_sum(jnp.exp(shifted)))


def softmax(x: jax.Array, invariant: bool = False) -> jax.Array:
    """`jax.nn.softmax` over the last axis; `invariant`: its normaliser by `fixed_order_sum`."""
    if not invariant:
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / fixed_order_sum(e)
