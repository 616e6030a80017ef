"""The step's rotary tables (cos and sin, computed once for all layers, LongRoPE's per-token
factors included) and their application to queries and keys; the frequencies come from
`jserve.model.rope`. Used by `jserve.model.llama.DecoderLayer` (docs/architecture.md, "The model")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig
from jserve.model.rope import LONG_ROPE_FLAG, rope_inv_freq


def rotary_tables(positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin [batch, tokens, 1, rope_dim] for `apply_rotary`, once per step for all layers;
    `inv_freq` [rope_dim / 2], or per token [batch, tokens, rope_dim / 2]; both times `scale`
    (LongRoPE's attention factor) where it is not 1.

    (Computed once: inside every layer, XLA:CPU evaluates a sin and a cos table per layer.)
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, rope_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    # The barrier materialises the tables: without it XLA fuses sin and cos into every layer's
    # rotation and evaluates them per element of q and k.
    return jax.lax.optimization_barrier((cos, sin))


def model_rotary_tables(config: ModelConfig, positions: jax.Array, local: bool = False):
    """The step's `rotary_tables` for `config` (`local`: Gemma 3's sliding layers'). With LongRoPE
    a position may carry `LONG_ROPE_FLAG` (its sequence is longer than the original context:
    `ModelConfig.long_rope`): that token rotates by the long factors, the others by the short ones,
    both times the attention factor."""
    def inv(long=False):
        return jnp.asarray(np.asarray(rope_inv_freq(config, local, long=long), np.float32))

    if local or config.long_rope_after is None:
        return rotary_tables(positions, inv())
    long = positions >= LONG_ROPE_FLAG
    per_token = jnp.where(long[..., None], inv(long=True), inv())  # [batch, tokens, rope_dim / 2]
    return rotary_tables(jnp.where(long, positions - LONG_ROPE_FLAG, positions), per_token,
                         config.rope_scaling.attention_factor)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, invariant: bool = False) -> jax.Array:
    """Rotate-half rotary embedding. x [batch, tokens, heads, head_dim]; cos, sin from rotary_tables,
    [..., rope_dim]: with rope_dim < head_dim (partial rotary) the first rope_dim dims rotate, among
    themselves, and the others pass unchanged. `invariant` (batch-invariant mode): the two products
    rounded before their sum, as XLA:CPU contracts `a * b + c` into one FMA in some fusions and not
    in others, and its fusions follow the step's shape."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply_rotary(x[..., :dim], cos, sin, invariant), x[..., dim:]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if invariant:
        a, b = jax.lax.optimization_barrier((x * cos, rotated * sin))
        return a + b
    return x * cos + rotated * sin
