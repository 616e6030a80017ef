"""The runner's step contract: what the engine hands a step (`StepRow`s), what it gets back
(`StepOutput`), and what each compiled call did, for metrics (`StepRecord`). Host-side numpy;
`jserve.runtime.runner` packs the rows into padded device arrays."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jserve.core import bad_words
from jserve.core.plan import ScheduledChunk
from jserve.core.request import GREEDY, SamplingParams


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One sequence's part of a step: compute `token_ids` at positions `start ..`, then sample.

    Attributes:
      start: position of the first token (= tokens already in the row's pages).
      token_ids: the tokens to compute (one: a decode row; more: a prefill chunk).
      page_ids: the row's pages, covering every position up to the last one computed (for a
        multi-step decode, up to `start + decode_steps - 1`: the scheduler's lookahead pages).
      sampling: the request's settings; `sample_index` the index, within the request's output,
        of the token this step samples (per-row seeds fold it in).
      penalty_tokens: `(prompt_ids, output_ids)` where the request has repetition / presence /
        frequency penalties, else None.
      dp_group: the row's data-parallel group (its page ids are local to that group's pool).
      decode_steps: decode steps to run in a multi-step call (1 .. `Runner.max_decode_steps`).
      stop_ids, min_new: the row stops a multi-step call after sampling one of `stop_ids` once
        it has sampled `min_new` tokens (`jserve.core.stop.StopPolicy.device_stops`).
      prompt_targets: for a chunk whose prompt logprobs are wanted, the token after each of its
        positions (-1 where there is none yet); the step then reports their logprobs.
      grammar_matcher: the sequence's `jserve.structured.grammar.GrammarMatcher` where its sample
        must follow a grammar (structured outputs): the runner fills the row's token bitmask
        from it while the device runs the forward. Single steps only.
      draft_ids: a speculative step's drafts for the tokens after `token_ids` (one token):
        `Runner.execute_verify` computes them with it and keeps those its samples confirm.
      banned_ids: tokens its sample may not be (its request's bad words after its output so far,
        `jserve.core.bad_words`), -inf entries beside the logit bias'.
      lora_slot: the LoRA slot holding the request's adapter (`jserve.model.lora`); 0: none.
      seq_len: the sequence's tokens (prompt and output so far) when the step was planned; 0: the
        row's own end. A LongRoPE model rotates every token of a sequence longer than its original
        context by the long factors (`ModelConfig.long_rope`), a prompt's first chunks included:
        the runner flags their positions (`step_rows.pack`).
      local_page_ids: with hybrid pages (`jserve.core.hybrid_pages`), the sliding layers' own
        pages, as `page_ids` (the null page behind the window); None: every layer reads `page_ids`.
    """

    start: int
    token_ids: Sequence[int]
    page_ids: Sequence[int]
    sampling: SamplingParams = GREEDY
    _: dataclasses.KW_ONLY
    sample_index: int = 0
    penalty_tokens: tuple[Sequence[int], Sequence[int]] | None = None
    dp_group: int = 0
    decode_steps: int = 1
    stop_ids: tuple[int, ...] = ()
    min_new: int = 0
    prompt_targets: Sequence[int] | None = None
    grammar_matcher: Any = None
    draft_ids: Sequence[int] = ()
    seq_len: int = 0
    banned_ids: Sequence[int] = ()
    lora_slot: int = 0
    local_page_ids: Sequence[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_chunk(cls, chunk: ScheduledChunk, *, dp_group: int = 0, stop_ids: tuple[int, ...] = (),
                   min_new: int = 0, prompt_targets: Sequence[int] | None = None) -> "StepRow":
        """A scheduled chunk's row: its tokens and pages, its request's sampling settings, penalty
        tokens and grammar where it samples (`emits_token`)."""
        req = chunk.request
        p = req.params
        return cls(chunk.start, chunk.token_ids, chunk.page_ids, p, sample_index=len(req.output_token_ids),
                   penalty_tokens=(req.prompt_token_ids, req.output_token_ids) if chunk.emits_token and
                   p.has_penalties else None,
                   dp_group=dp_group, decode_steps=chunk.decode_steps, stop_ids=stop_ids, min_new=min_new,
                   prompt_targets=prompt_targets, grammar_matcher=req.grammar if chunk.emits_token else None,
                   seq_len=req.num_tokens, lora_slot=req.lora_slot, local_page_ids=chunk.local_page_ids,
                   banned_ids=bad_words.banned_ids(p.bad_words_token_ids, req.output_token_ids)
                   if chunk.emits_token and p.bad_words_token_ids else ())


@dataclasses.dataclass
class PromptLogprobs:
    """A chunk's prompt logprobs: at each of its positions, the logprob and rank of the next token
    (`StepRow.prompt_targets`) and the `request.MAX_LOGPROBS` most likely tokens."""

    logprob: np.ndarray  # float32 [tokens]
    rank: np.ndarray  # int32 [tokens]
    top_ids: np.ndarray  # int32 [tokens, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # float32 [tokens, MAX_LOGPROBS]


@dataclasses.dataclass
class StepOutput:
    """What a step sampled, one entry per row in the order of the rows given (with a leading
    axis of steps for a multi-step decode: entry j of row i is the row's (j+1)-th sample).

    `top_ids` / `top_logprobs` hold `request.MAX_LOGPROBS` entries per sample, zeros where no row
    of the call asked for logprobs; `num_valid` (multi-step decode only) counts each row's
    samples before it stopped (entries past them are meaningless); `prompt` (single steps) the
    prompt logprobs of each row that asked (`StepRow.prompt_targets`), None for the others."""

    tokens: np.ndarray  # int32
    logprob: np.ndarray  # float32: of the sampled token
    rank: np.ndarray  # int32: of the sampled token (1 = most likely)
    top_ids: np.ndarray  # int32 [..., MAX_LOGPROBS]
    top_logprobs: np.ndarray  # float32 [..., MAX_LOGPROBS]
    num_valid: np.ndarray | None = None  # int32 [rows]
    prompt: list[PromptLogprobs | None] | None = None

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "StepOutput":
        return cls(**{f.name: arrays.get(f.name) for f in dataclasses.fields(cls)})

    def rows(self, index: Sequence[int]) -> "StepOutput":
        """These rows only (of a single step)."""
        index = list(index)
        arrays = {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)
                  if f.name not in ("num_valid", "prompt") and getattr(self, f.name) is not None}
        prompt = None if self.prompt is None else [self.prompt[i] for i in index]
        return StepOutput(**arrays, prompt=prompt)

    def step(self, j: int) -> "StepOutput":
        """Step j of a multi-step decode, as a single step's output."""
        return StepOutput(self.tokens[j], self.logprob[j], self.rank[j], self.top_ids[j], self.top_logprobs[j])


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one compiled call did, for metrics (padding waste, time)."""

    kind: str  # "decode" | "prefill" | "verify"
    bucket: tuple[int, ...]
    real_tokens: int
    padded_tokens: int
    seconds: float
    bytes_needed: int  # weights once + K/V read and written for the real tokens
    flops_needed: int  # matmuls and attention for the real tokens (padding excluded)
    steps: int = 1  # model steps the call ran (> 1: a multi-step decode; `seconds` covers them all)
    # Host time between the previous call's end and this call's start (scheduling, packing,
    # detokenizing: the device idles), 0 for the first call of a busy period.
    idle_before: float = 0.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One compiled call's host inputs after the params and pages, a pytree (placed over the
    mesh and broadcast to other processes whole): the packed tokens, positions, attention
    metadata and each row's last token index (`step_rows.pack` / `pack_ragged`), the sampling
    arrays, the penalty history, the grammar bitmask where it travels with them, and over a
    model with LoRA slots each token's slot id (`step_rows.lora_ids`; None without)."""

    tokens: Any
    positions: Any
    meta: Any
    last: Any
    sampling: Any
    history: Any
    mask: Any = None
    lora: Any = None

    @classmethod
    def of(cls, packed: tuple, sampling: Any, history: Any, mask: Any = None, lora: Any = None) -> "StepInputs":
        return cls(*packed, sampling, history, mask, lora)


@dataclasses.dataclass
class PreparedCall:
    """A decode or mixed call ready to run (`Runner.prepare`)."""

    kind: str
    B: int  # rows in all (every group's block)
    T: int  # tokens per row (decode) or per group (mixed)
    rows: list[StepRow]  # in slot order
    slot_of: dict[int, int]  # a row's index in the step's rows -> its slot
    placed: list[StepRow | None]  # the rows by slot (None: padding)
    inputs: StepInputs
