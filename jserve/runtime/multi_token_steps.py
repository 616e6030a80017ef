"""The runner's steps that compute several tokens per row in one call: multi-step decode
(`execute_decode_steps`: up to K decode steps, each sample fed back on the device) and the
speculative verify step (`execute_verify`: a row's token and its drafts, the drafts its samples
confirm accepted). Composed by `jserve.runtime.runner.Runner`, whose public packing, shapes and
step log they use."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np

from jserve.core import buckets
from jserve.core.stop import MAX_DEVICE_STOP_IDS
from jserve.runtime import device_steps, step_rows
from jserve.runtime.steps import StepOutput, StepRecord, StepRow


def _count_arg(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class MultiTokenSteps:
    """Multi-step decode and the verify step over a runner (see the module docstring)."""

    def __init__(self, runner: Any, max_decode_steps: int, num_speculative_tokens: int,
                 max_verify_rows: int | None):
        """`max_decode_steps` K > 1 compiles a K-step decode per decode batch bucket;
        `num_speculative_tokens` k > 0 a verify step of k + 1 tokens per row for the batch
        buckets up to the one holding `max_verify_rows` (None: all). One group, one process."""
        self.runner = runner
        self.max_decode_steps = _count_arg("max_decode_steps", max_decode_steps, 1)
        self.num_speculative_tokens = _count_arg("num_speculative_tokens", num_speculative_tokens, 0)
        if max_decode_steps > 1:
            runner.require_single_group(f"multi-step decode (max_decode_steps={max_decode_steps})")
        if num_speculative_tokens:
            runner.require_single_group("speculative decoding")
        sizes = runner.batch_buckets
        cap = sizes[-1] if max_verify_rows is None else buckets.pick(sizes, min(max_verify_rows, sizes[-1]))
        self.verify_buckets = tuple(b for b in sizes if b <= cap)
        self.multi_decode = jax.jit(functools.partial(
            device_steps.multi_decode, runner.graphdef, runner.ops, runner.page_size, runner.config.vocab_size,
            max_decode_steps), donate_argnames=("kv",))
        self._verify_fns: dict[tuple, Any] = {}  # compiler options -> the jitted verify step

    def compiled_fns(self) -> list:
        return [self.multi_decode, *self._verify_fns.values()]

    def execute_decode_steps(self, rows: Sequence[StepRow]) -> StepOutput:
        """Run up to `max_decode_steps` decode steps in one call, each row's sample fed back as its
        next token on the device (multi-step decode).

        Each row has one token, `decode_steps` in 1 .. `max_decode_steps`, pages for every step's
        position, and its `stop_ids` / `min_new` (only the first MAX_DEVICE_STOP_IDS ids are checked
        here: the host checks all, and drops what follows a stop); penalties see each sample.
        Returns a `StepOutput` with a leading axis of `max_decode_steps`, and `num_valid`.
        """
        runner, K = self.runner, self.max_decode_steps
        self._check_rows(rows, runner.batch_buckets[-1], "decode")
        if any(r.grammar_matcher is not None or r.sampling.bans_depend_on_output for r in rows):
            raise ValueError("a row with a grammar or a bad word of several tokens runs in single steps: its mask "
                             "needs each sample on the host")
        if any(not 1 <= r.decode_steps <= K for r in rows):
            raise ValueError(f"decode_steps must be in [1, {K}], got {[r.decode_steps for r in rows]}")
        for r in rows:
            if r.start + r.decode_steps > len(r.page_ids) * runner.page_size:
                raise ValueError(f"a row at position {r.start} running {r.decode_steps} steps needs "
                                 f"{-(-(r.start + r.decode_steps) // runner.page_size)} pages, got {len(r.page_ids)}")
        B = runner.shape("multi_decode", len(rows), K)[0]
        inputs = self.multi_decode_inputs(rows, B)
        out, seconds = runner.compiles.timed(("multi_decode", B, K), lambda: [self.multi_decode],
                                             lambda: runner.run_program(self.multi_decode, *inputs))
        valid = out.pop("num_valid")[:len(rows)]
        ran = int(valid.max())
        # Per step, the rows still running: their real tokens, bytes and FLOPs.
        cost = [runner.cost([StepRow(r.start + j, [0], ()) for r, n in zip(rows, valid) if j < n]) for j in range(ran)]
        runner.step_log.add(StepRecord("decode", (B, 1), int(valid.sum()), B * ran, seconds, sum(c[0] for c in cost),
                                       sum(c[1] for c in cost), steps=ran))
        return StepOutput.from_arrays({**{key: value[:, :len(rows)] for key, value in out.items()},
                                       "num_valid": valid})

    @staticmethod
    def _check_rows(rows: Sequence[StepRow], cap: int, what: str) -> None:
        if not rows:
            raise ValueError("no rows")
        if len(rows) > cap:
            raise ValueError(f"{len(rows)} rows exceed the largest {what} bucket {cap}")
        if what == "decode" and any(r.num_tokens != 1 for r in rows):
            raise ValueError("a multi-step decode takes exactly one token per row")

    def multi_decode_inputs(self, rows: Sequence[StepRow], B: int) -> tuple:
        """`device_steps.multi_decode`'s inputs after the params and pages, for `rows` padded to B."""
        placed = list(rows) + [None] * (B - len(rows))
        tokens, positions, meta, _ = self.runner.pack(placed, B, 1)
        steps = np.zeros((B,), np.int32)
        steps[:len(rows)] = [r.decode_steps for r in rows]
        stop_ids = np.full((B, MAX_DEVICE_STOP_IDS), -1, np.int32)
        min_new = np.zeros((B,), np.int32)
        for i, r in enumerate(rows):
            ids = list(r.stop_ids)[:MAX_DEVICE_STOP_IDS]
            stop_ids[i, :len(ids)] = ids
            min_new[i] = r.min_new
        sampling, history = self.runner.sampling_inputs(placed, B)
        lora = None if self.runner.lora is None else step_rows.lora_ids(placed, B, 1)[:, 0]
        pages = meta.page_indices if meta.local_page_indices is None else (meta.page_indices, meta.local_page_indices)
        return tokens[:, 0], positions[:, 0], pages, steps, stop_ids, min_new, sampling, history, lora

    def execute_verify(self, rows: Sequence[StepRow]) -> StepOutput:
        """A speculative step: each decode row's token and its `draft_ids` (at most
        `num_speculative_tokens`) computed in one call, sampled at every position, and the drafts
        its samples confirm accepted (`device_steps.verify`).

        Each row has one token and pages for `start + len(draft_ids)`. Returns a `StepOutput`
        with a leading axis of k + 1 positions and `num_valid`: 1 + the row's accepted drafts (its
        samples at positions 0 .. num_valid - 1 are its new tokens, as a multi-step decode's)."""
        runner, K = self.runner, self.num_speculative_tokens
        if not K:
            raise ValueError("this runner has no verify step (num_speculative_tokens=0)")
        self._check_rows(rows, self.verify_buckets[-1] if self.verify_buckets else 0, "verify")
        for r in rows:
            if r.num_tokens != 1 or len(r.draft_ids) > K or r.prompt_targets is not None:
                raise ValueError(f"a verify row takes one token and at most {K} drafts (no prompt logprobs), got "
                                 f"{r.num_tokens} tokens and {len(r.draft_ids)} drafts")
            if r.start + 1 + len(r.draft_ids) > len(r.page_ids) * runner.page_size:
                need = -(-(r.start + 1 + len(r.draft_ids)) // runner.page_size)
                raise ValueError(f"a row at position {r.start} with {len(r.draft_ids)} drafts needs "
                                 f"{need} pages, got {len(r.page_ids)}")
        B, T = runner.shape("verify", len(rows), K + 1)
        verify = self.verify_fn(B, T)
        inputs = self.verify_inputs(rows, B)
        out, seconds = runner.compiles.timed(("verify", B, T), lambda: [verify],
                                             lambda: runner.run_program(verify, *inputs))
        real = sum(1 + len(r.draft_ids) for r in rows)
        runner.step_log.add(StepRecord("verify", (B, T), real, B * T, seconds, *runner.cost(
            [dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows])))
        valid = out.pop("num_valid")[:len(rows)]
        return StepOutput.from_arrays({**{key: value[:, :len(rows)] for key, value in out.items()},
                                       "num_valid": valid})

    def verify_inputs(self, rows: Sequence[StepRow], B: int) -> tuple:
        """`device_steps.verify`'s inputs after the params and pages, for `rows` padded to B."""
        K = self.num_speculative_tokens
        T = K + 1
        placed = [dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows]
        placed += [None] * (B - len(rows))
        (tokens, positions, meta, _), drafts = self.runner.pack(placed, B, T), np.full((B, K), -1, np.int32)
        for i, r in enumerate(rows):
            drafts[i, :len(r.draft_ids)] = r.draft_ids
        sampling, history = self.runner.sampling_inputs(placed, B)
        constraints = [(r.grammar_matcher, i * T, list(r.draft_ids)) for i, r in enumerate(rows)
                       if r.grammar_matcher is not None]
        lora = None if self.runner.lora is None else step_rows.lora_ids(placed, B, T)
        return (tokens, positions, meta, drafts, sampling, history, self.runner.masks.device_drafts(B * T, constraints),
                lora)

    def verify_fn(self, batch: int, tokens: int):
        """The jitted verify step (`device_steps.verify`) with the backend's compiler options."""
        runner = self.runner
        options = runner.backend.compiler_options(batch, tokens) or {}
        key = tuple(sorted(options.items()))
        if key not in self._verify_fns:
            kwargs = {"compiler_options": options} if options else {}
            self._verify_fns[key] = jax.jit(functools.partial(device_steps.verify, runner.graphdef, runner.ops),
                                            donate_argnames=("kv",), **kwargs)
        return self._verify_fns[key]
