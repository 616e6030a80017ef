"""Flax NNX decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3) and Gemma 2 / 3.

`DecoderLayer` is the one definition of a layer; `LlamaModel` embeds, runs the layer stack and
the head. Gemma's and Phi-3's differences are config-driven branches of the same layer
(`ModelConfig`; docs/architecture.md, "The model"). How each operation runs (XLA dots or native
kernels, the stack unrolled, scanned or fused) is the caller's `ModelOps`
(`jserve.runtime.backends`); attention over the KV cache is its `Attention`, so the same model
runs over a contiguous cache (offline generation, `XlaOps`) or a paged one (the engine).
Checkpoints stack per-layer weights along a leading `num_layers` axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.model import lora as lora_slots
from jserve.model import moe, quant
from jserve.model.config import LAYER_MATMULS, ModelConfig
from jserve.model.norms import rms_norm, soft_cap
from jserve.model.rotary import apply_rotary, model_rotary_tables


class AttentionSpec(NamedTuple):
    """One layer's attention settings, static (Python values: the kernels compile them in):
    logits `q.k * sm_scale`, then `soft_cap * tanh(logits / soft_cap)` when set, over the last
    `sliding_window` keys when set."""

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None


class Attention(Protocol):
    """Writes a layer's new K/V into its cache and attends the queries over it."""

    def __call__(self, layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any,
                 meta: Any, spec: AttentionSpec | None = None) -> tuple[jax.Array, Any]:
        """q [batch, tokens, num_heads, head_dim]; k, v [batch, tokens, num_kv_heads, head_dim];
        `layer` the layer's index (a Python int, or a traced int32 inside a scanned stack);
        `spec` the layer's settings (`DecoderLayer` always gives them; None: head_dim ** -0.5,
        the attention's own sliding window, no soft cap).

        Returns the attention output [batch, tokens, num_heads, head_dim] and the updated cache.
        """
        ...


class ModelOps(Protocol):
    """What runs the model's operations: a backend's choice (`jserve.runtime.backends`) or `XlaOps`.

    The model is the one definition of the computation; an implementation decides how the
    layer matmuls, the embedding and head, attention and the layer stack are executed.
    """

    attention: Attention
    lora_ids: Any  # int32 [batch, tokens]: each token's LoRA slot (`jserve.model.lora`); None: no adapters
    batch_invariant: bool  # norms by `norms.fixed_order_sum` (`EngineConfig.batch_invariant`)

    def linear(self, x: jax.Array, w: Any, out_features: Any) -> Any:
        """x [..., in] @ w for a layer weight as the params hold it; given a tuple of weights (and
        of widths), the tuple of products of the one x."""
        ...

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """The embedding rows of `tokens` from the table as the params hold it."""
        ...

    def head(self, x: jax.Array, table: jax.Array, tied: bool) -> jax.Array:
        """Float32 logits [rows, vocab] from hidden states [rows, hidden]: `table` is the
        embedding (tied, as the params hold it) or `lm_head` [hidden, vocab]."""
        ...

    def lora(self, x: jax.Array, ids: jax.Array, a: jax.Array, bs: tuple, outs: tuple) -> tuple:
        """`outs` (a group's base linears over x) plus each token's LoRA delta, by its slot in
        `ids` (`jserve.model.lora.dense_delta`'s contract: A [in, G, S, r], B_g [S, r, out])."""
        ...

    def run_layers(self, layers: Any, x: jax.Array, cos: Any, sin: Any, cache: Any,
                   meta: Any) -> tuple[jax.Array, Any]:
        """Apply every decoder layer in turn (`unrolled_layers`, `scanned_layers` or a fused
        implementation of the same contract). `cos`, `sin`: `rotary_tables`' arrays, or for a
        model whose sliding layers rotate by their own base (Gemma 3) a pair (full, sliding)."""
        ...

    def with_attention(self, attention: Attention) -> "ModelOps":
        """The same operations with another attention (and cache), e.g. a contiguous one."""
        ...


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float | None = 0.02) -> nnx.Param:
    if scale is None:  # norm weights
        return nnx.Param(jnp.ones(shape, dtype))
    if scale == 0.0:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


def _w(variable: nnx.Variable) -> Any:
    return variable.get_value()  # an array, or a pytree such as a `QuantizedWeight`


_GLOBAL = ("embed", "final_norm", "lm_head")
LAYOUTS = ("list", "stacked")  # per-layer weights: one module per layer, or one with a layer axis


class DecoderLayer(nnx.Module):
    """One layer's weights and its forward pass: the one definition of a layer.

    With `stack` L the weights carry a leading layer axis of L (the checkpoint layout), for a
    stack that scans over them (`scanned_layers`); a scanned step sees one layer's slice.
    """

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, stack: int | None = None,
                 lora: lora_slots.LoraSpec | None = None):
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        qd, kvd = c.num_heads * hd, c.num_kv_heads * hd
        lead = () if stack is None else (stack,)
        norm = None if not c.norm_offset else 0.0  # a norm's weight scales by norm_offset + weight

        def param(shape, scale: float | None = 0.02):
            return _param(rngs, lead + shape, dtype, norm if scale is None else scale)

        self.config = c
        self.attn_norm = param((D,), None)
        self.wq, self.wk, self.wv, self.wo = param((D, qd)), param((D, kvd)), param((D, kvd)), param((qd, D))
        if c.qkv_bias:
            self.bq, self.bk, self.bv = param((qd,), 0.0), param((kvd,), 0.0), param((kvd,), 0.0)
        if c.o_bias:
            self.bo = param((D,), 0.0)
        if c.qk_norm:
            self.q_norm, self.k_norm = param((hd,), None), param((hd,), None)
        self.mlp_norm = param((D,), None)
        if c.post_norms:
            self.attn_post_norm, self.mlp_post_norm = param((D,), None), param((D,), None)
        if c.moe:  # a mixture of experts instead of the dense MLP (jserve.model.moe)
            moe.init_params(self, c, param)
        else:
            self.w_gate, self.w_up, self.w_down = param((D, F)), param((D, F)), param((F, D))
        if c.mlp_bias:
            self.b_gate, self.b_up, self.b_down = param((F,), 0.0), param((F,), 0.0), param((D,), 0.0)
        if lora is not None:  # adapter slots beside the target linears (`jserve.model.lora`)
            for name, shape in lora_slots.slot_shapes(c, lora).items():
                setattr(self, name, param(shape, 0.0))

    def matmul_weights(self) -> tuple[Any, ...]:
        return tuple(_w(getattr(self, name)) for name in LAYER_MATMULS)  # as the params hold them

    def __call__(self, x: jax.Array, cos: Any, sin: Any, cache: Any, layer: Any, meta: Any,
                 ops: ModelOps, sliding: bool | None = None) -> tuple[jax.Array, Any]:
        """x [batch, tokens, hidden] -> the layer's output and the cache with its K/V written.

        `layer` is the layer's index for `ops.attention` (an int, or traced inside a scan).
        `sliding`: whether this is a sliding-window layer, static; None reads it from the config
        by `layer`, which must then be an int where the layers are of two kinds
        (`ModelConfig.mixed_layers`: a scanned stack passes each layer's kind, `scanned_layers`).
        `cos`, `sin`: a table each, or pairs (full layers', sliding layers') for a model whose
        sliding layers have their own rotary base.
        """
        c = self.config
        sliding = self._is_sliding(layer) if sliding is None else sliding
        if isinstance(cos, tuple):
            cos, sin = cos[int(sliding)], sin[int(sliding)]
        spec = AttentionSpec(c.attention_scale, c.sliding_window if sliding else None, c.attn_logit_softcap)
        out, cache = self._attention(x, cos, sin, cache, layer, meta, ops, spec)
        x = x + out
        return x + self._mlp(self._norm(x, self.mlp_norm, ops), ops), cache

    def _is_sliding(self, layer: Any) -> bool:
        """Whether layer `layer` is a sliding-window one, by the config."""
        c = self.config
        if c.mixed_layers and not isinstance(layer, int):
            raise ValueError("a layer of a stack with sliding and full layers needs its kind "
                             "(sliding=...) when its index is traced")
        return c.layer_is_sliding(layer if isinstance(layer, int) else 0)

    def _norm(self, h: jax.Array, weight: nnx.Param, ops: ModelOps) -> jax.Array:
        c = self.config
        return rms_norm(h, weight[...], c.rms_norm_eps, c.norm_offset, ops.batch_invariant)

    def _linear(self, ops: ModelOps, x: jax.Array, names: tuple[str, ...], widths: tuple[int, ...]):
        """The products of x and the named weights (`ops.linear`; one weight alone, several as one
        call), each plus its tokens' LoRA deltas where the step has adapters (`ops.lora_ids`)."""
        weights = tuple(_w(getattr(self, n)) for n in names)
        outs = ops.linear(x, weights, widths) if len(names) > 1 else (ops.linear(x, weights[0], widths[0]),)
        return outs if ops.lora_ids is None else lora_slots.apply(self, names, x, outs, ops.lora_ids, ops)

    def _attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: Any, layer: Any,
                   meta: Any, ops: ModelOps, spec: AttentionSpec) -> tuple[jax.Array, Any]:
        """The attention block's output (before the residual) and the cache with its K/V written."""
        c = self.config
        B, T, _ = x.shape
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = self._norm(x, self.attn_norm, ops)
        q, k, v = self._linear(ops, h, ("wq", "wk", "wv"), (qd, kvd, kvd))
        if c.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(B, T, c.num_heads, c.head_dim)
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self._norm(q, self.q_norm, ops)
            k = self._norm(k, self.k_norm, ops)
        q = apply_rotary(q, cos, sin, ops.batch_invariant)
        k = apply_rotary(k, cos, sin, ops.batch_invariant)
        attn, cache = ops.attention(layer, q, k, v, cache, meta, spec)
        (out,) = self._linear(ops, attn.reshape(B, T, qd), ("wo",), (c.hidden_size,))
        if c.o_bias:
            out = out + self.bo[...]
        if c.post_norms:
            out = self._norm(out, self.attn_post_norm, ops)
        return out, cache

    def _mlp(self, h: jax.Array, ops: ModelOps) -> jax.Array:
        """The MLP block's output (before the residual) from its normed input `h`: the dense MLP or
        the mixture of experts."""
        c = self.config
        D, F = c.hidden_size, c.intermediate_size
        if c.moe:
            down = moe.moe_mlp(self, h, ops)
        else:
            gate, up = self._linear(ops, h, ("w_gate", "w_up"), (F, F))
            if c.mlp_bias:
                gate, up = gate + self.b_gate[...], up + self.b_up[...]
            act = jax.nn.silu(gate) if c.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
            (down,) = self._linear(ops, act * up, ("w_down",), (D,))
            if c.mlp_bias:
                down = down + self.b_down[...]
        if c.post_norms:
            down = self._norm(down, self.mlp_post_norm, ops)
        return down


def unrolled_layers(layers: Any, x, cos, sin, cache, meta, ops: ModelOps):
    """The stack as a Python loop over a list of layers (one traced copy of the layer each)."""
    for i, layer in enumerate(layers):
        x, cache = layer(x, cos, sin, cache, i, meta, ops)
    return x, cache


def scanned_layers(layers: DecoderLayer, x, cos, sin, cache, meta, ops: ModelOps):
    """The stack as `jax.lax.scan` over one `DecoderLayer` with stacked weights: one traced copy
    of the layer whatever the depth. The cache rides in the carry, whole; `ops.attention` must
    address a layer's pages inside it by the traced index (see `jserve.runtime.backends.xla`).

    Sliding and full layers interleaved (Gemma 2 / 3): a layer's window and rotary base are static
    (the attention kernels compile the window in), so the scan runs groups of
    `config.layer_period()` layers (2 for Gemma 2, 6 for Gemma 3), each group one traced copy of
    each of its layers with its kind fixed; the layers after the last whole group (Gemma 3 1B's
    26 = 4 x 6 + 2) run after the scan, one traced copy each. The compiled step grows with the
    period, not the depth (a traced window would need the kernels to take it at run time)."""
    graphdef, state = nnx.split(layers)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    config = layers.config
    if not config.mixed_layers:
        def body(carry, xs):
            h, kv = carry
            weights, i = xs
            return nnx.merge(graphdef, weights)(h, cos, sin, kv, i, meta, ops), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), (state, jnp.arange(num_layers, dtype=jnp.int32)))
        return x, cache

    period = config.layer_period()
    groups = num_layers // period

    def layer(i):  # layer i's weights (i traced or an int), sliced out of the stack
        return nnx.merge(graphdef, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), state))

    def group(carry, g):
        h, kv = carry
        for j in range(period):
            i = g * period + j
            h, kv = layer(i)(h, cos, sin, kv, i, meta, ops, sliding=config.layer_is_sliding(j))
        return (h, kv), None

    (x, cache), _ = jax.lax.scan(group, (x, cache), jnp.arange(groups, dtype=jnp.int32))
    for i in range(groups * period, num_layers):
        x, cache = layer(i)(x, cos, sin, cache, i, meta, ops)
    return x, cache


def xla_linear(x: jax.Array, w, out_features):
    """x [..., in] @ w [in, out]: the layer matmuls' default (an XLA dot, or
    `quant.xla_quantized_linear` for a `QuantizedWeight`); a tuple of weights (and of widths) gives
    the tuple of products."""
    if isinstance(w, tuple):
        return tuple(xla_linear(x, wi, n) for wi, n in zip(w, out_features))
    if quant.is_quantized(w):
        return quant.xla_quantized_linear(x, w)
    return x @ w


def xla_tied_head(x: jax.Array, embed: jax.Array) -> jax.Array:
    """Float32 logits [rows, vocab] = x [rows, hidden] @ embed [vocab, hidden].T, as an XLA dot.
    Written E @ x.T: at one row XLA:CPU runs x @ E.T as a slower transposing copy fused with the dot."""
    flat = jax.lax.dot_general(embed, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return flat.T


@dataclasses.dataclass(frozen=True)
class XlaOps:
    """`ModelOps` as plain XLA: dots, a table lookup, and the stack unrolled or scanned."""

    attention: Attention
    scan: bool = False  # the layers as `scanned_layers` (stacked weights) instead of unrolled
    # Mixture-of-experts layers (jserve.model.moe): the grouped matmul ("ragged_dot" or
    # "gather") and the mesh whose ep / tp axes split the experts (None: one device).
    grouped_matmul: str = "ragged_dot"
    mesh: Any = None
    lora_ids: Any = None  # `ModelOps.lora_ids`: set inside a step (`jserve.runtime.device_steps`)
    batch_invariant: bool = False  # `ModelOps.batch_invariant`

    def linear(self, x, w, out_features):
        return xla_linear(x, w, out_features)

    def embed(self, table, tokens):
        if quant.is_quantized(table):  # held as its transpose [hidden, vocab]
            return quant.embed_rows(table, tokens, jnp.float32)
        return table[tokens]

    def head(self, x, table, tied):
        if quant.is_quantized(table):  # lm_head, or a tied embedding held as [hidden, vocab]
            return quant.xla_quantized_linear(x, table, jnp.float32)
        if tied:
            return xla_tied_head(x, table)
        return jnp.dot(x, table, preferred_element_type=jnp.float32)

    def lora(self, x, ids, a, bs, outs):
        return lora_slots.dense_delta(x, ids, a, bs, outs)

    def run_layers(self, layers, x, cos, sin, cache, meta):
        return (scanned_layers if self.scan else unrolled_layers)(layers, x, cos, sin, cache, meta, self)

    def with_attention(self, attention: Attention) -> "XlaOps":
        """These operations over another cache (a contiguous one: no fused native stack)."""
        return dataclasses.replace(self, attention=attention)


class LlamaModel(nnx.Module):
    """Decoder-only transformer; `__call__` returns float32 logits and the updated cache.

    `layout` "list" holds each layer's weights as separate arrays (`layers[i].wq`, ...), for a
    stack that runs unrolled or as a fused native call; "stacked" holds one `DecoderLayer` whose
    weights carry a leading layer axis (the checkpoint layout), for `scanned_layers`.
    `model_params` converts a checkpoint into either.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 layout: str = "list", lora: lora_slots.LoraSpec | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        rngs = rngs or nnx.Rngs(0)
        c = config
        self.config = c
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), dtype)
        if layout == "stacked":
            self.layers = DecoderLayer(c, dtype, rngs, stack=c.num_layers, lora=lora)
        else:
            self.layers = nnx.List([DecoderLayer(c, dtype, rngs, lora=lora) for _ in range(c.num_layers)])
        self.final_norm = _param(rngs, (c.hidden_size,), dtype, 0.0 if c.norm_offset else None)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Any, meta: Any, ops: ModelOps, *,
                 logits_index: jax.Array | None = None, hidden: bool = False) -> tuple[jax.Array, Any]:
        """Run the decoder.

        Args:
          tokens: int32 [batch, tokens].
          positions: int32 [batch, tokens], absolute positions for the rotary embedding (the
            attention's own come in `meta`), with LongRoPE's `LONG_ROPE_FLAG` added where a token
            rotates by the long factors (`model_rotary_tables`).
          cache, meta: the attention's KV state and per-step metadata.
          ops: how the operations run (`ModelOps`: a backend's, or `XlaOps`).
          logits_index: optional int32 [batch, n]: only these token positions get logits
            (decode and prefill need just the last one; prompt logprobs need all).
          hidden: return the final hidden states (after the final norm, before the head) instead
            of logits: what an embedding model pools (`jserve.runtime.pooled_steps`).
        Returns:
          float32 logits [batch, tokens or n, vocab] (or hidden states [..., hidden]) and the new cache.
        """
        c = self.config
        B = tokens.shape[0]
        # [batch, tokens, hidden], in the float weights' dtype (a quantized table's rows come as float32)
        x = ops.embed(_w(self.embed), tokens).astype(self.final_norm[...].dtype)
        if c.embed_scale:  # Gemma: sqrt(hidden) in the activations' dtype, as Hugging Face rounds it
            x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)

        cos, sin = model_rotary_tables(c, positions)
        if c.rope_local_theta is not None:  # Gemma 3: the sliding layers' own base, (full, sliding)
            local_cos, local_sin = model_rotary_tables(c, positions, local=True)
            cos, sin = (cos, local_cos), (sin, local_sin)
        x, cache = ops.run_layers(self.layers, x, cos, sin, cache, meta)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[..., None], axis=1)
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps, c.norm_offset, ops.batch_invariant)
        if hidden:
            return x.astype(jnp.float32), cache
        n = x.shape[1]
        table = _w(self.embed) if c.tie_word_embeddings else _w(self.lm_head)
        logits = soft_cap(ops.head(x.reshape(B * n, -1), table, c.tie_word_embeddings), c.final_logit_softcap)
        return logits.reshape(B, n, -1), cache


def _layer_slice(w: Any, i: int) -> Any:
    """Layer i of a stacked weight (an array, or every array of a `QuantizedWeight`)."""
    return jax.tree.map(lambda a: a[i], w)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight as stored in checkpoints (per-layer weights stacked on axis 0)."""
    model = nnx.eval_shape(lambda: LlamaModel(config, rngs=nnx.Rngs(0), layout="stacked"))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shapes = {k: tuple(v.shape) for k, v in pure.items() if k != "layers"}
    shapes.update({name: tuple(v.shape) for name, v in pure["layers"].items()})
    return shapes


def model_params(config: ModelConfig, stacked: dict[str, Any], layout: str = "list") -> dict[str, Any]:
    """Checkpoint layout (stacked per-layer weights) -> the model's state for `nnx.merge` with
    `model_graphdef(config, layout)`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    layer_names = [k for k in stacked if k not in _GLOBAL]
    out: dict[str, Any] = {k: stacked[k] for k in _GLOBAL if k in stacked}
    if layout == "stacked":
        out["layers"] = {k: stacked[k] for k in layer_names}
    else:
        out["layers"] = {i: {k: _layer_slice(stacked[k], i) for k in layer_names} for i in range(config.num_layers)}
    return out


def params_layout(params: dict[str, Any]) -> str:
    """Which layout a model state (`model_params`' result) has."""
    return "list" if 0 in params["layers"] else "stacked"


def model_graphdef(config: ModelConfig, layout: str = "list", lora: lora_slots.LoraSpec | None = None):
    """The model's structure without weights (for `nnx.merge(graphdef, model_params(...))`), with
    LoRA slots where `lora` is given (`jserve.model.lora.add_slots` adds them to the params)."""
    return nnx.graphdef(nnx.eval_shape(lambda: LlamaModel(config, layout=layout, lora=lora)))
