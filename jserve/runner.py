"""The paged runner: params and KV pages on the device, one compiled step per bucket.

A step takes rows of `(start, token_ids, page_ids)`: decode rows (one token) go to the decode step
(batch bucket x page bucket), longer chunks to the prefill step (rows x token x page buckets).
Each step embeds, writes K/V into pages, runs paged attention, and samples, all in one jit with
the pages donated. Shapes come from `buckets.py`; compilations are counted so that a server can
prove none happens after warm-up.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve import buckets
from jserve.config import ModelConfig
from jserve.kv_cache import init_kv_pages
from jserve.model import model_graphdef, model_params
from jserve.model.paged_attention import PagedAttention, PagedMeta, default_backend
from jserve.request import MAX_LOGPROBS
from jserve.sampler import SamplingArrays, penalty_history, sample

logger = logging.getLogger(__name__)

PREFILL_BATCH_BUCKETS = (1, 2, 4, 8)
GREEDY = (0.0, 0, 1.0, 0.0, 0, 0)  # a sampling row: temperature, top_k, top_p, min_p, seed, step


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one compiled call did, for metrics (padding waste, time)."""

    kind: str  # "decode" | "prefill"
    bucket: tuple[int, ...]
    real_tokens: int
    padded_tokens: int
    seconds: float
    bytes_needed: int  # weights once + K/V read and written for the real tokens
    flops_needed: int  # matmuls and attention for the real tokens (padding excluded)


class Runner:
    """Owns params, KV pages and the compiled steps."""

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array], *, num_pages: int,
                 page_size: int = 16, max_model_len: int, kv_dtype: Any = None, backend: str | None = None,
                 batch_buckets: Sequence[int] = buckets.DEFAULT_BATCH_BUCKETS,
                 token_buckets: Sequence[int] = buckets.DEFAULT_TOKEN_BUCKETS,
                 max_num_batched_tokens: int = 512):
        self.config = config
        # Stacked (checkpoint) params are split per layer once, here (see LlamaModel).
        self.params = params if "layers" in params else model_params(config, params)
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.backend = backend or default_backend()
        self.batch_buckets = tuple(batch_buckets)
        self.token_buckets = buckets.clip(token_buckets, min(max_num_batched_tokens, max_model_len))
        # The page-table width is fixed: the kernels loop over live pages only, so a wider table
        # costs nothing and saves a bucket dimension (and its compilations).
        self.max_pages = math.ceil(max_model_len / page_size)
        self.kv = init_kv_pages(config, num_pages, page_size, kv_dtype or params["embed"].dtype)
        leaves = jax.tree.leaves(self.params)
        self.param_bytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
        self.num_params = sum(int(x.size) for x in leaves)
        graphdef = model_graphdef(config)
        attention = PagedAttention(self.backend, config.sliding_window)
        self._step = jax.jit(functools.partial(_step, graphdef, attention), donate_argnames=("kv",))
        self._seen: set[tuple] = set()
        self.num_compilations = 0
        self.num_compilations_after_warmup = 0
        self.warmed_up = False
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=4096)  # recent steps
        self.total_real_tokens = 0  # since warm-up, for the padding-waste metric
        self.total_padded_tokens = 0

    def execute(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                sampling: Sequence[tuple], penalties: Sequence[tuple | None] | None = None
                ) -> dict[str, np.ndarray]:
        """Run one scheduler step.

        Args:
          rows: per row `(start, token_ids, page_ids)`: compute tokens at positions
            `start .. start+len(token_ids)-1`, whose pages (and the earlier ones) are `page_ids`.
          sampling: per row a sampling tuple (see `SamplingArrays.build`).
          penalties: per row `(prompt_ids, output_ids)` for rows with repetition / presence /
            frequency penalties, else None.
        Returns:
          numpy arrays per row, in `rows` order, for the sample after each row's last token:
          `tokens`, `logprob`, `rank`, `top_ids` and `top_logprobs` (MAX_LOGPROBS of them).
        """
        decode = [i for i, r in enumerate(rows) if len(r[1]) == 1]
        prefill = sorted((i for i, r in enumerate(rows) if len(r[1]) > 1), key=lambda i: -len(rows[i][1]))
        results: dict[int, dict] = {}
        penalties = penalties or [None] * len(rows)
        for start in range(0, len(decode), self.batch_buckets[-1]):
            self._run(rows, sampling, decode[start:start + self.batch_buckets[-1]], results, "decode", penalties)
        for group in self._pack_prefill([len(rows[i][1]) for i in prefill]):
            self._run(rows, sampling, [prefill[j] for j in group], results, "prefill", penalties)
        keys = results[0].keys() if results else ()
        return {key: np.stack([results[i][key] for i in range(len(rows))]) for key in keys}

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, tokens) buckets of the prefill step: rows x tokens within the largest token bucket."""
        cap = self.token_buckets[-1]
        return [(b, t) for b in PREFILL_BATCH_BUCKETS for t in self.token_buckets if b * t <= cap]

    def _pack_prefill(self, lengths: list[int]) -> list[list[int]]:
        """Group chunks (longest first) into calls whose padded shape stays within the largest bucket."""
        cap = self.token_buckets[-1]
        groups: list[list[int]] = []
        for j, n in enumerate(lengths):
            if n > cap:
                raise ValueError(f"a chunk of {n} tokens exceeds the largest token bucket {cap}: "
                                 f"the scheduler must split it")
            if groups:
                g = groups[-1]
                rows = len(g) + 1
                longest = lengths[g[0]]
                if (rows <= PREFILL_BATCH_BUCKETS[-1] and
                        buckets.pick(PREFILL_BATCH_BUCKETS, rows) * buckets.pick(self.token_buckets, longest) <= cap):
                    g.append(j)
                    continue
            groups.append([j])
        return groups

    def _run(self, all_rows, all_sampling, index, results, kind, all_penalties=None):
        rows = [all_rows[i] for i in index]
        B = buckets.pick(self.batch_buckets if kind == "decode" else PREFILL_BATCH_BUCKETS, len(rows))
        T = 1 if kind == "decode" else buckets.pick(self.token_buckets, max(len(r[1]) for r in rows))
        arrays = self._pack(rows, B, T)
        sampling_arrays = SamplingArrays.build([all_sampling[i] for i in index], B).as_tuple()
        history = penalty_history([all_penalties[i] for i in index] if all_penalties else [], B,
                                  self.max_model_len, self.config.vocab_size)
        self._count((kind, B, T))
        t0 = time.perf_counter()
        out, self.kv = self._step(self.params, self.kv, *arrays, sampling_arrays, history)
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        real = sum(len(r[1]) for r in rows)
        self.records.append(StepRecord(kind, (B, T), real, B * T, seconds, *self._cost(rows)))
        self.total_real_tokens += real
        self.total_padded_tokens += B * T
        for j, i in enumerate(index):
            results[i] = {key: value[j] for key, value in out.items()}

    def _pack(self, rows, B, T):
        P = self.max_pages
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        slots = np.zeros((B, T), np.int32)  # padding writes into the null page
        q_start = np.zeros((B,), np.int32)
        q_lens = np.zeros((B,), np.int32)
        page_indices = np.zeros((B, P), np.int32)
        for b, (start, ids, pages) in enumerate(rows):
            n = len(ids)
            pos = np.arange(start, start + n)
            tokens[b, :n] = ids
            positions[b, :n] = pos
            table = np.asarray(pages, np.int32)
            slots[b, :n] = table[pos // self.page_size] * self.page_size + pos % self.page_size
            q_start[b], q_lens[b] = start, n
            page_indices[b, :len(pages)] = pages
        return tokens, positions, PagedMeta(slots.reshape(-1), q_start, q_lens, page_indices), q_lens - 1

    def _cost(self, rows) -> tuple[int, int]:
        """The bytes and FLOPs a step needs at minimum: the physical floor for metrics (MBU/MFU)."""
        c = self.config
        kv_token = c.kv_bytes_per_token(self.kv[0][0].dtype.itemsize)
        new = sum(len(r[1]) for r in rows)
        context = sum(r[0] + len(r[1]) for r in rows)  # keys each row's last query reads
        # Keys over all queries: query at position p reads p + 1 keys; a closed-form sum per row.
        attended = sum(len(r[1]) * (2 * r[0] + len(r[1]) + 1) // 2 for r in rows)
        bytes_needed = self.param_bytes + kv_token * (context + new)
        # Layers run for every new token; the head only for each row's last (embedding: a lookup).
        layer_params = self.num_params - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        flops = 2 * layer_params * new + 2 * c.hidden_size * c.vocab_size * len(rows)
        flops += 4 * c.num_layers * c.num_heads * c.head_dim * attended
        return int(bytes_needed), int(flops)

    def _count(self, key: tuple) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.num_compilations += 1
            if self.warmed_up:
                self.num_compilations_after_warmup += 1
                logger.warning("compiling %s after warm-up", key)

    def warmup(self, *, progress: bool = True) -> None:
        """Compile every bucket now (the steps write only into the null page)."""
        from tqdm import tqdm

        shapes = [("decode", b, 1) for b in self.batch_buckets]
        shapes += [("prefill", b, t) for b, t in self.prefill_shapes()]
        for kind, B, T in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            rows = [(0, [0] * T, [0] * self.max_pages)] * B
            self._run(rows, [GREEDY] * B, list(range(B)), {}, kind)
        self.records.clear()
        self.total_real_tokens = self.total_padded_tokens = 0
        self.warmed_up = True


def _step(graphdef, attention, params, kv, tokens, positions, meta, last, sampling, history):
    model = nnx.merge(graphdef, params)
    logits, kv = model(tokens, positions, kv, meta, attention, logits_index=jnp.maximum(last, 0)[:, None])
    return sample(logits[:, 0], *sampling, penalties=history, num_logprobs=MAX_LOGPROBS), kv
