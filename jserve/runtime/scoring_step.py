"""A prefill chunk whose prompt logprobs are wanted: a call of its own, the runner's scoring step
(`device_steps.score`), which compiles on first use per token bucket (few requests ask for prompt
logprobs) and is counted apart (`Runner.num_score_compilations`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jserve.core import buckets
from jserve.runtime.steps import PromptLogprobs, StepRecord, StepRow


def score_row(runner: Any, row: StepRow) -> tuple[dict[str, np.ndarray], PromptLogprobs]:
    """`row` alone (in its group's block of a `dp`-row call): its sample's outputs and its prompt
    logprobs."""
    if runner.multiprocess:
        raise ValueError("prompt logprobs are not available in a multi-process run")
    T = buckets.pick(runner.token_buckets, row.num_tokens)
    B = runner.dp
    placed: list[StepRow | None] = [None] * B
    placed[row.dp_group] = row
    targets = np.full((B, T), -1, np.int32)
    targets[row.dp_group, :row.num_tokens] = row.prompt_targets
    x = runner.place(runner.host_inputs(placed, B, T))
    targets = runner.place(targets)
    mask = runner.masks.device(B, runner.grammar_rows(placed))

    def call():
        out, plp, runner.kv = runner._score_step(runner.params, runner.kv, x.tokens, x.positions, x.meta, x.last,
                                                 targets, x.sampling, x.history, mask, x.lora)
        return out, plp

    (out, plp), seconds = runner.compiles.timed(("score", B, T), lambda: [runner._score_step], call, score=True)
    runner.step_log.add(StepRecord("score", (B, T), row.num_tokens, B * T, seconds, *runner.cost([row])))
    result = {key: value[row.dp_group] for key, value in out.items()}
    return result, PromptLogprobs(**{key: value[row.dp_group, :row.num_tokens] for key, value in plp.items()})
