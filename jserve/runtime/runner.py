"""The paged runner: params and KV pages on the device, one compiled step per bucket.

A step takes `StepRow`s (`jserve.runtime.steps`): a step of decode rows (one token each) is a decode
call (batch bucket); a step with a prefill chunk is one mixed call for all its rows, decode rows
and chunks of any lengths, their tokens flattened (`step_rows.pack_ragged`, a rows bucket x a
token bucket in all) and attended by the ragged paged-attention kernel; the page table has a fixed
width. Each step runs the model's forward (its backend's operations, `jserve.runtime.backends`) in one
jit with the pages donated, then the sampler, a jit of its own; a `StepOutput` comes back. With
`decode_steps` K > 1, `execute_decode_steps` runs up to K
decode steps in one call (multi-step decode): a device loop feeds each row's sampled token back
and stops a row at its stop ids or its step count. A row with a grammar (`StepRow.constraint`)
gets its token bitmask filled on the host after the forward is dispatched, so the mask is made
while the device runs the model; the sampler takes it as one more fixed-shape input
(`step_masks.py`). Shapes come from `buckets.py`; compilations
are counted so that a server can prove none happens after warm-up. Over a mesh, rows of
data-parallel group g sit in the g-th block of each batch, and in a multi-process run process 0
broadcasts each step's inputs to the others (`follow`).
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
import numpy as np

from jserve.core import buckets
from jserve.model import model_graphdef, quant
from jserve.model.config import ModelConfig
from jserve.runtime import backends, device_steps, overlap, step_rows, warmup
from jserve.runtime.backends import Backend
from jserve.runtime.distributed import STEP_KINDS, STEP_OP, STOP_OP, broadcast
from jserve.runtime.lazy_buckets import BucketCompiler
from jserve.runtime.multi_token_steps import MultiTokenSteps, cache_size
from jserve.runtime.overlap import Launched
from jserve.runtime.sampler import SamplingArrays, penalty_history
from jserve.runtime.step_masks import StepMasks
from jserve.runtime.steps import PromptLogprobs, StepOutput, StepRecord, StepRow

logger = logging.getLogger(__name__)


class Runner(MultiTokenSteps):
    """Owns params, KV pages and the compiled steps (the multi-token ones: `MultiTokenSteps`)."""

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array], *, num_pages: int,
                 page_size: int | None = None, max_model_len: int, kv_dtype: Any = None,
                 backend: Backend | str | None = None,
                 batch_buckets: Sequence[int] = buckets.DEFAULT_BATCH_BUCKETS,
                 token_buckets: Sequence[int] = buckets.DEFAULT_TOKEN_BUCKETS,
                 max_num_batched_tokens: int = 512, mesh: Any = None, native_matmuls: bool = True,
                 huge_pages: bool = True, decode_steps: int = 1, num_speculative_tokens: int = 0,
                 max_verify_rows: int | None = None):
        """`backend`: a `jserve.runtime.backends.Backend`, or its name for `backends.create` (with
        `native_matmuls` and `huge_pages`, see there); it decides the page size (when None), the
        params' and pages' layout and every operation. `params`: checkpoint weights (stacked) or a
        model state in the backend's layout. With a ('dp', 'tp') `mesh`, `params` must already be
        laid out and placed for it (`jserve.runtime.sharding.place_params`); buckets,
        `max_num_batched_tokens` and page ids are then per data-parallel group, and `num_pages`
        counts all groups' pages. `decode_steps` > 1 compiles `execute_decode_steps` for every
        decode batch bucket too (one device mesh group, one process only); so does
        `num_speculative_tokens` k > 0 with `execute_verify`, at k + 1 tokens per row, for the
        batch buckets up to the one holding `max_verify_rows` (None: all)."""
        self.config = config
        self.mesh = mesh
        self.backend = backends.create(backend, mesh=mesh, native_matmuls=native_matmuls, huge_pages=huge_pages)
        self.dp = 1 if mesh is None else dict(zip(mesh.axis_names, mesh.devices.shape))["dp"]
        if num_pages % self.dp:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of dp ({self.dp})")
        self.pages_per_group = num_pages // self.dp
        # The real weights' bytes and count (the step's floor), not those of padded packed panels.
        self.param_bytes = quant.param_bytes(params)
        self.num_params = quant.param_count(params)
        self.params = self.backend.prepare_params(config, params)
        self.page_size = page_size or self.backend.default_page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.batch_buckets = self.backend.batch_buckets(batch_buckets)
        self.token_buckets = buckets.clip(token_buckets, min(max_num_batched_tokens, max_model_len))
        # The page-table width is fixed: the kernels loop over live pages only, so a wider table
        # costs nothing and saves a bucket dimension (and its compilations).
        self.max_pages = math.ceil(max_model_len / self.page_size)
        if mesh is not None:
            from jserve.runtime.sharding import kv_sharding as make_kv_sharding

            kv_sharding = make_kv_sharding(mesh)
        else:
            # Committed to a device from the start: the step returns committed (donated) pages, and
            # a first call with uncommitted ones would compile each shape a second time later.
            kv_sharding = jax.sharding.SingleDeviceSharding(_device_of(self.params))
        kv_dtype = kv_dtype or quant.float_dtype(self.params)
        self.backend.check(config, kv_dtype, self.page_size)
        self.kv = self.backend.init_kv(config, num_pages, self.page_size, kv_dtype, kv_sharding)
        kv_leaves = jax.tree.leaves(self.kv)
        self.kv_itemsize = kv_leaves[0].dtype.itemsize
        # A quantized cache's scales ([kv_heads, pages, page_size]: one per token and KV head) beside its pages.
        self.kv_scale_bytes = next((x.dtype.itemsize for x in kv_leaves if x.ndim == 3), 0)
        self.ops = self.backend.ops(config)
        self.graphdef = model_graphdef(config, self.backend.param_layout)
        # On a background thread (see jserve.runtime.huge_pages); huge_pages.wait() says what it did.
        self.huge_pages = self.backend.advise_memory((self.params, self.kv))
        self._jit_kwargs: dict = {"donate_argnames": ("kv",)}
        if mesh is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            self._jit_kwargs["out_shardings"] = (NamedSharding(mesh, P()),
                                                 jax.tree.map(lambda x: x.sharding, self.kv))
        self._step = functools.partial(device_steps.forward, self.graphdef, self.ops)
        self._steps: dict[tuple, Any] = {}  # compiler options -> the jitted forward
        # The most rows a decode or mixed call samples: its samples, padded to this, feed the next
        # call's tokens on the device when steps overlap (`launch`, jserve.runtime.overlap).
        self.feed_rows = self.batch_buckets[-1] * self.dp
        self._sample = jax.jit(functools.partial(device_steps.sample_rows, feed_rows=self.feed_rows))
        # Its tokens out as `_place` puts a call's (rows over dp): one compiled forward for both.
        self._feed = jax.jit(overlap.feed_tokens, **({} if mesh is None else {"out_shardings": _rows_sharding(mesh)}))
        self._last_feed = None  # the last call's samples as `launch` feeds them (warm-up uses it)
        self.num_launched = 0  # steps dispatched by `launch`
        self.num_overlapped = 0  # ... while the step before them was still running
        score_kwargs: dict = {"donate_argnames": ("kv",)}
        if mesh is not None:
            replicated, kv_out = self._jit_kwargs["out_shardings"]
            score_kwargs["out_shardings"] = (replicated, replicated, kv_out)
        self._score_step = jax.jit(functools.partial(device_steps.score, self.graphdef, self.ops), **score_kwargs)
        self.num_score_compilations = 0
        if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 1:
            raise ValueError(f"decode_steps must be an integer >= 1, got {decode_steps!r}")
        if decode_steps > 1 and (self.dp > 1 or jax.process_count() > 1):
            raise ValueError(f"multi-step decode (decode_steps={decode_steps}) runs on one data-parallel "
                             f"group in one process; this runner has dp={self.dp} over "
                             f"{jax.process_count()} processes")
        self.decode_steps = decode_steps
        if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool) or (
                num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {num_speculative_tokens!r}")
        if num_speculative_tokens and (self.dp > 1 or jax.process_count() > 1):
            raise ValueError(f"speculative decoding runs on one data-parallel group in one process; this "
                             f"runner has dp={self.dp} over {jax.process_count()} processes")
        self.num_speculative_tokens = num_speculative_tokens
        cap = self.batch_buckets[-1] if max_verify_rows is None else buckets.pick(
            self.batch_buckets, min(max_verify_rows, self.batch_buckets[-1]))
        self.verify_buckets = tuple(b for b in self.batch_buckets if b <= cap)
        self._verify_fns: dict[tuple, Any] = {}  # compiler options -> the jitted verify step
        self._decode_steps = jax.jit(functools.partial(
            device_steps.decode_steps, self.graphdef, self.ops, self.page_size, config.vocab_size, decode_steps),
            donate_argnames=("kv",))
        self._seen: set[tuple] = set()
        # Lazy buckets (`warmup(lazy=True)`): the shapes compiled so far; None: any shape may run.
        self.lazy: BucketCompiler | None = None
        self.masks = StepMasks(config.vocab_size, self._put)  # the sampler's grammar bitmasks
        self.num_compilations = 0
        self.num_compilations_after_warmup = 0
        self.warmed_up = False
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=4096)  # recent steps
        self._last_end: float | None = None  # when the last call returned (None: idle, see mark_idle)
        self.total_real_tokens = 0  # since warm-up, for the padding-waste metric
        self.total_padded_tokens = 0
        # Multi-host (jax.distributed): process 0 schedules and broadcasts each step's inputs;
        # the others run `follow()` and make the same calls (SPMD).
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess and mesh is None:
            raise ValueError("a multi-process run needs a mesh over all processes' devices")

    def execute(self, rows: Sequence[StepRow]) -> StepOutput:
        """Run one scheduler step: decode rows (one token) in decode calls, prefill chunks packed
        into prefill calls, per data-parallel group (`StepRow.group`).

        Returns one sample per row, in `rows` order: the sample after the row's last token.
        """
        if not rows:
            raise ValueError("no rows")
        if any(not 0 <= r.group < self.dp for r in rows):
            raise ValueError(f"row groups must be in [0, {self.dp}), got {sorted({r.group for r in rows})}")
        results: dict[int, dict] = {}
        prompt: dict[int, PromptLogprobs] = {}
        for i, r in enumerate(rows):  # chunks whose prompt logprobs are wanted: a call each
            if r.next_ids is not None:
                self._score(rows, i, results, prompt)
        # Per group its rows; with a prefill chunk among any group's, every row of the step goes
        # into mixed calls (the ragged kernel: decode rows and chunks together), else decode calls.
        plain = [[i for i, r in enumerate(rows) if r.next_ids is None and r.group == g] for g in range(self.dp)]
        if any(rows[i].num_tokens > 1 for p in plain for i in p):
            packs = [self._pack_mixed([rows[i].num_tokens for i in p]) for p in plain]
            packs = [[[p[j] for j in pack] for pack in group] for p, group in zip(plain, packs)]
            for c in range(max(len(p) for p in packs)):
                self._run(rows, [p[c] if c < len(p) else [] for p in packs], results, "mixed")
        else:
            cap = self.batch_buckets[-1]
            for c in range(max(math.ceil(len(p) / cap) for p in plain)):
                self._run(rows, [p[c * cap:(c + 1) * cap] for p in plain], results, "decode")
        out = StepOutput.from_arrays({key: np.stack([results[i][key] for i in range(len(rows))])
                                      for key in results[0]})
        if prompt:
            out.prompt = [prompt.get(i) for i in range(len(rows))]
        return out

    def _score(self, rows: Sequence[StepRow], i: int, results: dict, prompt: dict) -> None:
        """Row i alone (in its group's block of a `dp`-row call), with its prompt logprobs.

        The scoring step is compiled on first use for each token bucket (not at warm-up: few
        requests ask for prompt logprobs), counted in `num_score_compilations`.
        """
        row = rows[i]
        if self.multiprocess:
            raise ValueError("prompt logprobs are not available in a multi-process run")
        T = buckets.pick(self.token_buckets, row.num_tokens)
        B = self.dp
        placed: list[StepRow | None] = [None] * B
        placed[row.group] = row
        tokens, positions, meta, last = self._pack(placed, B, T)
        next_ids = np.full((B, T), -1, np.int32)
        next_ids[row.group, :row.num_tokens] = row.next_ids
        sampling, history = self._sampling(placed, B)
        args = self._place(((tokens, positions, meta, last), next_ids, sampling, history))
        args = (*args, self.masks.device(B, self._constraints(placed)))
        cached = cache_size(self._score_step)
        t0 = time.perf_counter()
        out, plp, self.kv = self._score_step(self.params, self.kv, *args[0], *args[1:])
        out, plp = jax.device_get((out, plp))
        seconds = time.perf_counter() - t0
        if self._is_new(("score", B, T), None if cached is None else cache_size(self._score_step) > cached):
            self.num_score_compilations += 1
        self._record(StepRecord("score", (B, T), row.num_tokens, B * T, seconds, *self._cost([row])))
        results[i] = {key: value[row.group] for key, value in out.items()}
        prompt[i] = PromptLogprobs(**{key: value[row.group, :row.num_tokens] for key, value in plp.items()})

    def _sampling(self, rows: Sequence[StepRow | None], B: int):
        """The rows' `SamplingArrays` and penalty history, padded to B rows."""
        sampling = SamplingArrays.build([None if r is None else (r.sampling, r.sample_index) for r in rows], B)
        history = penalty_history([None if r is None else r.history for r in rows], B, self.max_model_len,
                                  self.config.vocab_size)
        return sampling, history

    def mixed_shapes(self) -> list[tuple[int, int]]:
        """(rows per group, tokens per group) buckets of the mixed step: a batch bucket of rows
        over a token bucket (at least a token per row)."""
        return [(b, t) for b in self.batch_buckets for t in self.token_buckets if b <= t]

    def _shape(self, kind: str, rows: int, tokens: int, *, count: bool = True) -> tuple[int, int] | None:
        """(rows, tokens) of a call of `kind` holding `rows` rows (per group) of `tokens` tokens (a
        mixed step: in all; else per row): their buckets, or with lazy buckets, until that shape is
        compiled, the smallest compiled one holding them (a fallback, counted when `count`);
        None if none can."""
        if kind == "mixed":
            if rows > self.batch_buckets[-1] or tokens > self.token_buckets[-1]:
                return None
            shapes = self.mixed_shapes()
            exact = (buckets.pick(self.batch_buckets, rows), buckets.pick(self.token_buckets, tokens))
        else:
            sizes = self.verify_buckets if kind == "verify" else self.batch_buckets
            if rows > sizes[-1]:
                return None
            shapes = [(b, tokens) for b in sizes]
            exact = (buckets.pick(sizes, rows), tokens)
        key_batch = self._groups(kind)  # shapes are keyed by their global batch
        if exact in shapes and (self.lazy is None or self.lazy.is_ready((kind, exact[0] * key_batch, exact[1]))):
            return exact
        if self.lazy is None:
            return None
        shape = self.lazy.cover(kind, rows * key_batch, tokens, [(b * key_batch, t) for b, t in shapes])
        if shape is None:
            return None
        if count:
            self.lazy.fallbacks += 1
        return shape[0] // key_batch, shape[1]

    def _groups(self, kind: str) -> int:
        """Data-parallel groups a call of `kind` spans (multi-step decode and verify run on one)."""
        return self.dp if kind in ("decode", "mixed") else 1

    def _pack_mixed(self, lengths: list[int]) -> list[list[int]]:
        """Rows (by their token counts) into mixed calls of at most the largest row and token
        buckets, in order."""
        cap, max_rows = self.token_buckets[-1], self.batch_buckets[-1]
        packs: list[list[int]] = []
        total = 0
        for j, n in enumerate(lengths):
            if n > cap:
                raise ValueError(f"a chunk of {n} tokens exceeds the largest token bucket {cap}: "
                                 f"the scheduler must split it")
            if packs and len(packs[-1]) < max_rows and total + n <= cap:
                packs[-1].append(j)
                total += n
            else:
                packs.append([j])
                total = n
        return packs

    def _prepare(self, all_rows: Sequence[StepRow], parts, kind):
        """A call's shape, each row's slot and the host inputs; `parts[g]`: the row indices of
        group g, placed in the g-th block of rows."""
        rows = [all_rows[i] for part in parts for i in part]
        tokens = max(sum(all_rows[i].num_tokens for i in p) for p in parts) if kind == "mixed" else 1
        shape = self._shape(kind, max(1, max(len(p) for p in parts)), tokens)
        if shape is None:  # `execute` keeps calls within the largest shapes
            raise ValueError(f"no {kind} shape holds parts of {[len(p) for p in parts]} rows")
        Bg, T = shape
        B = Bg * self.dp
        slot_of = {i: g * Bg + j for g, part in enumerate(parts) for j, i in enumerate(part)}
        placed: list[StepRow | None] = [None] * B
        for i, slot in slot_of.items():
            placed[slot] = all_rows[i]
        if kind == "mixed":
            arrays = step_rows.pack_ragged([[all_rows[i] for i in p] for p in parts], Bg, T,
                                           max_pages=self.max_pages, page_size=self.page_size, config=self.config)
        else:
            arrays = self._pack(placed, B, T)
        sampling, history = self._sampling(placed, B)
        return rows, B, T, slot_of, placed, (arrays, sampling, history)

    def _run(self, all_rows: Sequence[StepRow], parts, results, kind):
        """One call; `parts[g]` are the row indices of group g, placed in the g-th block of rows."""
        rows, B, T, slot_of, placed, inputs = self._prepare(all_rows, parts, kind)
        cached = self._compiled_count()
        t0 = time.perf_counter()
        out = self._call(kind, B, T, inputs, self._constraints(placed))
        self._last_feed = out.pop("feed", None)  # only `launch` feeds a call from it (and warm-up)
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        self._count((kind, B, T), None if cached is None else self._compiled_count() > cached)
        real = sum(r.num_tokens for r in rows)
        self._record(StepRecord(kind, (B, T), real, self.dp * T if kind == "mixed" else B * T, seconds,
                                *self._cost(rows)))
        for i, slot in slot_of.items():
            results[i] = {key: value[slot] for key, value in out.items()}

    # ------------------------------------------------------------------ overlapped steps

    @property
    def launchable(self) -> bool:
        """Whether `launch` may dispatch steps (one data-parallel group, one process)."""
        return self.dp == 1 and not self.multiprocess

    def launch(self, rows: Sequence[StepRow], after: Launched | None = None,
               feed: Sequence[int] | None = None) -> Launched | None:
        """Dispatch one step as one call and return without waiting for it (async scheduling,
        `jserve.runtime.overlap`); `collect` reads it. Row i with `feed[i]` = j >= 0 is a decode row
        whose token is `after`'s sample in its row j (`Launched.slots`): the device puts it there,
        so the host need not know it. None (nothing dispatched) where the rows need more than one
        call, a prompt-logprob, multi-step or verify call, or the runner spans several groups or
        processes: `execute` them."""
        feed = list(feed) if feed is not None else [-1] * len(rows)
        if len(feed) != len(rows):
            raise ValueError(f"{len(feed)} feed entries for {len(rows)} rows")
        if any(j >= 0 for j in feed) and after is None:
            raise ValueError("a fed row needs the launched step it takes its token from")
        for r, j in zip(rows, feed):
            if j >= 0 and (r.num_tokens != 1 or r.history is not None or r.constraint is not None):
                raise ValueError("a fed row is a decode row without penalties or a grammar (both need "
                                 "its token on the host)")
        if (not rows or not self.launchable
                or any(r.next_ids is not None or r.num_steps != 1 or r.draft_ids for r in rows)):
            return None
        kind = "mixed" if any(r.num_tokens > 1 for r in rows) else "decode"
        if kind == "mixed" and len(self._pack_mixed([r.num_tokens for r in rows])) > 1:
            return None
        if kind == "decode" and len(rows) > self.batch_buckets[-1]:
            return None
        _, B, T, slot_of, placed, inputs = self._prepare(rows, [list(range(len(rows)))], kind)
        # A fed row's token in the call's flat tokens: a decode row's is its row's (T = 1); a
        # mixed step's rows index their last token within the one group's tokens (`last`).
        last = np.asarray(inputs[0][3]).reshape(-1)
        targets = [slot_of[i] * T if kind == "decode" else int(last[slot_of[i]])
                   for i, j in enumerate(feed) if j >= 0]
        sources = [j for j in feed if j >= 0]
        fed = None
        if targets:
            dst, src = overlap.feed_indices(targets, sources, self.feed_rows, B * T)
            fed = (after.feed, dst, src)
        cached = self._compiled_count()
        overlapped = after is not None and not after.ready()
        t0 = time.perf_counter()
        out = self._device_step(inputs, self._constraints(placed), fed=fed)
        compiled = None if cached is None else self._compiled_count() > cached
        self._count((kind, B, T), compiled)
        self.num_launched += 1
        self.num_overlapped += overlapped
        # The device's gap before it: none when the call before still ran; else at most the time
        # since that one was last seen running.
        idle = None if after is None else 0.0 if overlapped else max(0.0, t0 - after.seen_running)
        return Launched(kind, (B, T), list(rows), [slot_of[i] for i in range(len(rows))], out,
                        out.pop("feed"), t0, overlapped, compiled, idle_before=idle, seen_running=t0)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and read its samples (one per row, in its rows' order)."""
        out = jax.device_get(launched.out)
        end = time.perf_counter()
        # The device started it when it was dispatched, or, dispatched while the call before
        # ran, once that one ended (at the latest when the host read that one).
        start = launched.dispatched
        if launched.overlapped and self._last_end is not None:
            start = max(start, self._last_end)
        kind, (B, T), rows = launched.kind, launched.shape, launched.rows
        self._record(StepRecord(kind, (B, T), sum(r.num_tokens for r in rows), T if kind == "mixed" else B * T,
                                end - start, *self._cost(rows)), idle=launched.idle_before)
        return StepOutput.from_arrays({key: np.asarray(value)[launched.slots] for key, value in out.items()})

    def _record(self, record: StepRecord, idle: float | None = None) -> None:
        """`idle`: the gap before it where the caller knows it (a launched step), else the time
        since the last call returned."""
        end = time.perf_counter()  # the call just returned: it started `record.seconds` ago
        if idle is not None:
            record = dataclasses.replace(record, idle_before=idle)
        elif self._last_end is not None:
            record = dataclasses.replace(record, idle_before=max(0.0, end - record.seconds - self._last_end))
        self._last_end = end
        self.records.append(record)
        self.total_real_tokens += record.real_tokens
        self.total_padded_tokens += record.padded_tokens

    def mark_idle(self) -> None:
        """Nothing left to run: the wait until the next call is not a gap between steps."""
        self._last_end = None

    def _call(self, kind: str, B: int, T: int, inputs, constraints):
        """Run the compiled step on host inputs (on every process, when there are several)."""
        if self.multiprocess:
            if jax.process_index() != 0:
                raise RuntimeError("only process 0 drives the steps; the others call follow()")
            # The header says whether a grammar bitmask follows: only a constrained step sends one
            # (filled before the broadcast, so before the forward: no overlap across hosts).
            header = np.asarray([STEP_OP, STEP_KINDS.index(kind), B, T, int(bool(constraints))], np.int32)
            if constraints:
                return self._device_step(broadcast(header, (*inputs, self.masks.host(B, constraints))))
            return self._device_step(broadcast(header, inputs))
        return self._device_step(inputs, constraints)

    def _device_step(self, inputs, constraints=(), fed=None):
        """The forward, dispatched (the device runs it meanwhile); then the grammar bitmask
        (filled now, unless it came with `inputs`) and the sampler. `fed`: (the previous call's
        samples, dst, src) for `overlap.feed_tokens`, which puts them into the tokens first."""
        (tokens, positions, meta, last), sampling, history, *mask = self._place(inputs)
        tokens = self._tokens(tokens)
        if fed is not None:
            tokens = self._feed(tokens, *fed)
        logits, self.kv = self.step_fn(*tokens.shape)(self.params, self.kv, tokens, positions, meta, last)
        bitmask = mask[0] if mask else self.masks.device(last.size, constraints)  # a row per sample
        return self._sample(logits, sampling, history, bitmask)

    def _tokens(self, tokens):
        """A call's tokens on the device, committed: as `feed_tokens` returns them, so that a fed
        call and any other run one compiled forward."""
        return tokens if self.mesh is not None else jax.device_put(tokens, _device_of(self.params))

    @staticmethod
    def _constraints(placed: Sequence[StepRow | None]) -> list[tuple[Any, int]]:
        """(grammar matcher, batch row) of each constrained row."""
        return [(r.constraint, slot) for slot, r in enumerate(placed) if r is not None and r.constraint is not None]

    def _put(self, x: np.ndarray):
        """A host array on the device, committed as the pages are (one compiled signature)."""
        if self.mesh is not None:
            return self._place(x)
        return jax.device_put(x, _device_of(self.params))

    def step_fn(self, batch: int, tokens: int):
        """The jitted forward (`device_steps.forward`) for a (global batch, tokens) shape, with the
        backend's compiler options; its logits go to the sampler, a jitted function of its own."""
        options = self.backend.compiler_options(batch // self.dp, tokens) or {}
        key = tuple(sorted(options.items()))
        if key not in self._steps:
            kwargs = dict(self._jit_kwargs, compiler_options=options) if options else self._jit_kwargs
            self._steps[key] = jax.jit(self._step, **kwargs)
        return self._steps[key]

    def _compiled_count(self) -> int | None:
        sizes = [cache_size(f) for f in (*self._steps.values(), self._sample, self._feed, self._decode_steps,
                                                *self._verify_fns.values())]
        return None if None in sizes else sum(sizes)

    def follow(self) -> int:
        """On processes other than 0: run the steps process 0 broadcasts until it stops them.

        Returns the number of steps run.
        """
        steps = 0
        while True:
            op, kind, B, T, masked = (int(x) for x in broadcast(np.zeros(5, np.int32)))
            if op == STOP_OP:
                return steps
            if STEP_KINDS[kind] == "mixed":
                packed = step_rows.pack_ragged([[]] * self.dp, B // self.dp, T, max_pages=self.max_pages,
                                               page_size=self.page_size)
            else:
                packed = self._pack([None] * B, B, T)
            template = (packed, *self._sampling([], B))
            if masked:
                template = (*template, self.masks.ones(B))
            jax.block_until_ready(self._device_step(broadcast(None, template)))
            steps += 1

    def stop_followers(self) -> None:
        """On process 0 at shutdown: release the processes in `follow()`."""
        if self.multiprocess and jax.process_index() == 0:
            broadcast(np.asarray([STOP_OP, 0, 0, 0, 0], np.int32))

    def _place(self, tree):
        """Host arrays -> global arrays split by rows over `dp` (every process holds all rows)."""
        if self.mesh is None:
            return tree
        rows = _rows_sharding(self.mesh)

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, rows, lambda idx: x[idx])

        return jax.tree.map(put, tree)

    def _pack(self, rows: Sequence[StepRow | None], B: int, T: int):
        """rows: one `StepRow` or None (padding) per batch row."""
        return step_rows.pack(rows, B, T, max_pages=self.max_pages, page_size=self.page_size, config=self.config)

    def _cost(self, rows) -> tuple[int, int]:
        """The bytes and FLOPs a step needs at minimum: the physical floor for metrics (MBU/MFU)."""
        return step_rows.cost(self.config, rows, param_bytes=self.param_bytes, num_params=self.num_params,
                              kv_itemsize=self.kv_itemsize, kv_scale_bytes=self.kv_scale_bytes)

    def _is_new(self, key: tuple, compiled: bool | None) -> bool:
        """Whether a call compiled: its jitted function's cache grew (or, where JAX does not tell,
        its shape `key` is new). The cache also grows on a persistent-cache hit: still a stall."""
        if compiled is None:
            compiled = key not in self._seen
        self._seen.add(key)
        return compiled

    def _count(self, key: tuple, compiled: bool | None) -> None:
        """Count a step's compilation (after warm-up too: none should happen while serving). A
        shape compiled ahead by the lazy buckets' thread grows its function's cache on its first
        call without compiling."""
        if self.lazy is not None and key in self.lazy.ahead:
            compiled = False
        if self._is_new(key, compiled):
            self.num_compilations += 1
            if self.warmed_up:
                self.num_compilations_after_warmup += 1
                logger.warning("compiled %s after warm-up", key)

    def warmup(self, *, progress: bool = True, lazy: bool = False) -> None:
        """Compile every bucket now (the steps write only into the null page). With `lazy`, only
        the largest shape of each kind of step, which serves any call, and the others on a
        background thread (`jserve.runtime.lazy_buckets`; one process only: in a multi-process
        run the others compile what process 0 runs, so every shape is compiled now). See
        `jserve.runtime.warmup`."""
        warmup.warm_up(self, progress=progress, lazy=lazy)

    @property
    def device(self):
        """The device the params live on (one device; the default one if uncommitted)."""
        return _device_of(self.params)

    def close(self, *, free_memory: bool = False) -> None:
        """Stop the lazy buckets' thread (after the shape it is compiling); `free_memory`: delete
        the params' and KV pages' device buffers too (the runner cannot step after that; for the
        owner of those params, `LLM.close`)."""
        if self.lazy is not None:
            self.lazy.stop()
        if free_memory:
            for leaf in jax.tree.leaves((self.params, self.kv)):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()


def _rows_sharding(mesh):
    """Arrays split by rows over the mesh's `dp` axis (a step's host inputs, `Runner._place`)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P("dp"))


def _device_of(params) -> Any:
    """The device the (single-device) params live on; the default device if uncommitted."""
    leaf = jax.tree.leaves(params)[0]
    if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
        return next(iter(leaf.devices()))
    return jax.devices()[0]
