"""Compiled prefill and decode steps over a contiguous KV cache: a simple reference path.

One group of sequences shares a cache `[batch, kv_heads, cache_len, head_dim]` per layer; every
shape comes from `buckets.py` and the cache is donated to each call. The engine serves on the paged
`Runner`; this one scores prompts (prompt logprobs) and is the reference the paged path is tested
against.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve import buckets
from jserve.config import ModelConfig
from jserve.model import DenseAttention, ModelOps, XlaOps, init_cache, model_graphdef, model_params, params_layout
from jserve.sampler import SamplingArrays, prompt_logprobs, sample

logger = logging.getLogger(__name__)


class DenseRunner:
    """Owns params on the device and the compiled steps; counts compilations."""

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array], *, max_model_len: int,
                 batch_buckets: Sequence[int] = buckets.DENSE_BATCH_BUCKETS,
                 token_buckets: Sequence[int] = buckets.DEFAULT_TOKEN_BUCKETS,
                 length_buckets: Sequence[int] = buckets.DEFAULT_LENGTH_BUCKETS,
                 ops: ModelOps | None = None):
        """`params`: checkpoint weights (stacked) or a model state; `ops`: the model's operations
        for them (a paged runner's `ops.with_attention(...)`, to share its prepared weights), whose
        attention this runner replaces with its own; default `XlaOps` over the params' layout."""
        self.config = config
        self.params = params if "layers" in params else model_params(config, params)
        layout = params_layout(self.params)
        self.stacked = layout == "stacked"
        self.max_model_len = max_model_len
        self.batch_buckets = tuple(batch_buckets)
        self.token_buckets = buckets.clip(token_buckets, max_model_len)
        self.length_buckets = buckets.clip(length_buckets, max_model_len)
        self.kv_dtype = self.params["embed"].dtype
        self.graphdef = model_graphdef(config, layout)
        self._shapes_seen: set[tuple] = set()
        self.num_compilations = 0
        attention = DenseAttention(config.sliding_window, stacked=self.stacked)
        ops = (ops or XlaOps(attention, scan=self.stacked)).with_attention(attention)
        self._prefill = jax.jit(functools.partial(_prefill_step, self.graphdef, ops),
                                static_argnames=("num_logprobs", "num_prompt_logprobs"),
                                donate_argnames=("cache",))
        self._decode = jax.jit(functools.partial(_decode_step, self.graphdef, ops),
                               static_argnames=("num_logprobs",), donate_argnames=("cache",))

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def _count(self, key: tuple) -> None:
        if key not in self._shapes_seen:
            self._shapes_seen.add(key)
            self.num_compilations += 1

    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[tuple], cache_len: int, *,
                num_logprobs: int = 0, num_prompt_logprobs: int | None = None):
        """Run the prompts of one group; returns (sample outputs, prompt logprobs or None, cache).

        `rows` are per-prompt `(SamplingParams, step)` (see `SamplingArrays.build`).
        """
        B = buckets.pick(self.batch_buckets, len(prompts))
        T = buckets.pick(self.token_buckets, max(len(p) for p in prompts))
        S = buckets.pick(self.length_buckets, cache_len)
        tokens = np.zeros((B, T), np.int32)
        positions = np.full((B, T), S, np.int32)  # >= cache length: padding, writes dropped
        last = np.zeros((B, 1), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
            positions[i, :len(p)] = np.arange(len(p))
            last[i, 0] = len(p) - 1
        c = self.config
        cache = init_cache(c.num_layers, B, c.num_kv_heads, S, c.head_dim, self.kv_dtype, stacked=self.stacked)
        sampling = SamplingArrays.build(rows, B)
        self._count(("prefill", B, T, S, num_logprobs, num_prompt_logprobs))
        out, plp, cache = self._prefill(self.params, tokens, positions, last, cache, sampling,
                                        num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_logprobs)
        out = jax.device_get(out)
        return out, (jax.device_get(plp) if plp is not None else None), cache

    def decode(self, last_tokens: Sequence[int], positions: Sequence[int], rows: Sequence[tuple],
               cache: Any, *, num_logprobs: int = 0):
        """One decode step for the group; positions >= cache length mark finished rows."""
        B, _, S, _ = cache[0][0].shape if not self.stacked else cache[0].shape[1:]
        tokens = np.zeros((B, 1), np.int32)
        pos = np.full((B, 1), S, np.int32)
        tokens[:len(last_tokens), 0] = last_tokens
        pos[:len(positions), 0] = positions
        sampling = SamplingArrays.build(rows, B)
        self._count(("decode", B, S, num_logprobs))
        out, cache = self._decode(self.params, tokens, pos, cache, sampling,
                                  num_logprobs=num_logprobs)
        return jax.device_get(out), cache


def _prefill_step(graphdef, ops, params, tokens, positions, last, cache, sampling,
                  *, num_logprobs, num_prompt_logprobs):
    model = nnx.merge(graphdef, params)
    if num_prompt_logprobs is None:
        logits, cache = model(tokens, positions, cache, positions, ops, logits_index=last)
        return sample(logits[:, 0], sampling, num_logprobs=num_logprobs), None, cache
    logits, cache = model(tokens, positions, cache, positions, ops)  # [batch, tokens, vocab]
    final = jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0]
    next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    plp = prompt_logprobs(logits, next_tokens, num_logprobs=num_prompt_logprobs)
    return sample(final, sampling, num_logprobs=num_logprobs), plp, cache


def _decode_step(graphdef, ops, params, tokens, positions, cache, sampling, *,
                 num_logprobs):
    model = nnx.merge(graphdef, params)
    logits, cache = model(tokens, positions, cache, positions, ops)
    return sample(logits[:, 0], sampling, num_logprobs=num_logprobs), cache
