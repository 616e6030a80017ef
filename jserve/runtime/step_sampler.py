"""The sampler a step runs after its forward (`Runner.device_step`), for the runner.

Two jitted programs, one shape per batch: the full sampler (`device_steps.sample_rows`: the
grammar bitmask, logit entries, penalties, temperature and filters, logprobs) and, for a call
whose rows are all plain greedy on one device, the argmax alone (`device_steps.greedy_rows`):
no branches, no settings or history as arguments, no logprob outputs read back. Which one a call
runs is decided on the host from its inputs before they are placed (`takes_greedy`). Warm-up
compiles both for every batch (`jserve.runtime.warmup`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jserve.core.request import MAX_LOGPROBS
from jserve.runtime import device_steps
from jserve.runtime.step_masks import StepMasks
from jserve.runtime.steps import StepInputs


class StepSampler:
    """A runner's two samplers and the choice between them.

    Args:
      feed_rows: the most rows a call samples (its samples, padded to this, feed the next call's
        tokens on the device when steps overlap, `jserve.runtime.overlap`).
      invariant: batch-invariant mode (`ModelOps.batch_invariant`).
      single_device: whether the runner has no mesh (a mesh's calls keep the full sampler).
      masks: the runner's grammar bitmasks.
    """

    def __init__(self, feed_rows: int, invariant: bool, single_device: bool, masks: StepMasks):
        self.full = jax.jit(functools.partial(device_steps.sample_rows, feed_rows=feed_rows, invariant=invariant))
        self.greedy = jax.jit(functools.partial(device_steps.greedy_rows, feed_rows=feed_rows))
        self.single_device = single_device
        self.masks = masks

    def takes_greedy(self, inputs: StepInputs, constraints=()) -> bool:
        """Whether a call samples with the argmax alone: on one device, no grammar, every row plain
        greedy (`SamplingArrays.plain_greedy`, read on the host); what it saves is measured in
        docs/performance.md, "The sampler"."""
        return (self.single_device and not constraints and inputs.mask is None
                and isinstance(inputs.sampling.temperature, np.ndarray) and inputs.sampling.plain_greedy())

    def __call__(self, logits, inputs: StepInputs, x: StepInputs, constraints=()) -> dict[str, Any]:
        """The call's samples from its logits: `inputs` as built on the host, `x` as placed."""
        if self.takes_greedy(inputs, constraints):
            B = logits.shape[0]  # the logprob outputs the full sampler gives rows that want none
            return {**self.greedy(logits), "logprob": np.zeros((B,), np.float32), "rank": np.zeros((B,), np.int32),
                    "top_ids": np.zeros((B, MAX_LOGPROBS), np.int32),
                    "top_logprobs": np.zeros((B, MAX_LOGPROBS), np.float32)}
        bitmask = x.mask if x.mask is not None else self.masks.device(x.last.size, constraints)  # a row per sample
        return self.full(logits, x.sampling, x.history, bitmask)

    def compiled_fns(self) -> list:
        return [self.full, self.greedy]
