"""The serving path's token logprobs (`LLM.token_logprobs`) against the same model's plain forward
pass: `LlamaModel` with `XlaOps` and dense attention over the whole sequence, on the checkpoint
layout's weights (what a JAX trainer differentiates), the same params and dtype.

`compare` reports the exact differences (max-abs-diff 0.0 when both paths agree bit for bit) and
a KL divergence over the serving path's top-k tokens: the serving path returns at most
`MAX_LOGPROBS` logprobs per position, so both distributions are renormalised over those k ids.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.core.request import MAX_LOGPROBS
from jserve.engine.scoring import TokenLogprobs, check_sequences
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
from jserve.model.config import LONG_ROPE_FLAG, ModelConfig


def forward_logits(config: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Float32 logits [batch, T, vocab] of int32 `tokens` [batch, T] at positions 0..T-1 (right
    padding changes no earlier position). `params`: jserve's flat checkpoint layout. Traceable
    (jit, grad): the trainer's forward in `examples/rl_loop.py`."""
    batch, T = tokens.shape
    model = nnx.merge(model_graphdef(config, "stacked"), model_params(config, params, "stacked"))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))
    # XLA:CPU has no bfloat16 x bfloat16 -> float32 dot for the dense attention; bfloat16 K/V are exact in float32.
    dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else params["final_norm"].dtype
    cache = init_cache(config.num_layers, batch, config.num_kv_heads, T, config.head_dim, dtype, stacked=True)
    ops = XlaOps(DenseAttention(config.sliding_window, stacked=True), scan=True)
    rope = positions + LONG_ROPE_FLAG if config.long_rope(T) else positions
    logits, _ = model(tokens, rope, cache, positions, ops)
    return logits


@functools.partial(jax.jit, static_argnums=(0,))
def _logprobs(config, params, tokens, at):
    logprobs = jax.nn.log_softmax(forward_logits(config, params, tokens)[:, :-1], axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
    return chosen, jnp.take_along_axis(logprobs, at, axis=-1)


def forward_logprobs(config: ModelConfig, params: dict[str, Any], token_ids: Sequence[Sequence[int]],
                     at: Sequence[np.ndarray] | None = None) -> list[TokenLogprobs]:
    """`LLM.token_logprobs`' result by the plain forward pass, one sequence at a time (padded to a
    power of two); `at`: per sequence, int [n - 1, k] ids whose logprobs go in `top_logprobs`."""
    seqs = check_sequences(token_ids, config.vocab_size, 2**31 - 1)
    out = []
    for i, ids in enumerate(seqs):
        n = len(ids)
        T = max(16, 1 << (n - 1).bit_length())
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = ids
        k = 1 if at is None else at[i].shape[1]
        where = np.zeros((1, T - 1, k), np.int32)
        if at is not None:
            where[0, :n - 1] = at[i]
        chosen, picked = (np.asarray(a[0, :n - 1]) for a in _logprobs(config, params, jnp.asarray(tokens),
                                                                        jnp.asarray(where)))
        out.append(TokenLogprobs(np.asarray(ids, np.int32), chosen.astype(np.float32),
                                 None if at is None else at[i], None if at is None else picked.astype(np.float32)))
    return out


def compare(served: Sequence[TokenLogprobs], reference: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """Differences between two scorings of the same sequences (the reference's `top_logprobs` at
    the served `top_ids`): max / mean abs diff of the tokens' logprobs and of the top-k logprobs,
    mean KL(reference || served) over the served top-k ids, top-1 agreement of the served top ids."""
    chosen = np.concatenate([np.abs(s.logprobs - r.logprobs) for s, r in zip(served, reference)])
    report: dict[str, Any] = {"sequences": len(served), "tokens": int(chosen.size),
                              "max_abs_diff": float(chosen.max(initial=0.0)),
                              "mean_abs_diff": float(chosen.mean()) if chosen.size else 0.0}
    if all(s.top_logprobs is not None and r.top_logprobs is not None for s, r in zip(served, reference)):
        s_top = np.concatenate([s.top_logprobs for s in served]).astype(np.float64)
        r_top = np.concatenate([r.top_logprobs for r in reference]).astype(np.float64)
        p = np.exp(r_top - np.logaddexp.reduce(r_top, axis=1, keepdims=True))
        log_q = s_top - np.logaddexp.reduce(s_top, axis=1, keepdims=True)
        log_p = r_top - np.logaddexp.reduce(r_top, axis=1, keepdims=True)
        kl = np.sum(p * (log_p - log_q), axis=1)
        report.update(top_k=int(s_top.shape[1]), max_abs_diff_top=float(np.abs(s_top - r_top).max(initial=0.0)),
                      mean_kl_top=float(kl.mean()) if kl.size else 0.0, max_kl_top=float(kl.max(initial=0.0)),
                      top1_agreement=float(np.mean(np.argmax(r_top, axis=1) == 0)) if kl.size else 1.0)
    return report


def serving_vs_forward(llm: Any, params: dict[str, Any], token_ids: Sequence[Sequence[int]],
                       top_k: int = MAX_LOGPROBS) -> dict[str, Any]:
    """`compare` of `llm.token_logprobs(token_ids)` against `forward_logprobs` on `params` (the
    weights `llm` serves, in jserve's checkpoint layout, placed as the caller likes)."""
    served = llm.token_logprobs(token_ids, top_k=top_k)
    reference = forward_logprobs(llm.config, params, token_ids, at=[s.top_ids for s in served])
    return {"model": str(llm.path), "dtype": str(llm.dtype), "backend": llm.runner.backend.name,
            **compare(served, reference)}


def checkpoint_report(model: Any, text: str, *, ctx: int, chunks: int, dtype: str | None = None,
                      backend: str | None = None, log=print) -> dict[str, Any]:
    """`jserve eval --serving-vs-forward`: a checkpoint served by `LLM` against its plain forward
    on the first `chunks` chunks of `ctx` tokens of `text`."""
    from jserve.llm import LLM
    from jserve.model.checkpoint import load_checkpoint

    llm = LLM(model, dtype=dtype, backend=backend, max_model_len=ctx + 1)
    try:
        tokens = llm.tokenizer.encode(text)
        seqs = [tokens[s:s + ctx] for s in range(0, len(tokens), ctx)][:chunks]
        log(f"scoring {len(seqs)} chunks of up to {ctx} tokens on the serving path and the plain forward")
        _, params, _ = load_checkpoint(llm.path, dtype=llm.dtype)
        return {**serving_vs_forward(llm, params, seqs), "ctx": ctx}
    finally:
        llm.close()


def table(report: dict[str, Any]) -> str:
    """The report as aligned `name  value` lines."""
    width = max(map(len, report))
    return "\n".join(f"{name:<{width}}  {value:.3g}" if isinstance(value, float) else f"{name:<{width}}  {value}"
                     for name, value in report.items())
