"""LLMEngine: continuous batching over the paged runner (add_request / step / abort).

Each `step()` asks the scheduler for a plan, runs it on the runner, hands the sampled tokens back
to the scheduler, and turns them into text: incremental detokenization, stop strings, stop ids,
EOS, max_tokens. A request with `n > 1` runs as n sequences (their shared prompt pages come from
the prefix cache) gathered into one `RequestOutput`. With `num_scheduler_steps` K > 1, a step
where only decodes run is one device call of up to K decode steps (see `jserve.core.scheduler`); the
engine then takes its tokens one step at a time, with the same stop checks, so the outputs are
those of K single steps. A request with structured outputs gets a grammar matcher per sequence
(`jserve.structured.grammar`): its rows carry it to the runner, which fills their token bitmask,
and each sampled token advances it; a complete grammar ends the sequence ("stop").

With `async_scheduling` (`_step_overlapped`), a step is dispatched (`Runner.launch`) and, before its
samples are read, the scheduler plans the next one: the launched step's sampled tokens are
recorded as placeholders (`PLACEHOLDER`), so its decode rows get their next slots, and the next
step's decode rows take those tokens from the launched step's samples on the device. Then the
host reads the first step (`Runner.collect`), patches the placeholders (`Scheduler.patch_token`,
before any page holding them is hashed for the prefix cache) and runs the stop checks: a
sequence that stopped there had one more row in the step already dispatched, whose sample is
dropped (the scheduler no longer knows it). A step with penalties, a grammar or prompt logprobs
needs the tokens before it on the host: it runs after the step before it is read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import numpy as np

from jserve.core.dp_scheduler import DataParallelScheduler
from jserve.core.page_table import PageTable
from jserve.core.plan import Request, RequestStatus, ScheduledChunk, SchedulerProtocol, StepPlan
from jserve.core.request import CompletionOutput, Logprob, RequestOutput, SamplingParams
from jserve.core.scheduler import Scheduler
from jserve.core.stop import Stop, StopPolicy
from jserve.engine.config import EngineConfig
from jserve.engine.speculative import DraftModelProposer, build_speculator
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepOutput, StepRow
from jserve.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from jserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # async scheduling: a sampled token still on the device


@dataclasses.dataclass
class _Launched:
    """A step on the device whose samples the host has not read (async scheduling)."""

    plan: StepPlan
    launched: Any  # jserve.runtime.overlap.Launched
    took: list[tuple[Request, int, int]]  # (request, its output index, its row) of each placeholder


@dataclasses.dataclass(eq=False)
class _Sequence:
    """Host-side text state of one sampled sequence."""

    group: "_Group"
    index: int
    request: Request
    detok: Any
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    matcher: GrammarMatcher | None = None  # its grammar, for structured outputs


@dataclasses.dataclass(eq=False)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, list(s.request.output_token_ids),
                                 None if s.logprobs is None else list(s.logprobs),
                                 s.request.status.finish_reason, s.stop_reason) for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.prompt_logprobs,
                             finished=all(s.request.is_finished for s in self.sequences))


class LLMEngine:
    """The continuous-batching engine: requests in, `RequestOutput`s out, one step at a time."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 config: EngineConfig, quantization: dict[str, Any] | None = None,
                 draft_runner: Runner | None = None):
        """`draft_runner`: the draft model's runner, for `speculative_config` method "draft_model"
        (its pages mirror `runner`'s: same count and size)."""
        self.runner = runner
        # generation.json's quantization record with its quality report (None: float weights)
        self.quantization = quantization
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_policy = StopPolicy(self.eos_token_ids, runner.config.vocab_size)
        dp = runner.dp
        # Pages behind a window every layer shares are given back, unless a draft model (whose
        # attention may see every position) reads the same pages.
        window = runner.config.shared_window if draft_runner is None else None
        self.page_tables = [PageTable(runner.pages_per_group, runner.page_size, sliding_window=window,
                                      enable_prefix_caching=config.enable_prefix_caching) for _ in range(dp)]
        self.page_table = self.page_tables[0]
        self.scheduler: SchedulerProtocol
        # A LongRoPE model recomputes a sequence as it passes its original context (jserve.core.scheduler).
        recompute = dict(recompute_past=runner.config.long_rope_after)
        if dp == 1:
            self.scheduler = Scheduler(dataclasses.replace(config.scheduler_config(), **recompute), self.page_table)
        else:  # one scheduler per data-parallel group, each with its share of seqs and tokens
            share = dataclasses.replace(config.scheduler_config(dp), **recompute)
            self.scheduler = DataParallelScheduler([Scheduler(share, t) for t in self.page_tables])
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._rng = np.random.default_rng(config.seed)
        self.num_steps = 0
        # The structured-output constraints' compiler and cache (thread-safe: the server compiles
        # in it before a request reaches this thread; llguidance reads the vocabulary on first use).
        self.grammars = GrammarCompiler(tokenizer, runner.config.vocab_size, sorted(self.eos_token_ids))
        self.num_structured_requests = 0
        self.num_grammar_errors = 0  # sampled tokens a grammar refused (a bug if ever > 0)
        self.speculator = build_speculator(config, runner, draft_runner, self.scheduler)
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling and not runner.launchable:
            raise ValueError(f"async_scheduling runs on one data-parallel group in one process; this "
                             f"runner has dp={runner.dp}{' over several processes' if runner.multiprocess else ''}")
        if self.async_scheduling and getattr(runner.config, "long_rope_after", None) is not None:
            raise ValueError("async_scheduling does not combine with a LongRoPE model's recompute past its "
                             "original context (the recompute needs each sampled token on the host)")
        self._inflight: _Launched | None = None
        self.num_sync_steps = 0  # async scheduling: steps that waited for the one before (see the module)

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request; ValueError (naming the value) for ids outside the vocabulary or a
        prompt that leaves no room for output in the context. `grammar`: its structured-outputs
        constraint compiled already (`self.grammars.compile`, off this thread); else it is
        compiled here when the request has one."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.stop_policy.validate(params)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but the context length is {limit}: "
                             f"it must be shorter to leave room for output")
        # A constraint the library refuses is a ValueError (GrammarError) naming what is wrong.
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        group = _Group(request_id, prompt, ids, params)
        if params.prompt_logprobs is not None:
            if self.runner.multiprocess:
                raise ValueError("prompt_logprobs is not available in a multi-process run")
            group.prompt_logprobs = [None]  # the first token has none; the prefill fills the rest
        base = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for i in range(params.n):
            # Each sample runs as its own sequence; a seed per sample keeps them distinct.
            seed = (base + 7919 * i) % 2**32
            sub = dataclasses.replace(params, n=1, seed=seed)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            salt = cache_salt
            if i == 0 and params.prompt_logprobs is not None:
                # Its prefill computes every prompt position (no prefix-cache hit skips any).
                salt = f"{cache_salt or ''}\x00prompt-logprobs\x00{request_id}"
            req = Request(rid, list(ids), sub, arrival, priority=priority, cache_salt=salt)
            detok = self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
            seq = _Sequence(group, i, req, detok, logprobs=[] if params.logprobs is not None else None,
                            matcher=grammar.matcher() if grammar is not None else None)
            group.sequences.append(seq)
        added = []
        try:
            for seq in group.sequences:
                self.scheduler.add_request(seq.request)  # validates against the pool size too
                added.append(seq.request.request_id)
        except ValueError:
            for rid in added:
                self.scheduler.abort_request(rid)
            raise
        for seq in group.sequences:
            self._sequences[seq.request.request_id] = seq
        self._groups[request_id] = group
        if grammar is not None:
            self.num_structured_requests += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples); its pages are free at once. None if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.sequences:
            self.scheduler.abort_request(seq.request.request_id)
            self._forget(seq.request.request_id)
        return group.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the current output of every request that changed."""
        if self.async_scheduling:
            return self._step_overlapped()
        plan = self.scheduler.schedule()
        changed: dict[str, _Group] = {}
        if plan.num_steps > 1:
            self._decode_steps(plan, changed)
        elif plan.chunks and not (self.speculator is not None and self._speculate(plan, changed)):
            rows = self._step_rows(plan)
            out = self.runner.execute(rows)
            if self.speculator is not None:
                self.speculator.proposer.sync(rows)  # a draft model computes what the target did
            self.num_steps += 1
            self._take(plan, out, changed)
        return self._outputs(changed)

    def _outputs(self, changed: dict[str, "_Group"]) -> list[RequestOutput]:
        """The changed requests' outputs; finished ones are forgotten."""
        outputs = []
        for rid, group in changed.items():
            output = group.output()
            outputs.append(output)
            if output.finished:
                self._groups.pop(rid, None)
                for seq in group.sequences:
                    self._forget(seq.request.request_id)
        if not self._groups:
            self.runner.mark_idle()  # the wait for the next request is no gap between steps
        return outputs

    # ------------------------------------------------------------------------------ async scheduling

    def _step_overlapped(self) -> list[RequestOutput]:
        """One iteration with async scheduling (see the module's notes): plan and launch the next
        step, then read the one in flight, then record the new step's samples as placeholders
        (after the outputs are taken: a request the update ends at the context length shows its
        last token once it is read)."""
        changed: dict[str, _Group] = {}
        inflight, self._inflight = self._inflight, None
        plan = self.scheduler.schedule()
        launched = None
        if plan.chunks and self._may_launch(plan):
            slot = {} if inflight is None else {req.request_id: inflight.launched.slots[i]
                                                for req, _, i in inflight.took}
            feed = [slot.get(c.request.request_id, -1) if list(c.token_ids) == [PLACEHOLDER] else -1
                    for c in plan.chunks]
            if all(PLACEHOLDER not in c.token_ids or f >= 0 for c, f in zip(plan.chunks, feed)):
                launched = self.runner.launch(self._step_rows(plan), inflight and inflight.launched, feed)
        if inflight is not None:
            self._read(inflight, changed)
        if launched is not None:
            outputs = self._outputs(changed)
            self.num_steps += 1
            took = self.scheduler.update(plan, {c.request.request_id: PLACEHOLDER for c in plan.chunks if c.samples})
            row = {c.request.request_id: i for i, c in enumerate(plan.chunks)}
            self._inflight = _Launched(plan, launched, [(r, len(r.output_token_ids) - 1, row[r.request_id])
                                                        for r in took])
            return outputs
        # Nothing launched: the plan runs now, with the tokens just read (those of requests that
        # ended meanwhile are dropped).
        keep = [i for i, c in enumerate(plan.chunks) if self.scheduler.get_request(c.request.request_id) is c.request]
        if keep:
            plan = _sub_plan(plan, keep)
            for c in plan.chunks:
                if PLACEHOLDER in c.token_ids:
                    c.token_ids = c.request.token_slice(c.start, c.start + c.num_tokens)
            self.num_sync_steps += 1
            self.num_steps += 1
            self._take(plan, self.runner.execute(self._step_rows(plan)), changed)
        return self._outputs(changed)

    def _may_launch(self, plan: StepPlan) -> bool:
        """Whether a plan can run before the step in flight is read: no row needs the tokens
        before it on the host (penalties, a grammar's mask, prompt logprobs)."""
        if plan.num_steps != 1:
            return False
        for c in plan.chunks:
            seq = self._sequences.get(c.request.request_id)
            if self._next_ids(c) is not None or (c.samples and (
                    c.request.params.has_penalties or (seq is not None and seq.matcher is not None))):
                return False
        return True

    def _read(self, inflight: _Launched, changed: dict[str, "_Group"]) -> None:
        """Read a launched step's samples: patch its placeholders, then accept each token."""
        out = self.runner.collect(inflight.launched)
        for req, index, i in inflight.took:
            self.scheduler.patch_token(req, index, int(out.tokens[i]))
        for req, index, i in inflight.took:
            seq = self._sequences.get(req.request_id)
            if seq is None or seq.request is not req:
                continue  # aborted meanwhile
            assert len(req.output_token_ids) == index + 1, (req.request_id, index, len(req.output_token_ids))
            self._accept(seq, out, i)
            changed[seq.group.request_id] = seq.group

    def _forget(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _speculate(self, plan: StepPlan, changed: dict[str, "_Group"]) -> bool:
        """Run the plan as a speculative step if the speculator wants one: its decode chunks get
        drafts and one verify call (`Runner.execute_verify`), its other chunks (prefill) a plain
        call. False (nothing run) where no draft is proposed or speculation is turned down."""
        spec = self.speculator
        decode = [i for i, c in enumerate(plan.chunks)
                  if c.num_tokens == 1 and c.samples and self._next_ids(c) is None]
        if not decode:
            return False
        chunks = [plan.chunks[i] for i in decode]
        matchers = [getattr(self._sequences.get(c.request.request_id), "matcher", None) for c in chunks]
        wanted = spec.wanted(chunks)
        if wanted is None:
            return False
        draft_model = isinstance(spec.proposer, DraftModelProposer)
        if not draft_model:  # n-gram drafts first: no pages are taken for a step that finds none
            drafts = [spec.valid_drafts(d[:n], m) for d, n, m in
                      zip(spec.proposer.propose([c.request for c in chunks], wanted), wanted, matchers)]
            if not any(drafts):
                return False
            wanted = [len(d) for d in drafts]
        wanted = [n if self.scheduler.reserve_drafts(c, n) else 0 for c, n in zip(chunks, wanted)]
        if not draft_model and not any(wanted):  # every reservation failed: a plain step
            return False
        rows = self._step_rows(plan)  # after the reservations: the chunks' pages cover the drafts
        if draft_model:
            proposed = spec.proposer.propose_rows([rows[i] for i in decode], wanted)
            drafts = [spec.valid_drafts(d, m) for d, m in zip(proposed, matchers)]
        else:
            drafts = [d[:n] for d, n in zip(drafts, wanted)]
        others = [i for i in range(len(plan.chunks)) if i not in set(decode)]
        if others:  # prefill chunks: a plain call (the draft model computes them too)
            sub = _sub_plan(plan, others)
            other_rows = [rows[i] for i in others]
            out = self.runner.execute(other_rows)
            spec.proposer.sync(other_rows)
            self._take(sub, out, changed)
        verify = [dataclasses.replace(rows[i], draft_ids=d) for i, d in zip(decode, drafts)]
        out = self.runner.execute_verify(verify)
        self.num_steps += 1
        spec.num_verify_steps += 1
        self._take_steps(_sub_plan(plan, decode), out, changed)
        for chunk, d, valid in zip(chunks, drafts, out.num_valid):
            spec.record(chunk.request.request_id, len(d), int(valid) - 1)
            self.scheduler.release_lookahead(chunk.request.request_id)
        return True

    def _step_rows(self, plan: StepPlan) -> list[StepRow]:
        """The runner's rows for a plan's chunks."""
        rows = []
        for chunk, group in zip(plan.chunks, plan.groups):
            req = chunk.request
            p = req.params
            # Stop ids on the device: only a multi-step call checks them.
            stop_ids, min_new = (self.stop_policy.device_stops(p, len(req.output_token_ids))
                                 if chunk.num_steps > 1 else ((), 0))
            history = (req.prompt_token_ids, req.output_token_ids) if chunk.samples and p.has_penalties else None
            seq = self._sequences.get(req.request_id)
            constraint = seq.matcher if seq is not None and chunk.samples else None
            rows.append(StepRow(chunk.start, chunk.token_ids, chunk.page_ids, p, len(req.output_token_ids),
                                history, group, chunk.num_steps, stop_ids, min_new, self._next_ids(chunk),
                                constraint, seq_len=req.num_tokens))
        return rows

    def _next_ids(self, chunk: ScheduledChunk) -> list[int] | None:
        """For a chunk of the sequence that scores its request's prompt, while positions of it are
        unscored: the token after each of the chunk's positions (-1 past the prompt)."""
        seq = self._sequences.get(chunk.request.request_id)
        if seq is None or seq.index != 0 or seq.group.prompt_logprobs is None:
            return None
        prompt = seq.group.prompt_token_ids
        scored = len(seq.group.prompt_logprobs)
        if scored >= len(prompt) or chunk.start + chunk.num_tokens < scored:
            return None
        return [prompt[q + 1] if q + 1 < len(prompt) else -1
                for q in range(chunk.start, chunk.start + chunk.num_tokens)]

    def _take_prompt_logprobs(self, plan: StepPlan, out: StepOutput) -> None:
        """Append the prompt logprobs a step computed to their requests', in position order."""
        for i, chunk in enumerate(plan.chunks):
            scored = out.prompt[i] if out.prompt is not None else None
            seq = self._sequences.get(chunk.request.request_id)
            if scored is None or seq is None:
                continue
            group, k = seq.group, seq.group.params.prompt_logprobs
            for j, q in enumerate(range(chunk.start, chunk.start + chunk.num_tokens)):
                if q + 1 != len(group.prompt_logprobs) or q + 1 >= len(group.prompt_token_ids):
                    continue  # scored before (a recompute after preemption), or past the prompt
                group.prompt_logprobs.append(self._logprob_entry(
                    scored.top_ids[j], scored.top_logprobs[j], scored.logprob[j], scored.rank[j],
                    group.prompt_token_ids[q + 1], k))

    def _take(self, plan: StepPlan, out: StepOutput, changed: dict[str, "_Group"]) -> None:
        """Hand a step's samples (a row per chunk of `plan`) to the scheduler and accept each new
        token (logprobs, text, stop checks)."""
        self._take_prompt_logprobs(plan, out)
        sampled = {c.request.request_id: int(out.tokens[i]) for i, c in enumerate(plan.chunks) if c.samples}
        index = {c.request.request_id: i for i, c in enumerate(plan.chunks)}
        for req in self.scheduler.update(plan, sampled):
            seq = self._sequences.get(req.request_id)
            if seq is None:
                continue
            self._accept(seq, out, index[req.request_id])
            changed[seq.group.request_id] = seq.group

    def _decode_steps(self, plan: StepPlan, changed: dict[str, "_Group"]) -> None:
        """Run a multi-step decode plan, then take its tokens step by step as single steps would."""
        self.num_steps += self._take_steps(plan, self.runner.execute_decode_steps(self._step_rows(plan)), changed)

    def _take_steps(self, plan: StepPlan, out: StepOutput, changed: dict[str, "_Group"]) -> int:
        """Take several tokens per chunk (a multi-step decode's, or a verify step's accepted ones:
        `out` has a leading axis of steps and `num_valid`) one step at a time, as single steps
        would; returns the steps taken."""
        taken = 0
        valid = out.num_valid
        live = list(enumerate(plan.chunks))
        for j in range(int(valid.max())):
            if j:  # the requests that took step j - 1's token and go on
                live = [(i, nxt) for i, c in live if j < valid[i]
                        and (nxt := self.scheduler.next_decode_step(c)) is not None]
                if not live:
                    break
            rows = [i for i, _ in live]
            sub = dataclasses.replace(plan, chunks=[c for _, c in live], groups=[plan.groups[i] for i in rows],
                                      num_batched_tokens=len(live))
            taken += 1
            self._take(sub, out.step(j).rows(rows), changed)
        return taken

    def _accept(self, seq: _Sequence, out: StepOutput, i: int) -> None:
        req = seq.request
        token = req.output_token_ids[-1]
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(out.top_ids[i], out.top_logprobs[i], out.logprob[i],
                                                    out.rank[i], token, req.params.logprobs))
        delta = seq.detok.add([token])
        grammar = self._advance_grammar(seq, token) if seq.matcher is not None else None
        if not req.is_finished:  # the scheduler finishes requests that reach the context length
            new_from = len(seq.text)
            seq.text += delta
            stop = self.stop_policy.check(req.params, token, len(req.output_token_ids), seq.text, new_from)
            if stop is None and grammar == "complete":
                stop = Stop("stop")
            if grammar == "broken":
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
            elif stop is not None:
                if stop.text is not None:
                    seq.text = stop.text
                seq.stop_reason = stop.stop_reason
                status = (RequestStatus.FINISHED_STOPPED if stop.finish_reason == "stop"
                          else RequestStatus.FINISHED_LENGTH)
                self.scheduler.finish_request(req.request_id, status)
        else:
            seq.text += delta
        if req.is_finished and not isinstance(seq.stop_reason, str):
            seq.text += seq.detok.flush()

    def _advance_grammar(self, seq: _Sequence, token: int) -> str | None:
        """Feed a sampled token to the sequence's grammar: "complete" once it allows nothing more,
        "broken" if it refused the token (its mask should make that impossible; the library's
        per-step limits can: logged, counted, and the sequence aborted), else None."""
        if seq.matcher.consume(token):
            return "complete" if seq.matcher.is_stopped else None
        self.num_grammar_errors += 1
        logger.error("request %s: its grammar refused sampled token %d (%s); aborting it", seq.request.request_id,
                     token, seq.matcher.error)
        return "broken"

    def _logprob_entry(self, top_ids, top_logprobs, logprob, rank, token: int, k: int) -> dict[int, Logprob]:
        """One position's logprobs: its `k` most likely tokens, and `token` (sampled, or the
        prompt's next) with its own logprob and rank whether among them or not."""
        decode = self.tokenizer.decode
        entry = {int(t): Logprob(float(lp), r, decode([int(t)]))
                 for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), 1)}
        if token not in entry:
            entry[token] = Logprob(float(logprob), int(rank), decode([token]))
        return entry

    # ------------------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        real, padded = self.runner.total_real_tokens, self.runner.total_padded_tokens
        pools = [t.pool for t in self.page_tables]
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputes": self.scheduler.num_recomputes,
            "compilations": self.runner.num_compilations,
            # The prompt-logprob step compiles on first use (not warmed up): counted here.
            "compilations_after_warmup": self.runner.num_compilations_after_warmup + (
                self.runner.num_score_compilations) + sum(
                r.num_compilations_after_warmup for r in self.draft_runners()),
            "pages_in_use": sum(p.num_used_pages for p in pools),
            "pages_cached": sum(p.num_cached_pages for p in pools),
            "pages_free": sum(p.num_free_pages for p in pools),
            "pages_released_behind_window": sum(t.num_window_released_pages for t in self.page_tables),
            "num_pages": self.runner.num_pages,
            "prefix_cache_hit_tokens": sum(t.num_prefix_hit_tokens for t in self.page_tables),
            "prefix_cache_query_tokens": sum(t.num_prefix_query_tokens for t in self.page_tables),
            "padded_token_fraction": (padded - real) / padded if padded else 0.0,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            **self._idle_stats(),
            **self._bucket_stats(),
            **self._structured_stats(),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **({"launched_steps": self.runner.num_launched, "overlapped_steps": self.runner.num_overlapped,
                "sync_steps": self.num_sync_steps} if self.async_scheduling else {}),
        }

    def _idle_stats(self, recent: int = 64) -> dict[str, float]:
        """The host time between consecutive device calls (the device idles), over the last
        `recent` calls: its mean, and its share of the calls' time plus it."""
        records = list(self.runner.records)[-recent:]
        idle = sum(r.idle_before for r in records)
        busy = sum(r.seconds for r in records)
        return {"step_idle_seconds": idle / len(records) if records else 0.0,
                "step_idle_fraction": idle / (idle + busy) if idle + busy > 0 else 0.0}

    def _bucket_stats(self) -> dict[str, int]:
        """Lazy buckets (`jserve.runtime.lazy_buckets`): calls run in a larger compiled shape than
        their own while it compiled in the background, and the shapes still compiling."""
        lazy = self.runner.lazy
        return {"bucket_fallbacks": lazy.fallbacks if lazy else 0,
                "buckets_pending": len(lazy.pending) if lazy else 0,
                "buckets_failed": len(lazy.failed) if lazy else 0}

    def draft_runners(self) -> list[Runner]:
        """The draft model's runner (speculative method "draft_model"), else none."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        return [proposer.runner] if isinstance(proposer, DraftModelProposer) else []

    def _structured_stats(self) -> dict[str, Any]:
        return {
            "structured_requests": self.num_structured_requests,
            "grammar_errors": self.num_grammar_errors,
            "grammars_compiled": self.grammars.num_compiled,
            "grammar_compile_seconds": self.grammars.compile_seconds,
            **self.runner.masks.stats(),  # host time filling masks: in all, and per step of the last 64
        }


def _sub_plan(plan: StepPlan, index: Sequence[int]) -> StepPlan:
    """The plan's chunks at `index` only."""
    chunks = [plan.chunks[i] for i in index]
    return StepPlan(chunks=chunks, preempted=[], num_batched_tokens=sum(c.num_tokens for c in chunks),
                    groups=[plan.groups[i] for i in index])
