"""On-device sampling inside the step: grammar masks, penalties, greedy, temperature, top-k/p, min-p,
per-row seeds.

Each row carries its own parameters as arrays, so one compiled step serves any mix of requests.
A structured-output row's grammar arrives as its row of a token bitmask (`bitmask`, int32
`[batch, ceil(vocab / 32)]`, all ones for a free row): tokens it disallows get -inf before any
other processing; a step without a constrained row skips the unpacking. A request's logit bias,
allowed tokens and bad words' bans (`SamplingParams.logit_bias` / `allowed_token_ids`,
`StepRow.banned_ids` at -inf) travel as at most
`MAX_LOGIT_ENTRIES` sparse `(id, value)` entries per row, applied after the grammar mask and
before the penalties, temperature and top-k/p (vLLM's order); a step without such a row skips them.
A row's random key is `fold_in(key(seed), step)`: the same seed gives the same tokens whatever
else is in the batch. Logprobs are those of the model's raw distribution (as vLLM reports them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jserve.core.request import GREEDY, MAX_LOGIT_ENTRIES, SamplingParams
from jserve.model import norms


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings as arrays (a pytree), padded to the batch bucket: the one form
    `SamplingParams` takes on its way to the device (built by `build`, read by `sample`)."""

    temperature: np.ndarray  # float32 [batch]
    top_k: np.ndarray  # int32 [batch], 0 = off
    top_p: np.ndarray  # float32 [batch]
    min_p: np.ndarray  # float32 [batch]
    seed: np.ndarray  # uint32 [batch]
    step: np.ndarray  # int32 [batch]: index of the token being sampled within its request
    repetition_penalty: np.ndarray  # float32 [batch], 1 = off
    presence_penalty: np.ndarray  # float32 [batch], 0 = off
    frequency_penalty: np.ndarray  # float32 [batch], 0 = off
    logprobs: np.ndarray  # int32 [batch]: 1 if the row's request wants logprobs, else 0
    allowed_only: np.ndarray  # int32 [batch]: 1 if only the row's listed tokens may be sampled
    bias_ids: np.ndarray  # int32 [batch, MAX_LOGIT_ENTRIES]: listed token ids, -1 past them
    bias_values: np.ndarray  # float32 [batch, MAX_LOGIT_ENTRIES]: added to the listed tokens' logits

    @classmethod
    def build(cls, rows: Sequence[tuple[SamplingParams, int] | tuple[SamplingParams, int, Sequence[int]] | None],
              batch: int) -> "SamplingArrays":
        """rows: `(params, step)` or `(params, step, banned ids)` per real row (step: the index of
        the token sampled within its request, which a seeded row's random key folds in; banned:
        tokens it may not sample, `StepRow.banned_ids`) or None for padding; pads to `batch` with
        greedy rows."""
        if len(rows) > batch:
            raise ValueError(f"{len(rows)} rows exceed the batch of {batch}")
        padded = [row if row is not None else (GREEDY, 0) for row in list(rows) + [None] * (batch - len(rows))]
        ids = np.full((batch, MAX_LOGIT_ENTRIES), -1, np.int32)
        values = np.zeros((batch, MAX_LOGIT_ENTRIES), np.float32)
        for b, (p, _, *banned) in enumerate(padded):
            listed, added = p.logit_entries
            ids[b, :len(listed)], values[b, :len(added)] = listed, added
            if banned and banned[0]:  # SamplingParams keeps them within the entries' room
                ids[b, len(listed):len(listed) + len(banned[0])] = banned[0]
                values[b, len(listed):len(listed) + len(banned[0])] = -np.inf
        return cls(**{name: np.asarray([value(p, step) for p, step, *_ in padded], dtype)
                      for name, (dtype, value) in _FIELDS.items()}, bias_ids=ids, bias_values=values)

    def plain_greedy(self) -> bool:
        """Whether every row (padding included) takes its logits' argmax and nothing else: no
        temperature, penalty, logit entry, allowed-token list or logprobs (host arrays only).
        Such a call's sampler is `argmax` alone (`device_steps.greedy_rows`)."""
        return bool(np.all(self.temperature <= 0.0) and not np.any(self.logprobs) and not np.any(self.allowed_only)
                    and np.all(self.bias_ids < 0) and np.all(self.repetition_penalty == 1.0)
                    and not np.any(self.presence_penalty) and not np.any(self.frequency_penalty))

    def at_step(self, j) -> "SamplingArrays":
        """The same rows `j` samples later (multi-step decode: per-row seeds fold in the step)."""
        return dataclasses.replace(self, step=self.step + j)


# Each field's dtype and its value for a row `(params, step)`.
_FIELDS = {
    "temperature": (np.float32, lambda p, step: p.temperature),
    "top_k": (np.int32, lambda p, step: p.top_k),
    "top_p": (np.float32, lambda p, step: p.top_p),
    "min_p": (np.float32, lambda p, step: p.min_p),
    "seed": (np.uint32, lambda p, step: (p.seed or 0) % 2**32),
    "step": (np.int32, lambda p, step: step),
    "repetition_penalty": (np.float32, lambda p, step: p.repetition_penalty),
    "presence_penalty": (np.float32, lambda p, step: p.presence_penalty),
    "frequency_penalty": (np.float32, lambda p, step: p.frequency_penalty),
    "logprobs": (np.int32, lambda p, step: int(p.logprobs is not None)),
    "allowed_only": (np.int32, lambda p, step: int(p.allowed_token_ids is not None)),
}


def penalty_history(rows: Sequence[tuple[Sequence[int], Sequence[int]] | None], batch: int,
                    length: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Token history for penalties: int32 [batch, length] ids (padding = vocab_size, dropped on
    device) and int32 [batch] prompt lengths. rows: `(prompt_ids, output_ids)` or None (no penalties).
    A fixed `length` (the context) keeps one compiled shape and moves 4 bytes per token, not a
    [batch, vocab] matrix."""
    history = np.full((batch, length), vocab_size, np.int32)
    num_prompt = np.zeros((batch,), np.int32)
    for b, row in enumerate(rows):
        if row is not None:
            prompt, output = row
            history[b, :len(prompt)] = prompt
            history[b, len(prompt):len(prompt) + len(output)] = output
            num_prompt[b] = len(prompt)
    return history, num_prompt


def token_counts(history: jax.Array, num_prompt: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """[batch, vocab] output-token counts and prompt-token presence from a padded history."""
    is_output = jnp.arange(history.shape[1])[None, :] >= num_prompt[:, None]
    rows = jnp.arange(history.shape[0])[:, None]
    zeros = jnp.zeros((history.shape[0], vocab_size), jnp.float32)
    counts = zeros.at[rows, history].add(is_output.astype(jnp.float32), mode="drop")
    in_prompt = zeros.at[rows, history].max((~is_output).astype(jnp.float32), mode="drop")
    return counts, in_prompt


def apply_penalties(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """vLLM's penalties: repetition over prompt and output tokens (divide positive logits, multiply
    negative ones), then frequency (per occurrence) and presence (once) over output tokens."""
    seen = (counts > 0) | (in_prompt > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _first(x: jax.Array, top: jax.Array) -> jax.Array:
    """The first index along the last axis where x == top (the last index if there is none)."""
    n = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == top, iota, n), axis=-1), n - 1)


def argmax(x: jax.Array, chunk: int = 512) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (the first maximum), from the maxima of `chunk`-wide pieces: the
    piece's max, the first piece holding the row's max, then the first index of it in that piece.
    XLA:CPU runs argmax's (value, index) reduction element by element, and a max then a min over
    all the indices writes and rereads an int32 copy of x; this is faster than both on a decode
    step's logits (docs/performance.md). A row of NaNs gives some index in range."""
    V = x.shape[-1]
    n = -(-V // chunk)
    if n == 1:
        return _first(x, jnp.max(x, axis=-1, keepdims=True))
    if n * chunk != V:
        if x.dtype == jnp.bool_:
            fill = False
        elif jnp.issubdtype(x.dtype, jnp.floating):
            fill = -jnp.inf
        else:
            fill = jnp.iinfo(x.dtype).min
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * chunk - V)], constant_values=fill)
    pieces = x.reshape(*x.shape[:-1], n, chunk)
    maxima = jnp.max(pieces, axis=-1)
    # The barrier keeps XLA from rewriting the max of the maxima as a second pass over x.
    top = jnp.max(jax.lax.optimization_barrier(maxima), axis=-1, keepdims=True)
    piece = _first(maxima, top)
    within = _first(jnp.take_along_axis(pieces, piece[..., None, None], axis=-2)[..., 0, :], top)
    return jnp.minimum(piece * chunk + within, V - 1)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's bitmask clears the token's bit (bit `t % 32` of word `t // 32`, as
    llguidance and xgrammar lay it out); logits [batch, vocab], bitmask int32 [batch, >= vocab / 32]."""
    batch, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    words = bitmask.astype(jnp.uint32)[:, :, None]
    bits = jax.lax.shift_right_logical(words, jnp.broadcast_to(shifts, words.shape[:2] + (32,))) & jnp.uint32(1)
    allowed = bits.reshape(batch, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_logit_entries(logits: jax.Array, ids: jax.Array, values: jax.Array,
                        allowed_only: jax.Array) -> jax.Array:
    """A row's sparse entries (`SamplingArrays.bias_ids` / `bias_values`, ids -1 past them) added
    to its logits; in a row with `allowed_only` set, -inf at every token it does not list."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    ids = jnp.where(ids >= 0, ids, vocab)  # dropped by the scatters
    listed = jnp.zeros(logits.shape, jnp.bool_).at[rows, ids].set(True, mode="drop")
    logits = jnp.where((allowed_only[:, None] != 0) & ~listed, -jnp.inf, logits)
    return logits.at[rows, ids].add(values, mode="drop")


def _filtered_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     min_p: jax.Array, invariant: bool = False) -> jax.Array:
    """Mask tokens outside top-k / top-p / min-p with -inf (rows of [batch, vocab])."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    probs = norms.softmax(sorted_logits, invariant)
    # top-k: the k-th largest logit is the threshold.
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    # min-p: keep tokens with prob >= min_p * max prob, i.e. logit >= max + log(min_p).
    mth = sorted_logits[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    mth = jnp.where(min_p[:, None] > 0, mth, -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, sampling: SamplingArrays,
           penalties: tuple[jax.Array, jax.Array] | None = None, bitmask: jax.Array | None = None, *,
           num_logprobs: int = 0, invariant: bool = False):
    """Sample one token per row.

    Args:
      logits: float32 [batch, vocab].
      bitmask: int32 [batch, ceil(vocab / 32)], the tokens each row may sample (`apply_bitmask`;
        -1, every bit set, for a free row), or None: no row is constrained.
      sampling: the rows' settings; its penalties apply when `penalties` (history, num_prompt:
        see `penalty_history`; or a function of the vocabulary size giving the [batch, vocab]
        output-token counts and prompt presence, called only in a step with a penalised row) is
        given. Where no row wants logprobs (`sampling.logprobs`), the logprob outputs are zeros
        and cost nothing (the log-softmax and top-k over the vocabulary are most of this
        function's time).
      num_logprobs: static; how many top logprobs to return per row (0: none).
      invariant: static; batch-invariant mode: the softmaxes' sums in a fixed order (`jserve.model.norms`).
    Returns:
      dict with `tokens` int32 [batch], `logprob` float32 [batch] (of the chosen token),
      `rank` int32 [batch], and when num_logprobs > 0 `top_ids` int32 [batch, k] and
      `top_logprobs` float32 [batch, k].
    """
    logits = logits.astype(jnp.float32)
    greedy = sampling.temperature <= 0.0
    tokens = _processed_pick(logits, sampling, greedy, penalties, bitmask, invariant)
    return {"tokens": tokens, **_logprobs_if_wanted(logits, tokens, sampling.logprobs, num_logprobs, invariant)}


def _draw(logits: jax.Array, best: jax.Array, sampling: SamplingArrays, greedy: jax.Array,
          invariant: bool) -> jax.Array:
    """A token per row drawn at its temperature after top-k / top-p / min-p, with its own key;
    `best` where the row is greedy."""
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    scaled = logits / jnp.where(greedy, 1.0, sampling.temperature)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    filtered = jax.lax.cond(needs_filter, functools.partial(_filtered_logits, invariant=invariant),
                            lambda l, *_: l, scaled, top_k, top_p, min_p)
    # Inverse-CDF sampling: one uniform per row instead of a Gumbel draw per vocabulary entry
    # (those draws cost more than the whole model step on a CPU; docs/performance.md).
    probs = norms.softmax(filtered, invariant)
    cdf = jnp.cumsum(probs, axis=-1)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(sampling.seed, sampling.step)
    u = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]
    sampled = argmax(cdf > u[:, None])
    return jnp.where(greedy, best, sampled)


def _pick(logits: jax.Array, sampling: SamplingArrays, greedy: jax.Array, invariant: bool) -> jax.Array:
    """Each row's token from its logits: the argmax, and `_draw` only in a step with a row that
    is not greedy."""
    best = argmax(logits)
    return jax.lax.cond(jnp.all(greedy), lambda l, b: b, lambda l, b: _draw(l, b, sampling, greedy, invariant),
                        logits, best)


def _processed_pick(logits: jax.Array, sampling: SamplingArrays, greedy: jax.Array,
                    penalties, bitmask: jax.Array | None, invariant: bool) -> jax.Array:
    """int32 [batch]: `_pick` after the grammar mask, the logit entries and the penalties, in that
    order (`sample`'s arguments).

    Each stage runs only in a step with a row that needs it (a branch per combination: only steps
    that carry a penalised row pay for the [batch, vocab] counts, only those with a constrained
    row for unpacking the bitmask). The tokens, not the processed logits, leave the conditional:
    a [batch, vocab] result would be copied out of it on every step."""
    def penalised(l):
        seen, in_prompt = penalties(l.shape[-1]) if callable(penalties) else token_counts(*penalties, l.shape[-1])
        return apply_penalties(l, seen, in_prompt, sampling.repetition_penalty, sampling.presence_penalty,
                               sampling.frequency_penalty)

    def entries(l):
        return apply_logit_entries(l, sampling.bias_ids, sampling.bias_values, sampling.allowed_only)

    # (stage, whether a row needs it), the stage applied last first
    stages = [(entries, jnp.any(sampling.bias_ids[:, 0] >= 0) | jnp.any(sampling.allowed_only != 0))]
    if penalties is not None:
        stages.insert(0, (penalised, jnp.any((sampling.repetition_penalty != 1.0) | (sampling.presence_penalty != 0.0)
                                             | (sampling.frequency_penalty != 0.0))))
    if bitmask is not None:
        stages.append((lambda l: apply_bitmask(l, bitmask), jnp.any(bitmask != -1)))
    branches = [lambda l: _pick(l, sampling, greedy, invariant)]
    index = jnp.int32(0)
    for stage, needed in stages:
        index += needed.astype(jnp.int32) * len(branches)
        branches += [lambda l, f=f, stage=stage: f(stage(l)) for f in list(branches)]
    return jax.lax.switch(index, branches, logits).astype(jnp.int32)


def _logprob_outputs(raw: jax.Array, tokens: jax.Array, num_logprobs: int, invariant: bool) -> dict[str, jax.Array]:
    """`sample`'s logprob outputs for the chosen `tokens`, of the model's own distribution `raw`
    (as vLLM reports them)."""
    logprobs = norms.log_softmax(raw, invariant)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    out = {"logprob": chosen, "rank": (jnp.sum(logprobs > chosen[:, None], axis=-1) + 1).astype(jnp.int32)}
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
        out["top_ids"], out["top_logprobs"] = top_ids.astype(jnp.int32), top_lp
    return out


def _logprobs_if_wanted(raw: jax.Array, tokens: jax.Array, wanted: jax.Array,
                        num_logprobs: int, invariant: bool) -> dict[str, jax.Array]:
    """`_logprob_outputs` where a row wants logprobs (`wanted` != 0), else zeros of their shapes."""
    def outputs(raw):
        return _logprob_outputs(raw, tokens, num_logprobs, invariant)

    skipped = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(outputs, raw))
    return jax.lax.cond(jnp.any(wanted != 0), outputs, lambda raw: skipped, raw)


def prompt_logprobs(logits: jax.Array, next_tokens: jax.Array, *, num_logprobs: int, invariant: bool = False):
    """Logprobs of each prompt token given its prefix.

    Args:
      logits: float32 [batch, tokens, vocab], the logits at each prompt position.
      next_tokens: int32 [batch, tokens], the token that follows each position.
      invariant: static; batch-invariant mode (`sample`).
    Returns:
      (`logprob` [batch, tokens], `rank` [batch, tokens], `top_ids` [batch, tokens, k],
      `top_logprobs` [batch, tokens, k]); k = max(num_logprobs, 1).
    """
    logprobs = norms.log_softmax(logits.astype(jnp.float32), invariant)
    chosen = jnp.take_along_axis(logprobs, next_tokens[..., None], axis=-1)[..., 0]
    rank = (jnp.sum(logprobs > chosen[..., None], axis=-1) + 1).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, max(num_logprobs, 1))
    return chosen, rank, top_ids.astype(jnp.int32), top_lp
