"""The embedding model's step: prefill chunks through the model to its final hidden states, each
row's tokens weighted and summed on the device into one vector per row (no head, no sampler).

A pooled prompt may span chunks: the engine gives each chunk's tokens their weights (mean: 1 for
every token; cls: 1 for the prompt's first; last: 1 for its last) and adds the rows' sums up
across chunks on the host (`jserve.engine.embed_engine`), so a call's output is always
[rows bucket, hidden], whatever the prompts: the mixed step's shapes (rows x tokens buckets),
compiled at warm-up like the generation steps. One data-parallel group in one process.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.runtime import step_rows, warmup
from jserve.runtime.steps import StepRecord, StepRow


def pool(graphdef, ops, params, kv, tokens, positions, meta, weights):
    """The model over a mixed step's tokens [groups, tokens] (`RaggedMeta`), then per row the
    weighted sum of its final hidden states: float32 [groups * rows, hidden] and the new pages.
    `weights` float32 [groups, rows, tokens]: row r's weight for each token of the block."""
    model = nnx.merge(graphdef, params)
    hidden, kv = model(tokens, positions, kv, meta, ops, hidden=True)  # [groups, tokens, hidden]
    pooled = jnp.einsum("grt,gth->grh", weights, hidden, precision=jax.lax.Precision.HIGHEST)
    return pooled.reshape(-1, hidden.shape[-1]), kv


class PooledSteps:
    """The runner's pooled calls: one compiled function, a shape per mixed bucket."""

    def __init__(self, runner):
        runner.require_single_group("the embedding step")
        self.runner = runner
        self.fn = jax.jit(functools.partial(pool, runner.graphdef, runner.ops), donate_argnames=("kv",))

    def execute(self, rows: Sequence[StepRow], weights: Sequence[np.ndarray]) -> np.ndarray:
        """Each row's weighted sum of its tokens' final hidden states, float32 [rows, hidden];
        `weights[i]`: one per token of row i. Rows go into mixed calls by the mixed buckets."""
        runner = self.runner
        out = np.zeros((len(rows), runner.config.hidden_size), np.float32)
        for pack in runner.pack_mixed([r.num_tokens for r in rows]):
            out[pack] = self.call([rows[i] for i in pack], [weights[i] for i in pack])
        return out

    def call(self, rows: Sequence[StepRow], weights: Sequence[np.ndarray]) -> np.ndarray:
        """One mixed-shaped call of these rows (within the largest bucket)."""
        runner = self.runner
        total = sum(r.num_tokens for r in rows)
        shape = runner.shape("mixed", len(rows), total)
        if shape is None:
            raise ValueError(f"no mixed shape holds {len(rows)} rows of {total} tokens")
        R, T = shape
        tokens, positions, meta, _ = step_rows.pack_ragged([list(rows)], R, T, max_pages=runner.max_pages,
                                                           page_size=runner.page_size, config=runner.config)
        w = np.zeros((1, R, T), np.float32)
        t = 0
        for i, (row, wi) in enumerate(zip(rows, weights)):
            w[0, i, t:t + row.num_tokens] = wi
            t += row.num_tokens

        def run():
            pooled, runner.kv = self.fn(runner.params, runner.kv, runner.device_tokens(tokens), positions, meta, w)
            return pooled

        out, seconds = runner.compiles.timed(("pooled", R, T), lambda: [self.fn], run)
        runner.step_log.add(StepRecord("pooled", (R, T), total, T, seconds, *runner.cost(rows)))
        return out[:len(rows)]

    def warmup(self) -> None:
        """Compile every mixed shape's pooled call (padding rows write only into the null page)."""
        runner = self.runner
        for b, t in runner.mixed_shapes():
            rows = warmup.padding_rows(runner, "mixed", b, t)[0]
            self.call(rows, [np.zeros(r.num_tokens, np.float32) for r in rows])
        runner.step_log.reset()
        runner.compiles.warmed_up = True
