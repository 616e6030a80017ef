"""LLMEngine: continuous batching over the paged runner (add_request / step / abort).

Each `step()` is schedule -> execute -> update: the scheduler plans a step, the step function
chosen at construction runs it (`jserve.engine.step_functions`: plain, multi-step, overlapped,
or `jserve.engine.speculative.SpeculativeStep`), and the update hands the samples to the
scheduler (which applies the token-level stops), then detokenizes and checks stop strings. A
request with `n > 1` runs as n sequences gathered into one `RequestOutput`. See
docs/architecture.md ("The engine step").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from typing import Any, Sequence

import numpy as np

from jserve.core import bad_words
from jserve.core.dp_scheduler import DataParallelScheduler
from jserve.core.lora_slots import LoRARequest
from jserve.core.page_table import PageTable
from jserve.core.plan import PLACEHOLDER, RequestStatus, SchedulerProtocol, StepPlan
from jserve.core.request import Logprob, RequestOutput, SamplingParams
from jserve.core.scheduler import Scheduler
from jserve.core.stop import StopPolicy
from jserve.engine import kv_offload, weights
from jserve.engine import sleep as sleep_mode
from jserve.engine.config import EngineConfig
from jserve.engine.engine_stats import engine_stats
from jserve.engine.lora import LoraManager
from jserve.engine.sequence import SampleGroup, SequenceState
from jserve.engine.speculative import DraftModelProposer, SpeculativeStep, build_speculator
from jserve.engine.step_functions import Executed, MultiStep, OverlappedStep, PlainStep, StepResult
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepOutput
from jserve.structured.grammar import CompiledGrammar, GrammarCompiler
from jserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PLACEHOLDER"]


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
        # LoRA adapters (`jserve.engine.lora`) where the runner has slots for them
        self.lora = None if runner.lora is None else LoraManager(runner, runner.config, config.max_cpu_loras,
                                                                 self._lora_in_use)
        self.page_tables, self.scheduler = self._build_scheduler(draft_runner is None)
        self.page_table = self.page_tables[0]
        self.kv_offload = kv_offload.KVOffload(runner, self.page_tables)  # the host KV tier, if any
        self._groups: dict[str, SampleGroup] = {}  # the user requests; their sequences are the scheduler's
        self._rng = np.random.default_rng(config.seed)
        self.num_steps = 0
        # The structured-output constraints' compiler and cache (thread-safe: the server compiles
        # in it before a request reaches this thread; llguidance reads the vocabulary on first use).
        self.grammars = GrammarCompiler(tokenizer, runner.config.vocab_size, sorted(self.eos_token_ids))
        self.num_structured_requests = 0
        self.speculator = build_speculator(config, runner, draft_runner, self.scheduler)
        self.async_scheduling = self._overlaps(config.async_scheduling)
        self.step_fn = self._step_function()
        self.source_config = runner.config  # the checkpoint's config (build_engine: before a mesh's layout)
        self.sleep_level = 0  # 0 awake, else the level of `sleep`
        self.last_weight_update: dict[str, Any] | None = None  # the last update_weights' timings

    def _build_scheduler(self, shared_window: bool) -> tuple[list[PageTable], SchedulerProtocol]:
        """A page table (with the host KV tier, if any) and scheduler per dp group (each with its share of
        seqs and tokens). Pages behind a window every layer shares are given back, unless a draft model (whose
        attention may see every position) reads them; a LongRoPE model recomputes past its original context."""
        runner, config = self.runner, self.config
        window = runner.config.shared_window if shared_window else None
        tables = kv_offload.page_tables(runner, window, config.enable_prefix_caching)
        share = dataclasses.replace(config.scheduler_config(runner.dp), recompute_past=runner.config.long_rope_after)
        slots = None if self.lora is None else self.lora.slots  # one set of slots for every group
        schedulers = [Scheduler(share, t, stop_policy=self.stop_policy, lora_slots=slots) for t in tables]
        return tables, schedulers[0] if runner.dp == 1 else DataParallelScheduler(schedulers)

    def _overlaps(self, asked: bool | None) -> bool:
        """Whether steps overlap (`async_scheduling`): as asked, or with None wherever they can."""
        if asked is not None:
            return asked
        return (self.speculator is None and self.config.num_scheduler_steps == 1 and self.runner.launchable
                and self.runner.config.long_rope_after is None)

    def _step_function(self) -> PlainStep:
        """The execute phase's step function, chosen once."""
        runner = self.runner
        if self.speculator is not None:
            return SpeculativeStep(runner, self.stop_policy, self.scheduler, self.speculator)
        if self.async_scheduling:
            if not runner.launchable:
                raise ValueError(f"async_scheduling runs on one data-parallel group in one process; this runner "
                                 f"has dp={runner.dp}{' over several processes' if runner.multiprocess else ''}")
            if runner.config.long_rope_after is not None:
                raise ValueError("async_scheduling does not combine with a LongRoPE model's recompute past its "
                                 "original context (the recompute needs each sampled token on the host)")
            return OverlappedStep(runner, self.stop_policy, self.scheduler)
        return MultiStep(runner, self.stop_policy) if self.config.num_scheduler_steps > 1 else PlainStep(
            runner, self.stop_policy)

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, grammar: CompiledGrammar | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; ValueError (naming the value) for ids outside the vocabulary or a
        prompt that leaves no room for output in the context. `grammar`: its structured-outputs
        constraint compiled already (`self.grammars.compile`, off this thread); else it is
        compiled here when the request has one. `lora_request`: the LoRA adapter it runs with
        (added first if new; the engine needs `enable_lora`)."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): wake_up() first")
        if params.bad_words and params.bad_words_token_ids is None:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            sequences = bad_words.token_sequences(params.bad_words, encode)
            params = dataclasses.replace(params, bad_words_token_ids=sequences)
        ids = self._check_request(request_id, prompt_token_ids, params)
        if lora_request is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                             f"(enable_lora / --enable-lora)")
        lora_name = None if self.lora is None else self.lora.resolve(lora_request)
        # A constraint the library refuses is a ValueError (GrammarError) naming what is wrong.
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        group = SampleGroup(request_id, prompt, ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first token has none; the prefill fills the rest
        closer = budget = None
        if grammar is not None and self.grammars.closes(params.structured_outputs):
            closer = self.grammars.closer()  # the output closes within max_tokens and the context
            room = self.scheduler.max_len - len(ids) - 1  # the context's last token ends it unread
            budget = room if params.max_tokens is None else min(max(params.max_tokens, 1), room)
        base = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ranked = params.num_samples > params.n  # best_of: each sample's logprob is summed
        for i in range(params.num_samples):
            # Each sample runs as its own sequence; a seed per sample keeps them distinct. One for no
            # tokens samples one that its output hides (SampleGroup.output): a prefill always ends in a
            # sample, which its last logits give at no extra cost.
            sub = dataclasses.replace(params, n=1, best_of=None, seed=(base + 7919 * i) % 2**32,
                                      max_tokens=1 if params.max_tokens == 0 else params.max_tokens,
                                      logprobs=0 if ranked and params.logprobs is None else params.logprobs)
            salt = cache_salt
            if i == 0 and params.prompt_logprobs is not None:
                # Its prefill computes every prompt position: a salt no other prefill has (not the
                # request id, which a caller may reuse) keeps prefix-cache hits from skipping any.
                salt = f"{cache_salt or ''}\x00prompt-logprobs\x00{uuid.uuid4().hex}"
            group.sequences.append(SequenceState(
                request_id if params.num_samples == 1 else f"{request_id}#{i}", list(ids), sub, arrival,
                priority=priority, lora_name=lora_name,
                cache_salt=salt, grammar=grammar.matcher(closer, budget) if grammar is not None else None,
                group=group, index=i,
                detok=self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None))
        added = []
        try:
            for seq in group.sequences:
                self.scheduler.add_request(seq)  # validates against the pool size too
                added.append(seq.request_id)
        except ValueError:
            for rid in added:
                self.scheduler.abort_request(rid)
            raise
        self._groups[request_id] = group
        self.num_structured_requests += grammar is not None

    def _check_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's ids; ValueError naming what the engine cannot run."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params.check_token_ids(vocab)  # logit_bias / allowed_token_ids
        self.stop_policy.validate(params)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but the context length is {limit}: "
                             f"it must be shorter to leave room for output")
        if params.prompt_logprobs is not None and self.runner.multiprocess:
            raise ValueError("prompt_logprobs is not available in a multi-process run")
        return ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples); its pages are free at once. None if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.sequences:
            self.scheduler.abort_request(seq.request_id)
            self._forget(seq)
        return group.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def _lora_in_use(self, name: str) -> int:
        """Unfinished requests (waiting or running) that run with LoRA adapter `name`."""
        return sum(r.lora_name == name for r in (*self.scheduler.waiting, *self.scheduler.running))

    # ------------------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the current output of every request that changed."""
        plan = self.scheduler.schedule()
        if self.lora is not None:
            self.lora.write_slots()  # the adapters the plan put into slots, before it runs
        self.kv_offload.apply()  # the host KV tier's copies: reloads the plan reads, before it runs
        result = self.step_fn(plan)
        return self.update(result)

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Take a step's samples, in order: the scheduler records them (and ends what a token
        stops), then each new token gets its logprobs, text and stop-string check."""
        changed: dict[str, SampleGroup] = {}
        for executed in result.executed:
            if executed.filled is not None:
                self._take_filled(executed, changed)
                taken = 0
            elif executed.out.num_valid is not None:
                taken = self._take_steps(executed.plan, executed.out, changed)
            else:
                self._take(executed.plan, executed.out, changed)
                taken = 1
            self.num_steps += taken if executed.steps is None else executed.steps
        self.num_steps += result.launched
        outputs = self._outputs(changed)
        for then in result.then:
            then()
        return outputs

    def _outputs(self, changed: dict[str, SampleGroup]) -> list[RequestOutput]:
        """The changed requests' outputs; finished ones are forgotten."""
        outputs = []
        for rid, group in changed.items():
            output = group.output()
            outputs.append(output)
            if output.finished:
                self._groups.pop(rid, None)
                for seq in group.sequences:
                    self._forget(seq)
        if not self._groups:
            self.runner.mark_idle()  # the wait for the next request is no gap between steps
            self.kv_offload.drain()  # copies still in flight to the host tier: their pages come back
        return outputs

    def _live(self, seq: Any) -> bool:
        """Whether a sequence's request is still the engine's (not aborted meanwhile)."""
        group = getattr(seq, "group", None)
        return group is not None and self._groups.get(group.request_id) is group

    def _forget(self, seq: SequenceState) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)

    def _take(self, plan: StepPlan, out: StepOutput, changed: dict[str, SampleGroup]) -> None:
        """Hand a step's samples (a row per chunk of `plan`) to the scheduler and emit each new token."""
        self._take_prompt_logprobs(plan, out)
        sampled = {c.request.request_id: int(out.tokens[i]) for i, c in enumerate(plan.chunks) if c.emits_token}
        index = {c.request.request_id: i for i, c in enumerate(plan.chunks)}
        for seq in self.scheduler.update(plan, sampled):
            if self._live(seq):
                self._emit(seq, out, index[seq.request_id])
                changed[seq.group.request_id] = seq.group

    def _take_filled(self, executed: Executed, changed: dict[str, SampleGroup]) -> None:
        """A launched step's samples: fill its placeholders (the scheduler's stop checks run
        there), then emit each token."""
        out = executed.out
        for p in executed.filled:
            self.scheduler.fill_placeholder(p.request, p.index, int(out.tokens[p.row]))
        for p in executed.filled:
            seq = p.request
            if not self._live(seq):
                continue  # aborted meanwhile
            assert len(seq.output_token_ids) == p.index + 1, (seq.request_id, p.index, len(seq.output_token_ids))
            self._emit(seq, out, p.row)
            changed[seq.group.request_id] = seq.group

    def _take_steps(self, plan: StepPlan, out: StepOutput, changed: dict[str, SampleGroup]) -> int:
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
            sub = dataclasses.replace(plan, chunks=[c for _, c in live], dp_groups=[plan.dp_groups[i] for i in rows],
                                      num_batched_tokens=len(live))
            taken += 1
            self._take(sub, out.step(j).rows(rows), changed)
        return taken

    def _take_prompt_logprobs(self, plan: StepPlan, out: StepOutput) -> None:
        """Append the prompt logprobs a step computed to their requests', in position order."""
        for i, chunk in enumerate(plan.chunks):
            scored = out.prompt[i] if out.prompt is not None else None
            seq = chunk.request
            if scored is None or not self._live(seq):
                continue
            group, k = seq.group, seq.group.params.prompt_logprobs
            for j, q in enumerate(range(chunk.start, chunk.start + chunk.num_tokens)):
                if q + 1 != len(group.prompt_logprobs) or q + 1 >= len(group.prompt_token_ids):
                    continue  # scored before (a recompute after preemption), or past the prompt
                group.prompt_logprobs.append(self._logprob_entry(
                    scored.top_ids[j], scored.top_logprobs[j], scored.logprob[j], scored.rank[j],
                    group.prompt_token_ids[q + 1], k))

    def _emit(self, seq: SequenceState, out: StepOutput, i: int) -> None:
        """A new token's logprobs and text; a stop string ends the sequence here (before a weak
        stop the scheduler found: max_tokens, a complete grammar)."""
        token = seq.output_token_ids[-1]
        seq.cumulative_logprob += float(out.logprob[i])  # what best_of ranks by (0 where not computed)
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(out.top_ids[i], out.top_logprobs[i], out.logprob[i],
                                                    out.rank[i], token, seq.params.logprobs))
        new_from = len(seq.text)
        seq.text += seq.detok.add([token])
        if seq.params.stop and (not seq.is_finished or (seq.stop is not None and seq.stop.weak)):
            stop = self.stop_policy.check_text(seq.params, len(seq.output_token_ids), seq.text, new_from)
            if stop is not None:
                seq.text = stop.text
                if seq.is_finished:  # a weak stop's request is finished already: its reason changes
                    seq.status, seq.stop = RequestStatus.FINISHED_STOPPED, stop
                else:
                    self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED, stop)
        if seq.is_finished and not isinstance(seq.stop_reason, str):
            seq.text += seq.detok.flush()

    def _logprob_entry(self, top_ids, top_logprobs, logprob, rank, token: int, k: int) -> dict[int, Logprob]:
        """One position's logprobs: its `k` most likely tokens, and `token` (sampled, or the
        prompt's next) with its own logprob and rank whether among them or not."""
        decode = self.tokenizer.decode
        entry = {int(t): Logprob(float(lp), r, decode([int(t)]))
                 for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), 1)}
        if token not in entry:
            entry[token] = Logprob(float(logprob), int(rank), decode([token]))
        return entry

    # ------------------------------------------------------------------------------ weights, sleep

    def update_weights(self, params: Any, *, policy: str | None = None, donate: bool = False) -> list[RequestOutput]:
        """Swap in new weights between steps (`jserve.engine.weights`: names, dtype, quantization,
        mesh); no recompilation, the prefix cache dropped. `policy` for requests in flight
        (default `weight_update_policy`, `jserve.engine.sleep`). Returns the aborted requests'
        outputs; the timings are in `last_weight_update`."""
        aborted = sleep_mode.settle_in_flight(self, policy or self.config.weight_update_policy, "update_weights")
        self.last_weight_update = weights.update_weights(self, params, donate=donate)
        return aborted

    def sleep(self, level: int = 1, *, policy: str | None = None) -> list[RequestOutput]:
        """Free the KV pages and move the weights to host memory (level 1) or drop them (2)."""
        return sleep_mode.sleep(self, level, policy or self.config.weight_update_policy)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Weights and/or pages back on the device (`tags`: "weights", "kv_cache")."""
        sleep_mode.wake_up(self, tags)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (stale K/V); returns the pages freed."""
        return sum(t.reset_prefix_cache() for t in self.page_tables)

    # ------------------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The engine's counters and gauges (`jserve.engine.engine_stats`): what `/metrics`,
        the logs and the watchdog read."""
        return engine_stats(self)

    def draft_runners(self) -> list[Runner]:
        """The draft model's runner (speculative method "draft_model"), else none."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        return [proposer.runner] if isinstance(proposer, DraftModelProposer) else []
