"""Flax NNX decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

Per-layer weights are stacked along a leading `num_layers` axis (one array per weight kind),
which keeps checkpoints to a few dozen arrays and makes a layer scan possible. Attention over
the KV cache is delegated to an `Attention` backend passed in by the caller, so the same model
runs over a contiguous cache (offline generation) or a paged one (the engine).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.config import ModelConfig, rope_inv_freq


class Attention(Protocol):
    """Writes a layer's new K/V into its cache and attends the queries over it."""

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any,
                 meta: Any) -> tuple[jax.Array, Any]:
        """q [batch, tokens, num_heads, head_dim]; k, v [batch, tokens, num_kv_heads, head_dim].

        Returns the attention output [batch, tokens, num_heads, head_dim] and the updated cache.
        """
        ...


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as Hugging Face does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rotary_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [batch, tokens, 1, head_dim] for `apply_rotary`, once per step for all layers.

    (Computed inside every layer, XLA:CPU evaluated 60 sin/cos tables per SmolLM2 decode step:
    1.4 % of the step's CPU time in libm's sincosf.)
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, head_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    # The barrier materialises the tables: without it XLA fuses sin and cos into every layer's
    # rotation and evaluates them per element of q and k.
    return jax.lax.optimization_barrier((jnp.cos(emb), jnp.sin(emb)))


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding. x [batch, tokens, heads, head_dim]; cos, sin from rotary_tables."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float | None = 0.02) -> nnx.Param:
    if scale is None:  # norm weights
        return nnx.Param(jnp.ones(shape, dtype))
    if scale == 0.0:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


_GLOBAL = ("embed", "final_norm", "lm_head")


class DecoderLayer(nnx.Module):
    """One layer's weights (the forward pass lives in `LlamaModel.__call__`)."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs):
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        qd, kvd = c.num_heads * hd, c.num_kv_heads * hd
        self.attn_norm = _param(rngs, (D,), dtype, None)
        self.wq = _param(rngs, (D, qd), dtype)
        self.wk = _param(rngs, (D, kvd), dtype)
        self.wv = _param(rngs, (D, kvd), dtype)
        self.wo = _param(rngs, (qd, D), dtype)
        if c.qkv_bias:
            self.bq = _param(rngs, (qd,), dtype, 0.0)
            self.bk = _param(rngs, (kvd,), dtype, 0.0)
            self.bv = _param(rngs, (kvd,), dtype, 0.0)
        if c.o_bias:
            self.bo = _param(rngs, (D,), dtype, 0.0)
        if c.qk_norm:
            self.q_norm = _param(rngs, (hd,), dtype, None)
            self.k_norm = _param(rngs, (hd,), dtype, None)
        self.mlp_norm = _param(rngs, (D,), dtype, None)
        self.w_gate = _param(rngs, (D, F), dtype)
        self.w_up = _param(rngs, (D, F), dtype)
        self.w_down = _param(rngs, (F, D), dtype)
        if c.mlp_bias:
            self.b_gate = _param(rngs, (F,), dtype, 0.0)
            self.b_up = _param(rngs, (F,), dtype, 0.0)
            self.b_down = _param(rngs, (D,), dtype, 0.0)


LAYER_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def xla_linear(x: jax.Array, w, out_features):
    """x [..., in] @ w [in, out]: the layer matmuls' default (an XLA dot); a tuple of weights (and
    of widths) gives the tuple of products."""
    return tuple(x @ wi for wi in w) if isinstance(w, tuple) else x @ w


def embed_rows(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """The embedding rows of `tokens`, from the table as the params hold it: [vocab, hidden], or,
    where the runner's native CPU head reads it, its transpose packed as [vocab / P, hidden, P]
    panels (`pallas_kernels.matmul.native.pack(embed.T)`: token t is panel t // P, lane t % P)."""
    if embed.ndim == 3:
        lanes = embed.shape[2]
        return embed[tokens // lanes, :, tokens % lanes]
    return embed[tokens]


def xla_tied_head(x: jax.Array, embed: jax.Array) -> jax.Array:
    """Float32 logits [rows, vocab] = x [rows, hidden] @ embed [vocab, hidden].T, as an XLA dot.

    Written E @ x.T, not x @ E.T: at one row XLA:CPU runs the former as a matrix-vector product
    over E's contiguous rows (5 ms for SmolLM2's 113 MB E) and the latter as a transposing copy
    fused with the dot (17 ms); from two rows on both become the same dot.
    """
    flat = jax.lax.dot_general(embed, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return flat.T


class LlamaModel(nnx.Module):
    """Decoder-only transformer; `__call__` returns float32 logits and the updated cache.

    Each layer's weights are separate arrays (`layers[i].wq`, ...): slicing one stacked array per
    layer inside the step made XLA copy every weight on each call (*measured* 4.4x slower for 30
    matmuls on CPU). Checkpoints store them stacked; `model_params` converts.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        c = config
        self.config = c
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(c, dtype, rngs) for _ in range(c.num_layers)])
        self.final_norm = _param(rngs, (c.hidden_size,), dtype, None)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Any, meta: Any,
                 attention: Attention, *, logits_index: jax.Array | None = None,
                 tied_head: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                 linear: Callable[[jax.Array, jax.Array, int], jax.Array] | None = None,
                 decoder_layers: Callable[..., tuple[jax.Array, Any] | None] | None = None
                 ) -> tuple[jax.Array, Any]:
        """Run the decoder.

        Args:
          tokens: int32 [batch, tokens].
          positions: int32 [batch, tokens], absolute positions (rotary and causal mask).
          cache, meta: the attention backend's KV state and per-step metadata.
          attention: the backend that writes K/V and attends.
          logits_index: optional int32 [batch, n]: only these token positions get logits
            (decode and prefill need just the last one; prompt logprobs need all).
          tied_head: with tied embeddings, computes float32 logits [rows, vocab] from the final
            hidden states [rows, hidden] and the embedding as the params hold it (default
            `xla_tied_head`, for [vocab, hidden]; the runner's native CPU head reads it packed,
            see `embed_rows`).
          linear: computes `x @ w` for the layer weights named in `LAYER_MATMULS`, given x
            [..., in], the weight as the params hold it and the output width; given a tuple of
            weights and one of widths (q/k/v, gate/up: the products of one x), the tuple of
            products (default `xla_linear`; the runner's native CPU path holds them packed and
            runs a tuple as one call, see `pallas_kernels.matmul.native`).
          decoder_layers: optionally runs all the layers instead of the code below:
            `decoder_layers(layers, x, cos, sin, cache, meta)` with the layers' weights, the
            hidden states [batch, tokens, hidden] and `rotary_tables`' cos and sin, returns
            (x, cache), or None for a step it does not take (the runner's native CPU decode
            layers, `jserve.cpu_kernels.native_decoder_layers`).
        Returns:
          float32 logits [batch, tokens or n, vocab] and the new cache.
        """
        c = self.config
        B, T = tokens.shape
        lin = linear or xla_linear
        D, F, qd, kvd = (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim,
                         c.num_kv_heads * c.head_dim)
        x = embed_rows(self.embed[...], tokens)  # [batch, tokens, hidden]
        cos, sin = rotary_tables(positions, jnp.asarray(np.asarray(rope_inv_freq(c), np.float32)))
        fused = decoder_layers(self.layers, x, cos, sin, cache, meta) if decoder_layers else None
        for i, w in enumerate(self.layers if fused is None else ()):
            h = rms_norm(x, w.attn_norm[...], c.rms_norm_eps)
            q, k, v = lin(h, (w.wq[...], w.wk[...], w.wv[...]), (qd, kvd, kvd))
            if c.qkv_bias:
                q, k, v = q + w.bq[...], k + w.bk[...], v + w.bv[...]
            q = q.reshape(B, T, c.num_heads, c.head_dim)
            k = k.reshape(B, T, c.num_kv_heads, c.head_dim)
            v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, w.q_norm[...], c.rms_norm_eps)
                k = rms_norm(k, w.k_norm[...], c.rms_norm_eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            attn, cache = attention(i, q, k, v, cache, meta)
            out = lin(attn.reshape(B, T, qd), w.wo[...], D)
            if c.o_bias:
                out = out + w.bo[...]
            x = x + out
            h = rms_norm(x, w.mlp_norm[...], c.rms_norm_eps)
            gate, up = lin(h, (w.w_gate[...], w.w_up[...]), (F, F))
            if c.mlp_bias:
                gate, up = gate + w.b_gate[...], up + w.b_up[...]
            down = lin(jax.nn.silu(gate) * up, w.w_down[...], D)
            if c.mlp_bias:
                down = down + w.b_down[...]
            x = x + down
        if fused is not None:
            x, cache = fused
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[..., None], axis=1)
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        if c.tie_word_embeddings:
            n = x.shape[1]
            logits = (tied_head or xla_tied_head)(x.reshape(B * n, -1), self.embed[...]).reshape(B, n, -1)
        else:
            logits = jnp.dot(x, self.lm_head[...], preferred_element_type=jnp.float32)
        return logits, cache


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight as stored in checkpoints (per-layer weights stacked on axis 0)."""
    model = nnx.eval_shape(lambda: LlamaModel(config, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shapes = {k: tuple(v.shape) for k, v in pure.items() if k != "layers"}
    for name, v in pure["layers"][0].items():
        shapes[name] = (config.num_layers, *v.shape)
    return shapes


def model_params(config: ModelConfig, stacked: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint layout (stacked per-layer weights) -> the model's state for `nnx.merge`."""
    layer_names = [k for k in stacked if k not in _GLOBAL]
    out: dict[str, Any] = {k: stacked[k] for k in _GLOBAL if k in stacked}
    out["layers"] = {i: {k: stacked[k][i] for k in layer_names} for i in range(config.num_layers)}
    return out


def model_graphdef(config: ModelConfig):
    """The model's structure without weights (for `nnx.merge(graphdef, model_params(...))`)."""
    return nnx.graphdef(nnx.eval_shape(lambda: LlamaModel(config)))
