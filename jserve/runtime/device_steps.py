"""The functions the paged runner jits (`jserve.runtime.runner`): one step, several decode steps, and
a speculative step's verification.

Pure device code: they take the params, the KV pages (donated) and the step's arrays, and return
the sampler's outputs and the new pages. The runner binds the model's graph and its backend's
`ModelOps` with `functools.partial` and compiles one shape per bucket. Over a model with LoRA
slots each takes `lora`, the tokens' slot ids (`jserve.model.lora`; shaped as the tokens), else None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.core.request import MAX_LOGPROBS
from jserve.model.config import LONG_ROPE_FLAG
from jserve.runtime.paged_attention import PagedMeta
from jserve.runtime.sampler import argmax, prompt_logprobs, sample, token_counts


def with_lora(ops, lora):
    """`ops` with the step's LoRA slot ids (`ModelOps.lora_ids`), or as they are without."""
    return ops if lora is None else dataclasses.replace(ops, lora_ids=lora)


def forward(graphdef, ops, params, kv, tokens, positions, meta, last, lora=None):
    """The model over each row's tokens: float32 logits [batch, vocab] at each row's `last` token,
    and the new pages. A mixed step (`RaggedMeta`: tokens [groups, num_tokens], last [groups,
    rows], indices into the group's tokens) gives [groups * rows, vocab], group-major."""
    model = nnx.merge(graphdef, params)
    index = jnp.maximum(last, 0)
    logits, kv = model(tokens, positions, kv, meta, with_lora(ops, lora),
                       logits_index=index if last.ndim == 2 else index[:, None])
    return logits.reshape(-1, logits.shape[-1]), kv


def sample_rows(logits, sampling, history, bitmask, feed_rows: int = 0, invariant: bool = False):
    """The sampler over a step's logits [batch, vocab] and its rows' grammar bitmask: compiled
    once per batch size, apart from `forward` (whose shapes also vary with the tokens per row),
    which more than halves the compilation time of a warm-up. With `feed_rows`, also "feed": the
    sampled tokens in a vector of that many entries (one shape for every batch), from which the
    next call's tokens may come (`jserve.runtime.overlap`). `invariant`: batch-invariant mode
    (`ModelOps.batch_invariant`)."""
    out = sample(logits, sampling, penalties=history, bitmask=bitmask, num_logprobs=MAX_LOGPROBS, invariant=invariant)
    if feed_rows:
        tokens = out["tokens"]
        out["feed"] = jnp.zeros((feed_rows,), tokens.dtype).at[:tokens.shape[0]].set(tokens)
    return out


def greedy_rows(logits, feed_rows: int = 0):
    """`sample_rows` where every row is plain greedy (`SamplingArrays.plain_greedy`): the argmax
    and the feed only, without the sampler's branches or its settings and history as arguments;
    the logprob outputs are the host's zeros (`Runner.device_step`)."""
    tokens = argmax(logits.astype(jnp.float32)).astype(jnp.int32)
    out = {"tokens": tokens}
    if feed_rows:
        out["feed"] = jnp.zeros((feed_rows,), tokens.dtype).at[:tokens.shape[0]].set(tokens)
    return out


def score(graphdef, ops, params, kv, tokens, positions, meta, last, next_ids, sampling, history, bitmask,
          lora=None):
    """A prefill chunk whose prompt logprobs are wanted: the model's logits at every position, the
    logprobs of `next_ids` (the token after each position; negative: none) under them, and the
    sampler at each row's `last` token, as `forward` + `sample_rows` give it."""
    model = nnx.merge(graphdef, params)
    logits, kv = model(tokens, positions, kv, meta, with_lora(ops, lora))  # [batch, tokens, vocab]
    final = jnp.take_along_axis(logits, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
    chosen, rank, top_ids, top_logprobs = prompt_logprobs(logits, jnp.maximum(next_ids, 0),
                                                          num_logprobs=MAX_LOGPROBS, invariant=ops.batch_invariant)
    prompt = {"logprob": chosen, "rank": rank, "top_ids": top_ids, "top_logprobs": top_logprobs}
    return sample_rows(final, sampling, history, bitmask, invariant=ops.batch_invariant), prompt, kv


def multi_decode(graphdef, ops, page_size, vocab_size, max_steps, params, kv, tokens, start, pages, decode_steps,
                 stop_ids, min_new, sampling, history, lora=None):
    """Up to `max_steps` decode steps (see `Runner.execute_decode_steps`); a while loop that ends
    early once every row has stopped. A stopped row (and a padded one, `decode_steps` 0) runs as a
    padded row: no query, its K/V write into the null page. No row has a grammar: its mask
    depends on each sample, which the host must see (the scheduler runs such rows in single steps).
    `pages`: the rows' page table, or with hybrid pages the pair (full layers', sliding layers')."""
    model = nnx.merge(graphdef, params)
    ops = with_lora(ops, None if lora is None else lora[:, None])  # a row's slot, for its one token
    B = tokens.shape[0]
    rows = jnp.arange(B)
    ids, num_prompt = history
    filled = jnp.sum(ids != vocab_size, axis=1)  # where the next sample goes in the penalty history
    zeros = jnp.zeros((B, 1), jnp.int32)

    def sample_step(logits, j, ids):
        return sample(logits, sampling.at_step(j), penalties=(ids, num_prompt), num_logprobs=MAX_LOGPROBS,
                      invariant=ops.batch_invariant)

    shapes = jax.eval_shape(sample_step, jax.ShapeDtypeStruct((B, vocab_size), jnp.float32), 0, ids)
    buffers = jax.tree.map(lambda x: jnp.zeros((max_steps,) + x.shape, x.dtype), shapes)

    def body(state):
        j, kv, token, done, ids, buffers, valid = state
        live = ~done
        rope = jnp.where(live, start + j, 0)  # `start` holds rotary positions (LongRoPE's flag)
        pos = rope & (LONG_ROPE_FLAG - 1)
        tables = pages if isinstance(pages, tuple) else (pages,)
        slots = [jnp.where(live, jnp.take_along_axis(table, (pos // page_size)[:, None], axis=1)[:, 0] * page_size
                           + pos % page_size, 0) for table in tables]
        local = (slots[1], tables[1]) if len(tables) > 1 else ()
        meta = PagedMeta(slots[0], pos, live.astype(jnp.int32), tables[0], *local)
        logits, kv = model(token[:, None], rope[:, None], kv, meta, ops, logits_index=zeros)
        out = sample_step(logits[:, 0], j, ids)
        new = out["tokens"]
        buffers = jax.tree.map(lambda buf, x: buf.at[j].set(x), buffers, out)
        stopped = jnp.any(new[:, None] == stop_ids, axis=1) & (j + 1 >= min_new)
        done = done | (live & (stopped | (j + 1 >= decode_steps)))
        ids = ids.at[rows, filled + j].set(jnp.where(live, new, vocab_size), mode="drop")
        return j + 1, kv, jnp.where(live, new, token), done, ids, buffers, valid + live

    def cond(state):
        j, done = state[0], state[3]
        return (j < max_steps) & jnp.any(~done)

    state = (jnp.int32(0), kv, tokens, decode_steps <= 0, ids, buffers, jnp.zeros((B,), jnp.int32))
    _, kv, _, _, _, buffers, valid = jax.lax.while_loop(cond, body, state)
    return {**buffers, "num_valid": valid}, kv


def verify(graphdef, ops, params, kv, tokens, positions, meta, drafts, sampling, history, bitmask, lora=None):
    """A speculative step (see `jserve.core.speculative`): each row's last known token and its
    drafts, tokens [batch, k + 1] (a row of q_lens 1 + m holds m drafts; `drafts` int32 [batch, k],
    -1 past them), computed in one call; the sampler runs at every position j as plain decoding
    would sample there (seed step `sampling.step + j`, penalty counts grown by the drafts before
    j, `bitmask` [batch * (k + 1), words]: row b's grammar after its first j drafts).

    Returns the sampler's outputs with a leading axis of positions ([k + 1, batch, ...]), with
    `num_valid` [batch]: 1 + the drafts accepted (each equal to the sample at its position), 0
    for a padding row; and the new pages.
    """
    model = nnx.merge(graphdef, params)
    logits, kv = model(tokens, positions, kv, meta, with_lora(ops, lora))  # [batch, k + 1, vocab]
    B, T, V = logits.shape
    j = jnp.arange(T, dtype=jnp.int32)
    flat = jax.tree.map(lambda x: jnp.repeat(x, T, axis=0), sampling)
    flat = dataclasses.replace(flat, step=flat.step + jnp.tile(j, B))
    ids, num_prompt = history

    def penalties(vocab):
        """Position j's counts: the row's history plus its drafts before j (only a step with a
        penalised row computes them: [batch * (k + 1), vocab], the logits' size)."""
        seen, in_prompt = token_counts(ids, num_prompt, vocab)
        drafted = jax.nn.one_hot(jnp.where(drafts >= 0, drafts, vocab), vocab, dtype=seen.dtype)  # [B, k, V]
        before = jnp.concatenate([jnp.zeros_like(drafted[:, :1]), jnp.cumsum(drafted, axis=1)], axis=1)
        return (seen[:, None] + before).reshape(B * T, vocab), jnp.repeat(in_prompt, T, axis=0)

    out = sample(logits.reshape(B * T, V), flat, penalties=penalties, bitmask=bitmask, num_logprobs=MAX_LOGPROBS,
                 invariant=ops.batch_invariant)
    out = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(B, T, *x.shape[1:]), 0, 1), out)
    num_drafts = meta.q_lens - 1  # -1 for a padding row
    match = (drafts == out["tokens"][:T - 1].T) & (j[None, :T - 1] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return {**out, "num_valid": jnp.where(num_drafts >= 0, accepted + 1, 0).astype(jnp.int32)}, kv
