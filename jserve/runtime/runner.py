"""The paged runner: params and KV pages on the device, one compiled step per bucket shape.

`execute` runs a step's `StepRow`s (`jserve.runtime.steps`): decode rows in decode calls, a step
with a prefill chunk as mixed calls (the ragged kernel), a prompt-logprob chunk in a scoring
call; each is the forward (its backend's operations) then the sampler. The runner composes the
parts with a job of their own: `CompileTracker` (compilations), `StepLog` (what each call did),
`MultiTokenSteps` (multi-step decode, speculative verify), `OverlapLauncher` (async scheduling)
and `StepBroadcast` (a multi-process run). See docs/architecture.md ("The runner").
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import numpy as np

from jserve.core import buckets
from jserve.model import lora as lora_model
from jserve.model import model_graphdef, quant
from jserve.model.config import ModelConfig
from jserve.model.lora import LoraSpec
from jserve.runtime import backends, device_steps, param_swap, scoring_step, step_rows, warmup
from jserve.runtime.backends import Backend
from jserve.runtime.compile_tracker import CompileTracker
from jserve.runtime.distributed import StepBroadcast
from jserve.runtime.lazy_buckets import BucketCompiler
from jserve.runtime.lora_writer import LoraSlotWriter
from jserve.runtime.multi_token_steps import MultiTokenSteps
from jserve.runtime.overlap import Launched, OverlapLauncher
from jserve.runtime.paged_attention import local_pages_per_group, with_local_pages
from jserve.runtime.sampler import SamplingArrays, penalty_history
from jserve.runtime.step_log import StepLog
from jserve.runtime.step_masks import StepMasks
from jserve.runtime.step_sampler import StepSampler
from jserve.runtime.steps import PreparedCall, PromptLogprobs, StepInputs, StepOutput, StepRecord, StepRow


class Runner:
    """Owns params, KV pages and the compiled steps."""

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array], *, num_pages: int,
                 page_size: int | None = None, max_model_len: int, kv_dtype: Any = None,
                 backend: Backend | str | None = None,
                 batch_buckets: Sequence[int] = buckets.DEFAULT_BATCH_BUCKETS,
                 token_buckets: Sequence[int] = buckets.DEFAULT_TOKEN_BUCKETS,
                 max_num_batched_tokens: int = 512, mesh: Any = None, native_matmuls: bool = True,
                 huge_pages: bool = True, max_decode_steps: int = 1, num_speculative_tokens: int = 0,
                 max_verify_rows: int | None = None, lora: LoraSpec | None = None,
                 local_pages: int | None = None):
        """`backend`: a `Backend`, or its name for `backends.create` (with `native_matmuls` and
        `huge_pages`); it decides the page size (when None), the layouts and every operation.
        `params`: checkpoint weights (stacked) or a model state in the backend's layout; with a
        ('dp', 'tp') `mesh`, laid out and placed for it (`sharding.place_params`), and buckets,
        `max_num_batched_tokens` and page ids are per data-parallel group. The last three
        arguments: `MultiTokenSteps`. `lora`: the model's LoRA slots (`LoraSlotWriter`), None: none.
        `local_pages`: the sliding layers' own pages, in all (`jserve.core.hybrid_pages`; None: none)."""
        self.config = config
        self.mesh = mesh
        self.backend = backends.create(backend, mesh=mesh, native_matmuls=native_matmuls, huge_pages=huge_pages)
        self.dp = 1 if mesh is None else dict(zip(mesh.axis_names, mesh.devices.shape))["dp"]
        # Multi-host (jax.distributed): process 0 schedules and broadcasts each step's inputs.
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess and mesh is None:
            raise ValueError("a multi-process run needs a mesh over all processes' devices")
        if num_pages % self.dp:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of dp ({self.dp})")
        self.pages_per_group = num_pages // self.dp
        self.local_pages, self.hybrid = local_pages, local_pages is not None
        self.local_pages_per_group = local_pages_per_group(config, local_pages, self.dp)
        # The real weights' bytes and count (the step's floor), not those of padded packed panels.
        self.param_bytes = quant.param_bytes(params)
        self.num_params = quant.param_count(params)
        self.params = self.backend.prepare_params(config, params)
        self.lora = None if lora is None else LoraSlotWriter(config, lora)
        if self.lora is not None:  # over a mesh: sharded like their base linears
            self.params = self.lora.add_slots(self.params, self._put, mesh)
        self.page_size = page_size or self.backend.default_page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.batch_buckets = self.backend.batch_buckets(batch_buckets)
        self.token_buckets = buckets.clip(token_buckets, min(max_num_batched_tokens, max_model_len))
        # A fixed page-table width: the kernels loop over live pages only (no bucket dimension).
        self.max_pages = math.ceil(max_model_len / self.page_size)
        self._init_pages(kv_dtype)
        self.compiles = CompileTracker()
        self.step_log = StepLog()
        self.lazy: BucketCompiler | None = None  # lazy buckets: the shapes compiled so far (None: any)
        self.kv_transfer = None  # the host KV tier's copies (`jserve.runtime.kv_transfer`; build_engine sets it)
        self.masks = StepMasks(config.vocab_size, self._put)  # the sampler's grammar bitmasks
        self._init_programs()
        self.multi = MultiTokenSteps(self, max_decode_steps, num_speculative_tokens, max_verify_rows)
        self.max_decode_steps = self.multi.max_decode_steps
        self.num_speculative_tokens = self.multi.num_speculative_tokens
        self.verify_buckets = self.multi.verify_buckets
        self.overlap = OverlapLauncher(self)
        self.broadcast = StepBroadcast(self)

    def _init_pages(self, kv_dtype: Any) -> None:
        """The KV pages, in the backend's layout, committed where the params are."""
        if self.mesh is not None:
            from jserve.runtime.sharding import kv_sharding

            sharding = kv_sharding(self.mesh)
        else:
            # Committed to a device from the start: the step returns committed (donated) pages, and
            # a first call with uncommitted ones would compile each shape a second time later.
            sharding = jax.sharding.SingleDeviceSharding(_device_of(self.params))
        kv_dtype = kv_dtype or quant.float_dtype(self.params)
        self.backend.check(self.config, kv_dtype, self.page_size)
        self.kv = self.backend.init_kv(self.config, self.num_pages, self.page_size, kv_dtype, sharding,
                                       local_pages=self.local_pages)
        leaves = jax.tree.leaves(self.kv)
        self.kv_itemsize = leaves[0].dtype.itemsize
        # A quantized cache's scales ([kv_heads, pages, page_size]: one per token and KV head) beside its pages.
        self.kv_scale_bytes = next((x.dtype.itemsize for x in leaves if x.ndim == 3), 0)
        # On a background thread (see jserve.runtime.huge_pages); huge_pages.wait() says what it did.
        self.huge_pages = self.backend.advise_memory((self.params, self.kv))

    def _init_programs(self) -> None:
        """The jitted forward (per compiler options), sampler and scoring step."""
        self.ops = self.backend.ops(self.config)
        if self.hybrid:  # the sliding layers read their own pages
            self.ops = with_local_pages(self.ops, self.config, self.pages_per_group, self.local_pages_per_group)
        self.graphdef = model_graphdef(self.config, self.backend.param_layout, self.lora and self.lora.spec)
        self._jit_kwargs: dict = {"donate_argnames": ("kv",)}
        score_kwargs: dict = {"donate_argnames": ("kv",)}
        if self.mesh is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            replicated, kv_out = NamedSharding(self.mesh, P()), jax.tree.map(lambda x: x.sharding, self.kv)
            self._jit_kwargs["out_shardings"] = (replicated, kv_out)
            score_kwargs["out_shardings"] = (replicated, replicated, kv_out)
        self._step = functools.partial(device_steps.forward, self.graphdef, self.ops)
        self._steps: dict[tuple, Any] = {}  # compiler options -> the jitted forward
        # The most rows a decode or mixed call samples: its samples, padded to this, feed the next
        # call's tokens on the device when steps overlap (`launch`, jserve.runtime.overlap).
        self.feed_rows = self.batch_buckets[-1] * self.dp
        self.sampler = StepSampler(self.feed_rows, self.ops.batch_invariant, self.mesh is None, self.masks)
        self._score_step = jax.jit(functools.partial(device_steps.score, self.graphdef, self.ops), **score_kwargs)

    # ------------------------------------------------------------------ what others read

    @property
    def single_group(self) -> bool:
        """One data-parallel group in one process: what multi-step decode, the verify step and
        launched (overlapped) steps run on. The one place this rule is written."""
        return self.dp == 1 and not self.multiprocess

    def require_single_group(self, what: str) -> None:
        if not self.single_group:
            raise ValueError(f"{what} runs on one data-parallel group in one process; this runner has "
                             f"dp={self.dp} over {jax.process_count()} processes")

    launchable = property(lambda self: self.single_group)  # whether `launch` may dispatch steps
    # The counters and records that stats, tests and benchmarks read, where their owners keep them.
    records = property(lambda self: self.step_log.records)
    num_compilations = property(lambda self: self.compiles.num_compilations)
    num_compilations_after_warmup = property(lambda self: self.compiles.num_after_warmup)
    num_score_compilations = property(lambda self: self.compiles.num_score)
    warmed_up = property(lambda self: self.compiles.warmed_up)

    @property
    def device(self):
        """The device the params live on (one device; the default one if uncommitted)."""
        if getattr(self, "_device_for", None) is not self.params:  # flattening the params each step cost ms
            self._device_for, self._params_device = self.params, _device_of(self.params)
        return self._params_device

    # ------------------------------------------------------------------ steps

    def execute(self, rows: Sequence[StepRow]) -> StepOutput:
        """Run one scheduler step: decode rows (one token) in decode calls, prefill chunks packed
        into mixed calls, per data-parallel group (`StepRow.dp_group`).

        Returns one sample per row, in `rows` order: the sample after the row's last token.
        """
        if not rows:
            raise ValueError("no rows")
        if any(not 0 <= r.dp_group < self.dp for r in rows):
            raise ValueError(f"row dp_groups must be in [0, {self.dp}), got {sorted({r.dp_group for r in rows})}")
        results: dict[int, dict] = {}
        prompt: dict[int, PromptLogprobs] = {}
        for i, r in enumerate(rows):  # chunks whose prompt logprobs are wanted: a call each
            if r.prompt_targets is not None:
                results[i], prompt[i] = scoring_step.score_row(self, r)
        # Per group its rows; with a prefill chunk among any group's, every row of the step goes
        # into mixed calls (the ragged kernel: decode rows and chunks together), else decode calls.
        plain = [[i for i, r in enumerate(rows) if r.prompt_targets is None and r.dp_group == g]
                 for g in range(self.dp)]
        if any(rows[i].num_tokens > 1 for p in plain for i in p):
            packs = [self.pack_mixed([rows[i].num_tokens for i in p]) for p in plain]
            packs = [[[p[j] for j in pack] for pack in group] for p, group in zip(plain, packs)]
            for c in range(max(len(p) for p in packs)):
                self.run_call(rows, [p[c] if c < len(p) else [] for p in packs], results, "mixed")
        else:
            cap = self.batch_buckets[-1]
            for c in range(max(math.ceil(len(p) / cap) for p in plain)):
                self.run_call(rows, [p[c * cap:(c + 1) * cap] for p in plain], results, "decode")
        out = StepOutput.from_arrays({key: np.stack([results[i][key] for i in range(len(rows))])
                                      for key in results[0]})
        if prompt:
            out.prompt = [prompt.get(i) for i in range(len(rows))]
        return out

    def run_call(self, all_rows: Sequence[StepRow], parts, results, kind):
        """One decode or mixed call; `parts[g]` are the row indices of group g, placed in the g-th
        block of rows; each row's outputs go into `results[i]`."""
        call = self.prepare(all_rows, parts, kind)

        def run():
            grammar_rows = self.grammar_rows(call.placed)  # on every process, when there are several
            out = (self.broadcast.lead(kind, call.B, call.T, call.inputs, grammar_rows) if self.multiprocess
                   else self.device_step(call.inputs, grammar_rows))
            self.overlap.last_feed = out.pop("feed", None)  # only `launch` feeds a call from it (and warm-up)
            return out

        out, seconds = self.compiles.timed((kind, call.B, call.T), self.compiled_fns, run)
        real = sum(r.num_tokens for r in call.rows)
        self.step_log.add(StepRecord(kind, (call.B, call.T), real, self.dp * call.T if kind == "mixed" else
                                     call.B * call.T, seconds, *self.cost(call.rows)))
        for i, slot in call.slot_of.items():
            results[i] = {key: value[slot] for key, value in out.items()}

    def execute_decode_steps(self, rows: Sequence[StepRow]) -> StepOutput:
        """Multi-step decode: see `MultiTokenSteps.execute_decode_steps`."""
        return self.multi.execute_decode_steps(rows)

    def execute_verify(self, rows: Sequence[StepRow]) -> StepOutput:
        """A speculative step: see `MultiTokenSteps.execute_verify`."""
        return self.multi.execute_verify(rows)

    def launch(self, rows: Sequence[StepRow], after: Launched | None = None,
               feed: Sequence[int] | None = None) -> Launched | None:
        """Dispatch a step without waiting: see `OverlapLauncher.launch`."""
        return self.overlap.launch(rows, after, feed)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and read its samples: see `OverlapLauncher.collect`."""
        return self.overlap.collect(launched)

    def mark_idle(self) -> None:
        """Nothing left to run: the wait until the next call is not a gap between steps."""
        self.step_log.mark_idle()

    def follow(self) -> int:
        """On processes other than 0: run the steps process 0 broadcasts until it stops them."""
        return self.broadcast.follow()

    def stop_followers(self) -> None:
        """On process 0 at shutdown: release the processes in `follow()`."""
        self.broadcast.stop()

    # ------------------------------------------------------------------ calls

    def prepare(self, all_rows: Sequence[StepRow], parts, kind: str) -> PreparedCall:
        """A decode or mixed call's shape, each row's slot and the host inputs; `parts[g]`: the
        row indices of group g, placed in the g-th block of rows."""
        rows = [all_rows[i] for part in parts for i in part]
        tokens = max(sum(all_rows[i].num_tokens for i in p) for p in parts) if kind == "mixed" else 1
        shape = self.shape(kind, max(1, max(len(p) for p in parts)), tokens)
        if shape is None:  # `execute` keeps calls within the largest shapes
            raise ValueError(f"no {kind} shape holds parts of {[len(p) for p in parts]} rows")
        Bg, T = shape
        B = Bg * self.dp
        slot_of = {i: g * Bg + j for g, part in enumerate(parts) for j, i in enumerate(part)}
        placed: list[StepRow | None] = [None] * B
        for i, slot in slot_of.items():
            placed[slot] = all_rows[i]
        if kind == "mixed":
            groups = [[all_rows[i] for i in p] for p in parts]
            packed = step_rows.pack_ragged(groups, Bg, T, max_pages=self.max_pages, page_size=self.page_size,
                                           config=self.config, hybrid=self.hybrid)
            lora = None if self.lora is None else step_rows.lora_ids_ragged(groups, T)
            inputs = StepInputs.of(packed, *self.sampling_inputs(placed, B), lora=lora)
        else:
            inputs = self.host_inputs(placed, B, T)
        return PreparedCall(kind, B, T, rows, slot_of, placed, inputs)

    def host_inputs(self, placed: Sequence[StepRow | None], B: int, T: int) -> StepInputs:
        """A decode-shaped call's host inputs: one `StepRow` or None (padding) per batch row."""
        lora = None if self.lora is None else step_rows.lora_ids(placed, B, T)
        return StepInputs.of(self.pack(placed, B, T), *self.sampling_inputs(placed, B), lora=lora)

    def sampling_inputs(self, rows: Sequence[StepRow | None], B: int):
        """The rows' `SamplingArrays` and penalty history, padded to B rows."""
        sampling = SamplingArrays.build([None if r is None else (r.sampling, r.sample_index, r.banned_ids)
                                         for r in rows], B)
        history = penalty_history([None if r is None else r.penalty_tokens for r in rows], B, self.max_model_len,
                                  self.config.vocab_size)
        return sampling, history

    def pack(self, rows: Sequence[StepRow | None], B: int, T: int):
        """rows: one `StepRow` or None (padding) per batch row (`step_rows.pack`)."""
        return step_rows.pack(rows, B, T, max_pages=self.max_pages, page_size=self.page_size, config=self.config,
                              hybrid=self.hybrid)

    def cost(self, rows) -> tuple[int, int]:
        """The bytes and FLOPs a step needs at minimum: the physical floor for metrics (MBU/MFU)."""
        return step_rows.cost(self.config, rows, param_bytes=self.param_bytes, num_params=self.num_params,
                              kv_itemsize=self.kv_itemsize, kv_scale_bytes=self.kv_scale_bytes)

    def device_step(self, inputs: StepInputs, constraints=(), fed=None):
        """The forward, dispatched (the device runs it meanwhile); then the sampler (`StepSampler`:
        the grammar bitmask filled now, unless it came with `inputs`). `fed`: (the previous call's
        samples, dst, src) for `overlap.feed_tokens`, which puts them into the tokens first."""
        x = self.place(inputs)
        # A fed call's tokens go to the feed as they are (jit's own transfer is cheaper than a
        # device_put first); its output is committed, as `device_tokens` makes the others'.
        tokens = self.device_tokens(x.tokens) if fed is None else self.overlap.feed_fn(x.tokens, *fed)
        logits, self.kv = self.step_fn(*tokens.shape)(self.params, self.kv, tokens, x.positions, x.meta, x.last,
                                                      x.lora)
        return self.sampler(logits, inputs, x, constraints)

    def run_program(self, fn, *inputs):
        """A compiled multi-token program over the params and the donated pages: its outputs."""
        out, self.kv = fn(self.params, self.kv, *inputs)
        return out

    def device_tokens(self, tokens):
        """A call's tokens on the device, committed: as `feed_tokens` returns them, so that a fed
        call and any other run one compiled forward."""
        return tokens if self.mesh is not None else jax.device_put(tokens, self.device)

    @staticmethod
    def grammar_rows(placed: Sequence[StepRow | None]) -> list[tuple[Any, int]]:
        """(grammar matcher, batch row) of each constrained row."""
        return [(r.grammar_matcher, slot) for slot, r in enumerate(placed)
                if r is not None and r.grammar_matcher is not None]

    def _put(self, x: np.ndarray):
        """A host array on the device, committed as the pages are (one compiled signature)."""
        if self.mesh is not None:
            return self.place(x)
        return jax.device_put(x, self.device)

    def place(self, tree):
        """Host arrays -> global arrays split by rows over `dp` (every process holds all rows)."""
        if self.mesh is None:
            return tree
        from jserve.runtime.sharding import rows_sharding

        rows = rows_sharding(self.mesh)

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, rows, lambda idx: x[idx])

        return jax.tree.map(put, tree)

    def step_fn(self, batch: int, tokens: int):
        """The jitted forward (`device_steps.forward`) for a (global batch, tokens) shape, with the
        backend's compiler options; its logits go to the sampler, a jitted function of its own."""
        options = self.backend.compiler_options(batch // self.dp, tokens) or {}
        key = tuple(sorted(options.items()))
        if key not in self._steps:
            kwargs = dict(self._jit_kwargs, compiler_options=options) if options else self._jit_kwargs
            self._steps[key] = jax.jit(self._step, **kwargs)
        return self._steps[key]

    def compiled_fns(self) -> list:
        """Every jitted step function (their caches grow when a call compiles)."""
        return [*self._steps.values(), *self.sampler.compiled_fns(), self.overlap.feed_fn, *self.multi.compiled_fns()]

    # ------------------------------------------------------------------ shapes

    def mixed_shapes(self) -> list[tuple[int, int]]:
        """(rows per group, tokens per group) buckets of the mixed step: a batch bucket of rows
        over a token bucket (at least a token per row)."""
        return [(b, t) for b in self.batch_buckets for t in self.token_buckets if b <= t]

    def shape(self, kind: str, rows: int, tokens: int, *, count: bool = True) -> tuple[int, int] | None:
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
        spanned = self.groups_spanned(kind)  # shapes are keyed by their global batch
        if exact in shapes and (self.lazy is None or self.lazy.is_ready((kind, exact[0] * spanned, exact[1]))):
            return exact
        if self.lazy is None:
            return None
        shape = self.lazy.cover(kind, rows * spanned, tokens, [(b * spanned, t) for b, t in shapes])
        if shape is None:
            return None
        if count:
            self.lazy.fallbacks += 1
        return shape[0] // spanned, shape[1]

    def groups_spanned(self, kind: str) -> int:
        """Data-parallel groups a call of `kind` spans (multi-step decode and verify run on one)."""
        return self.dp if kind in ("decode", "mixed") else 1

    def pack_mixed(self, lengths: list[int]) -> list[list[int]]:
        """Rows (by their token counts) into mixed calls within the largest row and token buckets."""
        return step_rows.pack_mixed(lengths, max_tokens=self.token_buckets[-1], max_rows=self.batch_buckets[-1])

    # ------------------------------------------------------------------ life cycle
    def replace_params(self, new) -> None:
        """Swap in weights of the served params' tree, shapes, dtypes and shardings (no recompile,
        the old buffers freed; LoRA slots stay); ValueError naming the first mismatch."""
        param_swap.Residency.of(self).replace_params(new if self.lora is None else lora_model.carry_slots(
            new, self.params))

    def write_lora_slot(self, slot: int, weights: dict | None) -> None:
        """LoRA slot `slot` holds this adapter from the next step on (`LoraSlotWriter.write`)."""
        if self.lora is None:
            raise ValueError("this runner has no LoRA slots (enable_lora)")
        self.params = self.lora.write(self.params, slot, weights)

    def warmup(self, *, progress: bool = True, lazy: bool = False) -> None:
        """Compile every bucket now (the steps write only into the null page). With `lazy`, only
        the largest shape of each kind of step, which serves any call, and the others on a
        background thread (one process only). See `jserve.runtime.warmup`."""
        warmup.warm_up(self, progress=progress, lazy=lazy)

    def close(self, *, free_memory: bool = False) -> None:
        """Stop the lazy buckets' thread (after the shape it is compiling) and the huge pages'
        (after the buffer it is advising); `free_memory`: delete the params' and KV pages' device
        buffers too (the runner cannot step after that; for the owner of those params, `LLM.close`)."""
        if self.lazy is not None:
            self.lazy.stop()
        self.huge_pages.stop()
        if free_memory:
            for leaf in jax.tree.leaves((self.params, self.kv)):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()


def _device_of(params) -> Any:
    """The device the (single-device) params live on; the default device if uncommitted."""
    leaf = jax.tree.leaves(params)[0]
    if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
        return next(iter(leaf.devices()))
    return jax.devices()[0]
