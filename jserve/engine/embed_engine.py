"""EmbedEngine: an embedding model's engine (`--task embed`): prompts in, one vector each out.

The generation engine's scheduler and page pool, so prompts batch and split into chunks as any
prefill does (`max_num_batched_tokens`), but no request ever decodes: each step runs the
scheduled chunks through `PooledSteps` (their final hidden states weighted and summed per row on
the device), adds each chunk's sum to its request's, and a request whose prompt is done is
finished at once (its pages go back) with its embedding (`PoolingConfig.finish`). A preempted
request starts its sum again with its recompute. Its interface is `LLMEngine`'s where
`AsyncLLMEngine` drives it (add_request / step / abort_request / stats).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar, Sequence

import numpy as np

from jserve.core.page_table import PageTable
from jserve.core.plan import Request, RequestStatus, StepPlan
from jserve.core.request import GREEDY
from jserve.core.scheduler import Scheduler
from jserve.engine.config import EngineConfig
from jserve.model.pooling import PoolingConfig
from jserve.runtime.pooled_steps import PooledSteps
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """An embedding request's settings: `dimensions`, the Matryoshka size to cut the vector to."""

    dimensions: int | None = None
    n: ClassVar[int] = 1  # one sequence per request (what the async engine's ledger counts)
    num_samples: ClassVar[int] = 1


@dataclasses.dataclass
class PoolingOutput:
    """A finished embedding request: its vector (None: aborted). `outputs` is empty (no
    completions), as the async engine's ledger reads it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: np.ndarray | None
    finished: bool = True
    outputs: list = dataclasses.field(default_factory=list)


class EmbedEngine:
    """Continuous batching of embedding requests over the pooled step."""

    task = "embed"

    def __init__(self, runner: Runner, tokenizer: Any, config: EngineConfig, pooling: PoolingConfig,
                 quantization: dict[str, Any] | None = None):
        if config.enable_prefix_caching:
            raise ValueError("task 'embed' pools every prompt token, which a prefix-cache hit skips: "
                             "give enable_prefix_caching=False (--no-enable-prefix-caching)")
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pooling = pooling
        self.quantization = quantization
        self.pooled = PooledSteps(runner)
        self.page_table = PageTable(runner.pages_per_group, runner.page_size,
                                    sliding_window=runner.config.shared_window, enable_prefix_caching=False)
        share = dataclasses.replace(config.scheduler_config(1), recompute_past=runner.config.long_rope_after)
        self.scheduler = Scheduler(share, self.page_table)
        self.num_steps = 0
        self._sums: dict[str, np.ndarray] = {}  # request id -> its pooled sum so far
        self._asked: dict[str, tuple[str | None, int | None]] = {}  # request id -> (prompt, dimensions)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a prompt; ValueError naming an id outside the vocabulary, a prompt too long for
        the context, or `dimensions` the model does not allow."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be a PoolingParams, got {type(params).__name__}")
        vocab = self.runner.config.vocab_size
        ids = [int(t) for t in prompt_token_ids]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.pooling.check_dimensions(params.dimensions, self.runner.config.hidden_size)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.scheduler.add_request(Request(request_id, ids, GREEDY, arrival, priority, cache_salt))
        self._asked[request_id] = (prompt, params.dimensions)

    def abort_request(self, request_id: str) -> PoolingOutput | None:
        """End a request now (its pages go back); its output without a vector, or None if unknown."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        self._sums.pop(request_id, None)
        prompt, _ = self._asked.pop(request_id)
        return PoolingOutput(request_id, prompt, request.prompt_token_ids, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[PoolingOutput]:
        """One scheduled step of prompt chunks; the outputs of the requests it finished."""
        plan = self.scheduler.schedule()
        self.num_steps += 1
        if not plan.chunks:
            return []
        rows = [StepRow.from_chunk(c) for c in plan.chunks]
        sums = self.pooled.execute(rows, [self._weights(c) for c in plan.chunks])
        for chunk, s in zip(plan.chunks, sums):
            rid = chunk.request.request_id
            self._sums[rid] = s if chunk.start == 0 else self._sums[rid] + s
        # The scheduler counts the chunks computed; nothing is sampled, so no chunk emits a token.
        chunks = [dataclasses.replace(c, emits_token=False) for c in plan.chunks]
        self.scheduler.update(StepPlan(chunks, plan.preempted, plan.num_batched_tokens), {})
        outputs = []
        now = time.monotonic()
        for chunk in plan.chunks:
            if chunk.emits_token:
                request = chunk.request
                request.first_token_time = now
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                prompt, dimensions = self._asked.pop(request.request_id)
                vector = self.pooling.finish(self._sums.pop(request.request_id), request.num_tokens, dimensions)
                outputs.append(PoolingOutput(request.request_id, prompt, request.prompt_token_ids, vector))
        if not self.scheduler.has_unfinished():
            self.runner.mark_idle()
        return outputs

    def _weights(self, chunk) -> np.ndarray:
        """Each token's weight in the chunk's row sum (see `jserve.runtime.pooled_steps`)."""
        pooling = self.pooling.pooling
        if pooling == "mean":
            return np.ones(chunk.num_tokens, np.float32)
        w = np.zeros(chunk.num_tokens, np.float32)
        if pooling == "cls" and chunk.start == 0:
            w[0] = 1.0
        elif pooling == "last" and chunk.emits_token:
            w[-1] = 1.0
        return w

    def draft_runners(self) -> list[Runner]:
        return []

    def stats(self) -> dict[str, Any]:
        log = self.runner.step_log
        real, padded = log.total_real_tokens, log.total_padded_tokens
        pool = self.page_table.pool
        return {"task": self.task, "num_steps": self.num_steps, "num_preemptions": self.scheduler.num_preemptions,
                "compilations": self.runner.num_compilations,
                "compilations_after_warmup": self.runner.num_compilations_after_warmup,
                "pages_in_use": pool.num_used_pages, "pages_free": pool.num_free_pages,
                "num_pages": self.runner.num_pages, "computed_tokens": real,
                "padded_token_fraction": (padded - real) / padded if padded else 0.0,
                "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting}


def resolve_pooling(config: EngineConfig, declared: PoolingConfig | None) -> PoolingConfig | None:
    """The pooling an engine serves with (None: generation): `config.task` ("auto": embed where the
    checkpoint `declared` one), its pooling and normalisation over the checkpoint's; ValueError
    naming a setting the embedding engine does not combine with."""
    task = config.task if config.task != "auto" else ("embed" if declared is not None else "generate")
    if task == "generate":
        if config.pooling is not None:
            raise ValueError(f"pooling={config.pooling!r} applies to task 'embed', not to a generation model "
                             "(give task='embed' / --task embed)")
        return None
    for name, value, plain in (("speculative_config", config.speculative_config, None),
                               ("num_scheduler_steps", config.num_scheduler_steps or 1, 1),  # None: 1 here
                               ("async_scheduling", config.async_scheduling or False, False),  # None: off here
                               ("mesh", config.mesh, None)):
        if value != plain:
            raise ValueError(f"task 'embed' runs plain prefill steps on one device: give no {name} (got {value!r})")
    base = declared or PoolingConfig()
    normalize = base.normalize if config.pooling_normalize == "auto" else config.pooling_normalize == "true"
    return PoolingConfig(config.pooling or base.pooling, normalize, base.matryoshka)
