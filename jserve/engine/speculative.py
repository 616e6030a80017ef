"""Speculative decoding in the engine: who proposes drafts, for which sequences, and what it earned.

`Speculator` decides each step (`jserve.core.speculative` says how a verify step keeps the
output exact):

- Turn-down: no speculation in a step with more decoding sequences than
  `disable_by_batch_size` (past it the verify step, k + 1 tokens per row, is no longer
  bandwidth-bound and costs more than the accepted tokens save; the default is the backend's
  measured `speculative_batch_limit`), nor for a sequence whose acceptance rate over its last
  `acceptance_window` proposed tokens fell below `min_acceptance` (it rests `backoff_steps` steps,
  then tries again).
- Drafts per sequence: at most k, and fewer near `max_tokens` or the context length (the step
  keeps at most drafts + 1 tokens, all of which must be allowed), and only drafts its grammar
  accepts (structured outputs).
- Proposers: `NgramProposer` (prompt lookup over the sequence's own tokens, numpy on the host)
  and `DraftModelProposer` (a smaller model on its own runner: its KV pages mirror the target's
  page ids, so it computes every chunk the target computes and proposes greedily in one
  multi-step call).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from jserve.core.plan import Request, ScheduledChunk, SchedulerProtocol, StepPlan
from jserve.core.request import GREEDY
from jserve.core.scheduler import tokens_before_recompute
from jserve.core.speculative import SpeculativeConfig
from jserve.core.stop import tokens_left
from jserve.engine.step_functions import Executed, PlainStep, StepResult, sub_plan
from jserve.runtime.steps import StepOutput, StepRow

if TYPE_CHECKING:
    from jserve.engine.config import EngineConfig
    from jserve.runtime.runner import Runner


def ngram_lookup(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: the (up to) k tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the largest n in [min_n, max_n] that occurs; [] if none.
    Vectorised: the candidates are the earlier positions of the last token, narrowed one
    token back at a time."""
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # e: tokens[e] == the last token, e < total - 1
    best = ends if min_n <= 1 else None
    for d in range(1, min(max_n, total - 1)):
        ends = ends[ends >= d]
        ends = ends[tokens[ends - d] == tokens[total - 1 - d]]
        if not len(ends):
            break
        if d + 1 >= min_n:
            best = ends  # every candidate left matches the last d + 1 tokens
    if best is None or not len(best):
        return []
    e = int(best[-1])  # the latest occurrence of the longest suffix found
    return [int(t) for t in tokens[e + 1:e + 1 + k]]


class NgramProposer:
    """Drafts from the sequence's own prompt and output (vLLM's "ngram" method)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)

    def propose(self, requests: Sequence[Request], wanted: Sequence[int]) -> list[list[int]]:
        c = self.config
        return [ngram_lookup(self._view(r), min_n=c.prompt_lookup_min, max_n=c.prompt_lookup_max, k=k) if k else []
                for r, k in zip(requests, wanted)]

    def _view(self, request: Request) -> np.ndarray:
        """The request's tokens as a numpy array, grown in place as it decodes (no copy per step)."""
        buf, n = self._tokens.get(request.request_id, (None, 0))
        total = request.num_tokens
        if buf is None or n > total or len(buf) < total:
            buf = np.empty(max(2 * total, 256), np.int32)
            n = 0
        if n < total:
            buf[n:total] = request.token_slice(n, total)
        self._tokens[request.request_id] = (buf, total)
        return buf[:total]

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def sync(self, rows: Sequence[StepRow]) -> None:
        """Nothing to keep in step: the lookup reads the tokens themselves."""


class DraftModelProposer:
    """Drafts from a smaller model with the target's vocabulary, on a runner of its own whose
    KV pages have the target's page ids and size: it computes every chunk the target does
    (`sync`), so prefix-cache hits and recomputes after preemption hold its K/V too, and proposes
    m drafts with one multi-step call of m + 1 greedy steps (the last step writes the K/V of
    draft m, which the target may accept)."""

    def __init__(self, config: SpeculativeConfig, runner: Any):
        if runner.max_decode_steps < config.num_speculative_tokens + 1:
            raise ValueError(f"the draft runner runs {runner.max_decode_steps} decode steps per call; "
                             f"k + 1 = {config.num_speculative_tokens + 1} are needed")
        self.config = config
        self.runner = runner

    def propose_rows(self, rows: Sequence[StepRow], wanted: Sequence[int]) -> list[list[int]]:
        """Drafts for decode rows (their token computed by the draft model too, and `wanted[i]`
        more after it, in one call)."""
        draft_rows = [_greedy(r, decode_steps=k + 1) for r, k in zip(rows, wanted)]
        out = self.runner.execute_decode_steps(draft_rows)
        return [[int(t) for t in out.tokens[:k, i]] for i, k in enumerate(wanted)]

    def sync(self, rows: Sequence[StepRow]) -> None:
        """Compute the target's chunks in the draft model's pages (nothing it samples is used)."""
        if rows:
            self.runner.execute([_greedy(r) for r in rows])

    def forget(self, request_id: str) -> None:
        pass


def _greedy(row: StepRow, decode_steps: int = 1) -> StepRow:
    """The row as the draft model runs it: greedy, no penalties, grammar, bans or prompt logprobs."""
    return dataclasses.replace(row, sampling=GREEDY, penalty_tokens=None, grammar_matcher=None, prompt_targets=None,
                               stop_ids=(), min_new=0, decode_steps=decode_steps, draft_ids=(), banned_ids=())


@dataclasses.dataclass
class _Acceptance:
    recent: collections.deque  # the outcomes (1 accepted, 0 rejected) of the last proposed tokens
    resting: int = 0  # steps left without proposals


class Speculator:
    """Per step: which decode chunks get how many drafts; per request: its acceptance; in all:
    the counters behind `/metrics` and `llm.stats()`."""

    def __init__(self, config: SpeculativeConfig, max_len: int, proposer: Any, batch_limit: int,
                 recompute_past: int | None = None):
        """`batch_limit`: the most decoding sequences a step speculates with (the config's
        `disable_by_batch_size`, or the backend's default, within the runner's verify buckets);
        `recompute_past`: the scheduler's (drafts never take a sequence across it)."""
        self.config = config
        self.max_len = max_len
        self.recompute_past = recompute_past
        self.proposer = proposer
        self.disable_by_batch_size = batch_limit
        self._acceptance: dict[str, _Acceptance] = {}
        self.num_proposed = 0  # draft tokens verified
        self.num_accepted = 0  # of those, accepted
        self.num_verify_rows = 0  # rows verified with drafts (one per sequence and verify step)
        self.accepted_per_position = [0] * config.num_speculative_tokens  # rows whose i-th draft was accepted
        self.num_verify_steps = 0
        self.num_turned_down = 0  # steps that could have speculated but ran plain (batch size)

    def wanted(self, chunks: Sequence[ScheduledChunk]) -> list[int] | None:
        """Drafts to ask for per decode chunk, or None: this step runs without speculation. The
        drafts are not taken out of the step's token budget (which chunked prefill fills): the
        verify call is a shape of its own, at most `disable_by_batch_size` x (k + 1) tokens."""
        if len(chunks) > self.disable_by_batch_size:
            self.num_turned_down += 1
            return None
        k = self.config.num_speculative_tokens
        out = []
        for chunk in chunks:
            req = chunk.request
            state = self._acceptance.get(req.request_id)
            if state is None:
                state = self._acceptance[req.request_id] = _Acceptance(
                    collections.deque(maxlen=self.config.acceptance_window))
            if state.resting:
                state.resting -= 1
                out.append(0)
                continue
            if req.params.bans_depend_on_output:  # a draft's bans would depend on the drafts before it
                out.append(0)
                continue
            # The step keeps up to drafts + 1 tokens: all must fit max_tokens and the context.
            left = tokens_left(req.params, len(req.output_token_ids), req.num_tokens, self.max_len)
            before = tokens_before_recompute(req.num_tokens, self.recompute_past)
            out.append(max(0, min(k, left - 1, left - 1 if before is None else before - 1)))
        return out if any(out) else None

    def valid_drafts(self, drafts: list[int], matcher: Any) -> list[int]:
        """The leading drafts a sequence's grammar accepts (all without one)."""
        return drafts if matcher is None or not drafts else drafts[:matcher.valid_prefix(drafts)]

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verified row: `proposed` drafts, `accepted` of them confirmed (a row without drafts
        is not counted: the mean accepted length is over rows that proposed, as vLLM's)."""
        if not proposed:
            return
        self.num_verify_rows += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        c = self.config
        state = self._acceptance.get(request_id)
        if state is None:
            return
        state.recent.extend([1] * accepted + [0] * (proposed - accepted))
        window = state.recent
        if c.min_acceptance and len(window) >= c.acceptance_window and sum(window) < c.min_acceptance * len(window):
            state.resting = c.backoff_steps
            state.recent.clear()

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)

    def stats(self) -> dict[str, Any]:
        return {
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
            "spec_verify_rows": self.num_verify_rows,
            "spec_verify_steps": self.num_verify_steps,
            "spec_turned_down_steps": self.num_turned_down,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            # Tokens each verified row gained per step: 1 + its accepted drafts.
            "spec_mean_accepted_length": 1 + self.num_accepted / self.num_verify_rows if self.num_verify_rows else 0.0,
        }


def build_speculator(config: EngineConfig, runner: Runner, draft_runner: Runner | None,
                     scheduler: SchedulerProtocol) -> Speculator | None:
    """The engine's speculator for `config.speculative_config` (None without one); `draft_runner`:
    the draft model's runner, for method "draft_model" (its pages must mirror `runner`'s)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        if draft_runner is None:
            raise ValueError("speculative_config method 'draft_model' needs the draft model's runner")
        if (draft_runner.num_pages, draft_runner.page_size) != (runner.num_pages, runner.page_size):
            raise ValueError(f"the draft runner's pages ({draft_runner.num_pages} x {draft_runner.page_size}) must "
                             f"mirror the target's ({runner.num_pages} x {runner.page_size})")
        proposer: Any = DraftModelProposer(spec, draft_runner)
    else:
        proposer = NgramProposer(spec)
    limit = spec.disable_by_batch_size or runner.backend.speculative_batch_limit or runner.verify_buckets[-1]
    # No more rows than the runner compiled a verify step for.
    return Speculator(spec, scheduler.max_len if hasattr(scheduler, "max_len") else config.max_model_len, proposer,
                      min(limit, runner.verify_buckets[-1]), recompute_past=runner.config.long_rope_after)


class SpeculativeStep(PlainStep):
    """A step with drafts where the speculator wants them: reserve their pages, propose, verify
    the decode chunks in one call (`Runner.execute_verify`) beside a plain call for the plan's
    other chunks, and once the update took the accepted tokens, record the acceptance and give
    back the rejected drafts' pages. Otherwise a plain step (the draft model computes it too)."""

    def __init__(self, runner: Any, stop_policy: Any, scheduler: SchedulerProtocol, speculator: Speculator):
        super().__init__(runner, stop_policy)
        self.scheduler = scheduler
        self.speculator = speculator

    def __call__(self, plan: StepPlan) -> StepResult:
        if not plan.chunks:
            return StepResult()
        result = self._speculate(plan)
        if result is None:
            rows = self.rows(plan)
            result = StepResult([Executed(plan, self.runner.execute(rows))])
            self.speculator.proposer.sync(rows)  # a draft model computes what the target did
        return result

    def _drafts(self, plan: StepPlan, decode: list[int]) -> tuple[list[StepRow], list[list[int]]] | None:
        """Reserve the drafts' pages and propose them: the plan's rows (their pages covering the
        drafts) and each decode chunk's drafts; None where none is proposed or speculation is
        turned down (no pages taken)."""
        spec, chunks = self.speculator, [plan.chunks[i] for i in decode]
        wanted = spec.wanted(chunks)
        if wanted is None:
            return None
        draft_model = isinstance(spec.proposer, DraftModelProposer)
        drafts: list[list[int]] = []
        if not draft_model:  # n-gram drafts first: no pages are taken for a step that finds none
            drafts = [spec.valid_drafts(d[:n], c.request.grammar) for d, n, c in
                      zip(spec.proposer.propose([c.request for c in chunks], wanted), wanted, chunks)]
            if not any(drafts):
                return None
            wanted = [len(d) for d in drafts]
        wanted = [n if self.scheduler.reserve_drafts(c, n) else 0 for c, n in zip(chunks, wanted)]
        if not draft_model and not any(wanted):  # every reservation failed: a plain step
            return None
        rows = self.rows(plan)  # after the reservations: the chunks' pages cover the drafts
        if draft_model:
            proposed = spec.proposer.propose_rows([rows[i] for i in decode], wanted)
            return rows, [spec.valid_drafts(d, c.request.grammar) for d, c in zip(proposed, chunks)]
        return rows, [d[:n] for d, n in zip(drafts, wanted)]

    def _speculate(self, plan: StepPlan) -> StepResult | None:
        decode = [i for i, c in enumerate(plan.chunks)
                  if c.num_tokens == 1 and c.emits_token and c.request.prompt_targets(c) is None]
        proposal = self._drafts(plan, decode) if decode else None
        if proposal is None:
            return None
        rows, drafts = proposal
        spec, result = self.speculator, StepResult()
        others = [i for i in range(len(plan.chunks)) if i not in set(decode)]
        if others:  # prefill chunks: a plain call (the draft model computes them too)
            other_rows = [rows[i] for i in others]
            result.executed.append(Executed(sub_plan(plan, others), self.runner.execute(other_rows), steps=0))
            spec.proposer.sync(other_rows)
        out = self.runner.execute_verify([dataclasses.replace(rows[i], draft_ids=d) for i, d in zip(decode, drafts)])
        spec.num_verify_steps += 1
        result.executed.append(Executed(sub_plan(plan, decode), out))
        chunks = [plan.chunks[i] for i in decode]
        result.then.append(lambda: self._after_verify(chunks, drafts, out))
        return result

    def _after_verify(self, chunks, drafts, out: StepOutput) -> None:
        for chunk, d, valid in zip(chunks, drafts, out.num_valid):
            self.speculator.record(chunk.request.request_id, len(d), int(valid) - 1)
            self.scheduler.release_lookahead(chunk.request.request_id)
