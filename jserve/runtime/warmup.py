"""Warm-up: compile a runner's step shapes before it serves, all of them or (lazy buckets) the
largest of each kind now and the others ahead on a background thread (`lazy_buckets.py`).

Functions over a `jserve.runtime.runner.Runner` (its public calls, on padding rows that write
only into the null page); `Runner.warmup` calls `warm_up`.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from tqdm import tqdm

from jserve.runtime import overlap, step_rows
from jserve.runtime.lazy_buckets import BucketCompiler
from jserve.runtime.steps import StepInputs, StepRow

IDLE_S = 1.0  # a runner with no call for this long is idle: the lazy buckets' thread may compile any shape


def warm_up(runner, *, progress: bool = True, lazy: bool = False) -> None:
    """Compile every bucket now (the steps write only into the null page). With `lazy`, only
    the largest shape of each kind of step, which serves any call, and one stream's
    (`single_stream_shapes`), and the others on a background thread (`jserve.runtime.lazy_buckets`;
    one process only: in a multi-process run the others compile what process 0 runs, so every
    shape is compiled now)."""
    lazy = lazy and not runner.multiprocess
    shapes = [("decode", b, 1) for b in runner.batch_buckets]
    shapes += [("mixed", b, t) for b, t in runner.mixed_shapes()]
    if runner.max_decode_steps > 1:
        shapes += [("multi_decode", b, runner.max_decode_steps) for b in runner.batch_buckets]
    if runner.num_speculative_tokens:
        shapes += [("verify", b, runner.num_speculative_tokens + 1) for b in runner.verify_buckets]
    now = shapes
    if lazy:  # per kind its largest shape (the most rows, of the most tokens), and one stream's
        now = [max(s for s in shapes if s[0] == kind) for kind in dict.fromkeys(s[0] for s in shapes)]
        now += [s for s in single_stream_shapes(runner) if s not in now]
    for kind, B, T in tqdm(now, desc="warm-up", unit="shape", disable=not progress):
        warm(runner, kind, B, T)
    if runner.kv_transfer is not None:
        runner.kv_transfer.warmup()  # the host KV tier's copies
    runner.step_log.reset()
    runner.compiles.warmed_up = True
    if lazy:
        start_lazy(runner, [s for s in shapes if s not in now], now)


def single_stream_shapes(runner) -> list[tuple]:
    """The shapes one stream runs on its own: a short prompt's step (the fewest rows over the
    fewest tokens) and its decode steps (the fewest rows; with multi-step decode or speculation
    also their call at the fewest rows). Lazy buckets compile them before serving too, so that a
    lone request runs at its steady speed from the first call, not padded to the largest shapes
    while competing with their compilation (docs/performance.md, "Ready vs steady state")."""
    one, short = runner.batch_buckets[0], runner.token_buckets[0]
    shapes = [("mixed", one, max(one, short)), ("decode", one, 1)]
    if runner.max_decode_steps > 1:
        shapes.append(("multi_decode", one, runner.max_decode_steps))
    if runner.num_speculative_tokens:
        shapes.append(("verify", runner.verify_buckets[0], runner.num_speculative_tokens + 1))
    return shapes


def padding_rows(runner, kind: str, B: int, T: int) -> list[list[StepRow]]:
    """Rows of one shape (B rows per group; a mixed step's T tokens in all) per group, writing
    only into the null page."""
    table = [0] * runner.max_pages
    local = table if runner.hybrid else None  # hybrid pages: the sliding layers' table too
    if kind == "multi_decode":
        return [[StepRow(0, [0], table, decode_steps=T, local_page_ids=local)] * B]
    if kind == "verify":
        return [[StepRow(0, [0], table, draft_ids=[0] * (T - 1), local_page_ids=local)] * B]
    if kind == "mixed":  # B - 1 decode rows and a chunk of the other tokens
        return [[StepRow(0, [0], table, local_page_ids=local)] * (B - 1)
                + [StepRow(0, [0] * (T - B + 1), table, local_page_ids=local)]] * runner.dp
    return [[StepRow(0, [0] * T, table, local_page_ids=local)] * B] * runner.dp


def warm(runner, kind: str, B: int, T: int) -> None:
    """Run one shape (B rows per group) on padding rows: it compiles."""
    groups = padding_rows(runner, kind, B, T)
    if kind == "multi_decode":
        runner.execute_decode_steps(groups[0])
    elif kind == "verify":
        runner.execute_verify(groups[0])
    else:
        rows = [r for g in groups for r in g]
        parts = [list(range(g * B, (g + 1) * B)) for g in range(runner.dp)]
        runner.run_call(rows, parts, {}, kind)
        call = runner.prepare(rows, parts, kind)
        if runner.sampler.takes_greedy(call.inputs):  # the call sampled greedily: the full sampler of its batch too
            logits = jax.device_put(np.zeros((call.B, runner.config.vocab_size), np.float32), runner.device)
            x = runner.place(call.inputs)
            jax.block_until_ready(runner.sampler.full(logits, x.sampling, x.history, runner.masks.device(call.B, [])))
        if runner.launchable:  # the feed of this shape's tokens, for overlapped steps
            tokens = np.zeros((B, 1) if kind == "decode" else (1, T), np.int32)
            dst, src = overlap.feed_indices([], [], runner.feed_rows, tokens.size)
            launcher = runner.overlap
            jax.block_until_ready(launcher.feed_fn(runner.place(tokens), launcher.last_feed, dst, src))


def compile_samplers(runner, logits, x):
    """Compile the full sampler for a call's logits (abstract) and placed inputs `x`, and the
    greedy one where the runner uses it (`StepSampler.takes_greedy`); returns the full one."""
    if runner.mesh is None:
        runner.sampler.greedy.lower(logits).compile()
    return runner.sampler.full.lower(logits, x.sampling, x.history, runner.masks.device(logits.shape[0], [])).compile()


def compile_order(shapes: list[tuple]) -> list[tuple]:
    """(kind, B, T) shapes by expected use: the decode steps (every step of a generation) by batch,
    smallest first (a lightly loaded server runs those most, and their fallback pads the most),
    then the mixed steps by their tokens (prompts and chunks, short ones the most common)."""
    return sorted(shapes, key=lambda s: (s[0] == "mixed", s[1] * s[2], s))


def start_lazy(runner, later: list[tuple], now: list[tuple]) -> None:
    """Serve from the shapes `now` (compiled), compile those `later` ahead on a thread in
    `compile_order`, a shape a call fell back from first, the others while the runner is idle
    (no call for `IDLE_S`)."""
    later = compile_order(later)
    kv_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), runner.kv)
    for kind, B, T in later:  # the jitted functions exist before the thread starts
        if kind in ("decode", "mixed"):
            runner.step_fn(runner.dp * (B if kind == "decode" else 1), T)
        elif kind == "verify":
            runner.multi.verify_fn(B, T)

    def job(kind: str, B: int, T: int):
        return lambda: compile_ahead(runner, kind, B, T, kv_spec)

    def key(kind: str, B: int, T: int) -> tuple:  # as `_count` names the shape: its global batch
        return kind, B * runner.groups_spanned(kind), T

    # Serving starts busy: the first calls usually follow ready at once (a benchmark, a gateway's
    # traffic), and a job started in between (a job is not interrupted) would run beside them. A
    # server holds the thread through its own setup after warm-up (`BucketCompiler.held`).
    lazy = BucketCompiler(ready=[key(*s) for s in now], busy=lambda: time.perf_counter() - lazy.last_call < IDLE_S)
    runner.step_log.subscribe(lambda record: lazy.note_call())
    runner.lazy = lazy
    runner.compiles.ahead = lambda k: k in runner.lazy.ahead
    runner.lazy.start([(key(*s), job(*s)) for s in later])


def compile_ahead(runner, kind: str, B: int, T: int, kv_spec) -> None:
    """Lower and compile one shape (B rows per group) with the inputs a call of it passes, so
    that its first call finds the executable in JAX's caches (on the lazy buckets' thread)."""
    groups = padding_rows(runner, kind, B, T)
    if kind == "multi_decode":
        multi = runner.multi
        multi.multi_decode.lower(runner.params, kv_spec, *multi.multi_decode_inputs(groups[0], B)).compile()
        return
    if kind == "verify":
        runner.multi.verify_fn(B, T).lower(runner.params, kv_spec, *runner.multi.verify_inputs(groups[0], B)).compile()
        return
    placed = [r for g in groups for r in g]
    if kind == "mixed":
        packed = step_rows.pack_ragged(groups, B, T, max_pages=runner.max_pages, page_size=runner.page_size,
                                       hybrid=runner.hybrid)
    else:
        packed = runner.pack(placed, B * runner.dp, T)
    B *= runner.dp
    lora = None if runner.lora is None else np.zeros_like(packed[0])  # padding rows: no adapter
    x = runner.place(StepInputs.of(packed, *runner.sampling_inputs(placed, B), lora=lora))
    tokens = runner.device_tokens(x.tokens)
    forward = runner.step_fn(*tokens.shape).lower(runner.params, kv_spec, tokens, x.positions, x.meta, x.last, x.lora)
    forward.compile()
    logits = forward.out_info[0]
    if runner.mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        sharding = NamedSharding(runner.mesh, P())
    else:
        sharding = jax.sharding.SingleDeviceSharding(runner.device)
    logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=sharding)
    sample = compile_samplers(runner, logits, x)
    if runner.launchable:
        prev = jax.ShapeDtypeStruct(sample.out_info["feed"].shape, sample.out_info["feed"].dtype,
                                    sharding=sample.output_shardings["feed"])
        dst, src = overlap.feed_indices([], [], runner.feed_rows, tokens.size)
        runner.overlap.feed_fn.lower(x.tokens, prev, dst, src).compile()
