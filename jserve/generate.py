"""Host side of offline generation: groups requests, runs the steps, applies stop rules.

Requests run in static groups of up to the largest batch bucket over a contiguous cache; every
row stops on its own (EOS, stop ids, stop strings, max_tokens, context length) and its
incremental detokenizer turns ids into text that never splits a UTF-8 character.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Sequence

import numpy as np

from jserve.dense_runner import DenseRunner
from jserve.request import CompletionOutput, Logprob, RequestOutput, SamplingParams
from jserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Row:
    """One sample being generated (a request with n > 1 has n rows)."""

    request: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    limit: int  # max new tokens, context length included
    detok: object
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def sampling_row(self) -> tuple:
        p = self.params
        return (p.temperature, p.top_k, p.top_p, p.min_p, self.seed, len(self.token_ids))


class Generator:
    """Runs batches of requests to completion on a `DenseRunner`."""

    def __init__(self, runner: DenseRunner, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 *, seed: int = 0):
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._rng = np.random.default_rng(seed)

    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                 texts: Sequence[str | None]) -> list[RequestOutput]:
        max_len = self.runner.max_model_len
        rows: list[_Row] = []
        for r, (ids, p) in enumerate(zip(prompts, params)):
            if not ids:
                raise ValueError("prompt is empty: give at least one token")
            if len(ids) >= max_len:
                raise ValueError(f"prompt has {len(ids)} tokens but the model's context length is "
                                 f"{max_len}: it must be shorter to leave room for output")
            bad = [t for t in ids if not 0 <= t < self.runner.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.runner.config.vocab_size})")
            limit = max_len - len(ids) if p.max_tokens is None else min(p.max_tokens, max_len - len(ids))
            base = p.seed if p.seed is not None else int(self._rng.integers(0, 2**31))
            for i in range(p.n):
                rows.append(_Row(r, i, list(ids), p, (base + 7919 * i) % 2**32, limit,
                                 self.tokenizer.detokenizer(ids, skip_special_tokens=p.skip_special_tokens),
                                 logprobs=[] if p.logprobs is not None else None))
        prompt_lps: dict[int, list] = {}
        group = self.runner.max_batch
        for start in range(0, len(rows), group):
            self._run_group(rows[start:start + group], prompt_lps)
        outputs = []
        for r, (ids, p) in enumerate(zip(prompts, params)):
            mine = [row for row in rows if row.request == r]
            outputs.append(RequestOutput(
                request_id=str(r), prompt=texts[r], prompt_token_ids=list(ids),
                outputs=[CompletionOutput(row.index, row.text, row.token_ids, row.logprobs,
                                          row.finish_reason, row.stop_reason) for row in mine],
                prompt_logprobs=prompt_lps.get(r), finished=True))
        return outputs

    def _run_group(self, rows: list[_Row], prompt_lps: dict[int, list]) -> None:
        num_lp = max((r.params.logprobs or 0 for r in rows), default=0)
        want_plp = [r.params.prompt_logprobs for r in rows if r.params.prompt_logprobs is not None]
        num_plp = max(want_plp) if want_plp else None
        cache_len = max(len(r.prompt_ids) + r.limit for r in rows)
        out, plp, cache = self.runner.prefill([r.prompt_ids for r in rows],
                                              [r.sampling_row() for r in rows], cache_len,
                                              num_logprobs=num_lp, num_prompt_logprobs=num_plp)
        if plp is not None:
            for i, row in enumerate(rows):
                if row.params.prompt_logprobs is not None and row.request not in prompt_lps:
                    prompt_lps[row.request] = self._prompt_logprobs(row, plp, i)
        self._accept(rows, out)
        S = cache[0][0].shape[2]
        while not all(r.finish_reason for r in rows):
            last = [r.token_ids[-1] for r in rows]
            positions = [S if r.finish_reason else len(r.prompt_ids) + len(r.token_ids) - 1 for r in rows]
            out, cache = self.runner.decode(last, positions, [r.sampling_row() for r in rows], cache,
                                            num_logprobs=num_lp)
            self._accept(rows, out)

    def _accept(self, rows: list[_Row], out: dict) -> None:
        for i, row in enumerate(rows):
            if row.finish_reason:
                continue
            token = int(out["tokens"][i])
            row.token_ids.append(token)
            if row.logprobs is not None:
                row.logprobs.append(self._logprob_entry(out, i, token, row.params.logprobs))
            self._check_stop(row, token, row.detok.add([token]))
            if row.finish_reason and not isinstance(row.stop_reason, str):
                row.text += row.detok.flush()  # text held back for an incomplete character

    def _check_stop(self, row: _Row, token: int, delta: str) -> None:
        p = row.params
        prev_len = len(row.text)
        row.text += delta
        n = len(row.token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                row.finish_reason, row.stop_reason = "stop", None
                return
            if token in p.stop_token_ids:
                row.finish_reason, row.stop_reason = "stop", token
                return
            for s in p.stop:
                # Only the text that the new delta could complete needs searching.
                at = row.text.find(s, max(0, prev_len - len(s) + 1))
                if at >= 0:
                    row.text = row.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                    row.finish_reason, row.stop_reason = "stop", s
                    return
        if n >= row.limit:
            row.finish_reason = "length"

    def _logprob_entry(self, out: dict, i: int, token: int, k: int) -> dict[int, Logprob]:
        entry = {}
        for rank, (tid, lp) in enumerate(zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k]), 1):
            entry[int(tid)] = Logprob(float(lp), rank, self.tokenizer.decode([int(tid)]))
        if token not in entry:
            entry[token] = Logprob(float(out["logprob"][i]), int(out["rank"][i]),
                                   self.tokenizer.decode([token]))
        return entry

    def _prompt_logprobs(self, row: _Row, plp, i: int) -> list:
        chosen, rank, top_ids, top_lps = plp
        k = row.params.prompt_logprobs
        result: list = [None]
        for pos, token in zip(itertools.count(), row.prompt_ids[1:]):
            entry = {int(t): Logprob(float(l), r, self.tokenizer.decode([int(t)]))
                     for r, (t, l) in enumerate(zip(top_ids[i, pos][:k], top_lps[i, pos][:k]), 1)}
            if token not in entry:
                entry[token] = Logprob(float(chosen[i, pos]), int(rank[i, pos]), self.tokenizer.decode([token]))
            result.append(entry)
        return result
