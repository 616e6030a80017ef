"""Running a model over scoring chunks: full-vocabulary logits at the scored positions.

A model is prepared as the engine would run it: the platform's backend (`backends.create`, the
native CPU one on a CPU) prepares the weights (`prepare_params`: packing, quantized weights as
they are) and supplies the operations (`backend.ops(config)`), here over a contiguous per-chunk
KV cache (`DenseAttention`) instead of the paged one: each chunk is one sequence from an empty
cache at positions 0..ctx-1, as llama.cpp clears its KV cache per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.eval.chunks import Chunks
from jserve.model import DenseAttention, init_cache, model_graphdef
from jserve.model.config import LONG_ROPE_FLAG, ModelConfig
from jserve.runtime import backends


@dataclasses.dataclass
class ScoringModel:
    """A model prepared for scoring (see the module docstring).

    `params` are checkpoint-layout weights (stacked per-layer arrays, float or
    `QuantizedWeight`), as `load_checkpoint` returns them; `backend` a backend name (None: the
    platform's) or a `Backend` (one per model: the native CPU backend records what it packed).
    """

    config: ModelConfig
    params: dict[str, Any]
    backend: Any = None
    label: str = "model"

    def __post_init__(self):
        self.backend = backends.create(self.backend)
        self.dtype = self.params["final_norm"].dtype  # the activations' (a final norm is never quantized)
        # XLA:CPU has no bfloat16 x bfloat16 -> float32 dot for the dense attention: there the
        # contiguous cache is float32 (bfloat16 K/V are exact in it; the scores are float32 anyway).
        self.cache_dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else self.dtype
        self.state = self.backend.prepare_params(self.config, self.params)
        self.params = None  # the prepared state replaces them (packing copies the weights)
        self.graphdef = model_graphdef(self.config, self.backend.param_layout)
        self.ops = self.backend.ops(self.config)
        self._fns: dict[tuple[int, int, int], Any] = {}

    def _fn(self, batch: int, ctx: int, first: int):
        key = (batch, ctx, first)
        if key not in self._fns:
            self._fns[key] = jax.jit(functools.partial(_scored_logits, self.graphdef, self.ops, self.config,
                                                       self.backend.param_layout == "stacked", self.cache_dtype,
                                                       ctx, first))
        return self._fns[key]

    def logits(self, tokens: np.ndarray, first: int) -> jax.Array:
        """Float32 logits [batch, ctx - 1 - first, vocab] at positions first..ctx-2 of each chunk
        (int32 tokens [batch, ctx]), each chunk from an empty cache."""
        batch, ctx = tokens.shape
        return self._fn(batch, ctx, first)(self.state, jnp.asarray(tokens, jnp.int32))


def _scored_logits(graphdef, ops, config: ModelConfig, stacked: bool, dtype, ctx: int, first: int,
                   state, tokens):
    batch = tokens.shape[0]
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (batch, ctx))
    cache = init_cache(config.num_layers, batch, config.num_kv_heads, ctx, config.head_dim, dtype,
                       stacked=stacked)
    ops = ops.with_attention(DenseAttention(config.sliding_window, stacked=stacked))
    index = jnp.broadcast_to(jnp.arange(first, ctx - 1, dtype=jnp.int32), (batch, ctx - 1 - first))
    # A LongRoPE model rotates a chunk longer than its original context by the long factors
    # throughout, as one forward pass of transformers does.
    rope = positions + LONG_ROPE_FLAG if config.long_rope(ctx) else positions
    logits, _ = model(tokens, rope, cache, positions, ops, logits_index=index)
    return logits.astype(jnp.float32)


def iter_logits(model: ScoringModel, chunks: Chunks, batch_size: int):
    """(chunk start, numpy float32 logits [n, num_scored, vocab]) per batch of chunks. The last
    batch is padded with copies of its first chunk (one compiled shape) and trimmed."""
    n = chunks.num_chunks
    batch_size = max(1, min(batch_size, n))
    for s in range(0, n, batch_size):
        block = chunks.tokens[s:s + batch_size]
        real = len(block)
        if real < batch_size:
            block = np.concatenate([block, np.repeat(block[:1], batch_size - real, axis=0)])
        yield s, np.asarray(model.logits(block, chunks.first))[:real]
