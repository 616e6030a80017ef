"""The runner's steps that compute several tokens per row in one call: multi-step decode
(`execute_decode_steps`: up to K decode steps, each sample fed back on the device) and the
speculative verify step (`execute_verify`: a row's token and its drafts, the drafts its samples
confirm accepted). A mixin of `jserve.runtime.runner.Runner`, whose packing, shapes, sampling
arrays and step records they use."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np

from jserve.core.stop import MAX_DEVICE_STOP_IDS
from jserve.runtime import device_steps
from jserve.runtime.steps import StepOutput, StepRecord, StepRow


class MultiTokenSteps:
    """`Runner`'s multi-step decode and verify steps (see the module docstring)."""

    def execute_decode_steps(self, rows: Sequence[StepRow]) -> StepOutput:
        """Run up to `decode_steps` decode steps in one call, each row's sample fed back as its
        next token on the device (multi-step decode).

        Each row has one token, `num_steps` in 1 .. `decode_steps`, pages for every step's
        position, and its `stop_ids` / `min_new` (only the first MAX_DEVICE_STOP_IDS ids are checked
        here: the host checks all, and drops what follows a stop); penalties see each sample.
        Returns a `StepOutput` with a leading axis of `decode_steps`, and `num_valid`.
        """
        K = self.decode_steps
        if not rows:
            raise ValueError("no rows")
        if len(rows) > self.batch_buckets[-1]:
            raise ValueError(f"{len(rows)} rows exceed the largest decode bucket {self.batch_buckets[-1]}")
        if any(r.num_tokens != 1 for r in rows):
            raise ValueError("a multi-step decode takes exactly one token per row")
        if any(r.constraint is not None for r in rows):
            raise ValueError("a row with a grammar runs in single steps: its mask needs each sample on the host")
        if any(not 1 <= r.num_steps <= K for r in rows):
            raise ValueError(f"num_steps must be in [1, {K}], got {[r.num_steps for r in rows]}")
        for r in rows:
            if r.start + r.num_steps > len(r.page_ids) * self.page_size:
                raise ValueError(f"a row at position {r.start} running {r.num_steps} steps needs "
                                 f"{-(-(r.start + r.num_steps) // self.page_size)} pages, got {len(r.page_ids)}")
        B = self._shape("decode_steps", len(rows), K)[0]
        inputs = self._decode_steps_inputs(rows, B)
        cached = cache_size(self._decode_steps)
        t0 = time.perf_counter()
        out, self.kv = self._decode_steps(self.params, self.kv, *inputs)
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        self._count(("decode_steps", B, K), None if cached is None else cache_size(self._decode_steps) > cached)
        valid = out.pop("num_valid")[:len(rows)]
        ran = int(valid.max())
        # Per step, the rows still running: their real tokens, bytes and FLOPs.
        live = [[StepRow(r.start + j, [0], ()) for r, n in zip(rows, valid) if j < n] for j in range(ran)]
        cost = [self._cost(step_rows) for step_rows in live]
        self._record(StepRecord("decode", (B, 1), int(valid.sum()), B * ran, seconds, sum(c[0] for c in cost),
                                sum(c[1] for c in cost), steps=ran))
        return StepOutput.from_arrays({**{key: value[:, :len(rows)] for key, value in out.items()},
                                       "num_valid": valid})

    def _decode_steps_inputs(self, rows: Sequence[StepRow], B: int) -> tuple:
        """`device_steps.decode_steps`' inputs after the params and pages, for `rows` padded to B."""
        placed = list(rows) + [None] * (B - len(rows))
        tokens, positions, meta, _ = self._pack(placed, B, 1)
        steps = np.zeros((B,), np.int32)
        steps[:len(rows)] = [r.num_steps for r in rows]
        stop_ids = np.full((B, MAX_DEVICE_STOP_IDS), -1, np.int32)
        min_new = np.zeros((B,), np.int32)
        for i, r in enumerate(rows):
            ids = list(r.stop_ids)[:MAX_DEVICE_STOP_IDS]
            stop_ids[i, :len(ids)] = ids
            min_new[i] = r.min_new
        sampling, history = self._sampling(placed, B)
        return tokens[:, 0], positions[:, 0], meta.page_indices, steps, stop_ids, min_new, sampling, history

    def execute_verify(self, rows: Sequence[StepRow]) -> StepOutput:
        """A speculative step: each decode row's token and its `draft_ids` (at most
        `num_speculative_tokens`) computed in one call, sampled at every position, and the drafts
        its samples confirm accepted (`device_steps.verify`).

        Each row has one token and pages for `start + len(draft_ids)`. Returns a `StepOutput`
        with a leading axis of k + 1 positions and `num_valid`: 1 + the row's accepted drafts (its
        samples at positions 0 .. num_valid - 1 are its new tokens, as a multi-step decode's)."""
        K = self.num_speculative_tokens
        if not K:
            raise ValueError("this runner has no verify step (num_speculative_tokens=0)")
        if not rows:
            raise ValueError("no rows")
        if len(rows) > self.verify_buckets[-1]:
            raise ValueError(f"{len(rows)} rows exceed the largest verify bucket {self.verify_buckets[-1]}")
        for r in rows:
            if r.num_tokens != 1 or len(r.draft_ids) > K or r.next_ids is not None:
                raise ValueError(f"a verify row takes one token and at most {K} drafts (no prompt logprobs), got "
                                 f"{r.num_tokens} tokens and {len(r.draft_ids)} drafts")
            if r.start + 1 + len(r.draft_ids) > len(r.page_ids) * self.page_size:
                need = -(-(r.start + 1 + len(r.draft_ids)) // self.page_size)
                raise ValueError(f"a row at position {r.start} with {len(r.draft_ids)} drafts needs "
                                 f"{need} pages, got {len(r.page_ids)}")
        B, T = self._shape("verify", len(rows), K + 1)
        verify = self._verify_fn(B, T)
        inputs = self._verify_inputs(rows, B)
        cached = cache_size(verify)
        t0 = time.perf_counter()
        out, self.kv = verify(self.params, self.kv, *inputs)
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        self._count(("verify", B, T), None if cached is None else cache_size(verify) > cached)
        real = sum(1 + len(r.draft_ids) for r in rows)
        self._record(StepRecord("verify", (B, T), real, B * T, seconds, *self._cost(
            [dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows])))
        valid = out.pop("num_valid")[:len(rows)]
        return StepOutput.from_arrays({**{key: value[:, :len(rows)] for key, value in out.items()},
                                       "num_valid": valid})

    def _verify_inputs(self, rows: Sequence[StepRow], B: int) -> tuple:
        """`device_steps.verify`'s inputs after the params and pages, for `rows` padded to B."""
        K = self.num_speculative_tokens
        T = K + 1
        placed = [dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows]
        placed += [None] * (B - len(rows))
        (tokens, positions, meta, _), drafts = self._pack(placed, B, T), np.full((B, K), -1, np.int32)
        for i, r in enumerate(rows):
            drafts[i, :len(r.draft_ids)] = r.draft_ids
        sampling, history = self._sampling(placed, B)
        constraints = [(r.constraint, i * T, list(r.draft_ids)) for i, r in enumerate(rows) if r.constraint is not None]
        return tokens, positions, meta, drafts, sampling, history, self.masks.device_drafts(B * T, constraints)

    def _verify_fn(self, batch: int, tokens: int):
        """The jitted verify step (`device_steps.verify`) with the backend's compiler options."""
        options = self.backend.compiler_options(batch, tokens) or {}
        key = tuple(sorted(options.items()))
        if key not in self._verify_fns:
            kwargs = {"compiler_options": options} if options else {}
            self._verify_fns[key] = jax.jit(functools.partial(device_steps.verify, self.graphdef, self.ops),
                                            donate_argnames=("kv",), **kwargs)
        return self._verify_fns[key]


def cache_size(fn) -> int | None:
    """Entries in a jitted function's compilation cache (None if this JAX does not say)."""
    size = getattr(fn, "_cache_size", None)
    return size() if callable(size) else None
