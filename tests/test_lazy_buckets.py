"""Lazy buckets: warm-up compiles the shapes that serve any call, a thread compiles the others ahead,
and nothing compiles on the serving path (JAX's own compile events say so)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.core.request import GREEDY
from jserve.model.checkpoint import read_params
from jserve.runtime.lazy_buckets import BucketCompiler
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow

_compiles: list[tuple[str, int]] = []  # (event, thread ident) of every backend compilation


def _listen(name, seconds, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles.append((name, threading.get_ident()))


jax.monitoring.register_event_duration_secs_listener(_listen)


def _compiles_here() -> int:
    me = threading.get_ident()
    return sum(1 for _, t in _compiles if t == me)


@pytest.fixture(scope="module")
def model():
    config, params = read_params(DATA / "arch" / "llama3")
    return config, {k: jnp.asarray(v) for k, v in params.items()}


def _runner(model, backend, **kw):
    config, params = model
    return Runner(config, params, num_pages=64, page_size=4, max_model_len=64, backend=backend,
                  batch_buckets=(1, 2, 4), max_num_batched_tokens=32, **kw)


def _greedy(runner, prompts, steps=4):
    """Prefill `prompts` (one call), then decode them together; the tokens per prompt."""
    page = iter(range(1, 64))
    pages = [[next(page) for _ in range(-(-(len(p) + steps) // 4))] for p in prompts]
    out = runner.execute([StepRow(0, p, pg, sampling=GREEDY) for p, pg in zip(prompts, pages)])
    tokens = [[int(t)] for t in out.tokens]
    for _ in range(steps - 1):
        out = runner.execute([StepRow(len(p) + len(t) - 1, [t[-1]], pg, sampling=GREEDY)
                              for p, t, pg in zip(prompts, tokens, pages)])
        for t, x in zip(tokens, out.tokens):
            t.append(int(x))
    return tokens


def _lazy_warmup_held(runner) -> threading.Event:
    """`runner.warmup(lazy=True)` with the thread's every job held until the returned gate is set."""
    gate = threading.Event()
    start = BucketCompiler.start
    BucketCompiler.start = lambda self, jobs: start(self, [(k, lambda j=j: (gate.wait(), j())) for k, j in jobs])
    try:
        runner.warmup(progress=False, lazy=True)
    finally:
        BucketCompiler.start = start
    return gate


def test_cover_picks_the_smallest_ready_shape():
    lazy = BucketCompiler(ready=[("decode", 8, 1), ("prefill", 1, 64), ("prefill", 2, 16), ("prefill", 4, 16)])
    shapes = [(b, t) for b in (1, 2, 4) for t in (16, 32, 64)]
    assert lazy.cover("prefill", 1, 10, shapes) == (2, 16)  # 32 padded tokens, fewer than (1, 64)
    assert lazy.cover("prefill", 1, 20, shapes) == (1, 64)
    assert lazy.cover("prefill", 2, 40, shapes) is None
    assert lazy.cover("decode", 3, 1, [(1, 1), (2, 1), (4, 1), (8, 1)]) == (8, 1)
    assert lazy.cover("verify", 1, 3, [(8, 3)]) is None  # another kind's shapes do not count


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_lazy_warmup_serves_from_larger_shapes_then_compiles_nothing_on_the_serving_path(model, backend):
    eager = _runner(model, backend)
    eager.warmup(progress=False)
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4, 6, 11], [2, 4]]  # 3 rows: batch bucket 4, 12 tokens: 16
    expected = _greedy(eager, prompts)

    runner = _runner(model, backend)
    gate = threading.Event()
    start = BucketCompiler.start

    def held(self, jobs):  # the thread waits until the first calls have run from the largest shapes
        start(self, [(jobs[0][0], lambda job=jobs[0][1]: (gate.wait(), job()))] + list(jobs[1:]))

    BucketCompiler.start = held
    try:
        runner.warmup(progress=False, lazy=True)
    finally:
        BucketCompiler.start = start
    assert runner.lazy.is_ready(("decode", 4, 1)) and runner.lazy.is_ready(("mixed", 4, 32))
    one = runner.batch_buckets[0]  # one stream's shapes too (a lone short prompt and its decode)
    assert runner.lazy.is_ready(("decode", one, 1)) and runner.lazy.is_ready(("mixed", one, 16))
    assert not runner.lazy.is_ready(("mixed", 4, 16))
    before = _compiles_here()
    assert _greedy(runner, prompts) == expected  # from the largest shapes: the same tokens
    assert runner.lazy.fallbacks > 0
    assert {r.bucket for r in runner.records} <= {(4, 1), (4, 32), (one, 1), (one, 16)}
    gate.set()
    assert runner.lazy.wait(300) and not runner.lazy.failed
    assert runner.lazy.ahead and not runner.lazy.pending
    fallbacks = runner.lazy.fallbacks
    runner.records.clear()
    assert _greedy(runner, prompts) == expected
    assert runner.lazy.fallbacks == fallbacks  # every shape is ready now
    assert (4, 16) in {r.bucket for r in runner.records}  # the exact bucket, compiled ahead
    assert _compiles_here() == before  # the serving thread compiled nothing, before or after
    assert runner.num_compilations_after_warmup == 0


def test_the_thread_waits_for_an_idle_spell_after_warm_up(model, monkeypatch):
    """Right after warm-up the runner counts as busy (calls usually follow ready at once): the
    thread starts no shape nobody wants until no call has come for `IDLE_S`."""
    from jserve.runtime import warmup

    runner = _runner(model, "reference")
    gate = _lazy_warmup_held(runner)
    assert runner.lazy.pending and runner.lazy._next([("shape", None)]) is None  # busy: wait
    monkeypatch.setattr(warmup, "IDLE_S", 0.0)
    assert runner.lazy._next([("shape", None)]) == 0  # idle: the first job
    gate.set()
    assert runner.lazy.wait(300) and not runner.lazy.failed
    runner.close()


def test_lazy_warmup_of_multi_step_and_verify_steps(model):
    for kw, call, kind in (
            (dict(max_decode_steps=3), lambda r: r.execute_decode_steps([StepRow(2, [4], [1, 2], decode_steps=3)]),
             "multi_decode"),
            (dict(num_speculative_tokens=2), lambda r: r.execute_verify([StepRow(2, [4], [1, 2], draft_ids=[1, 2])]),
             "verify")):
        runner = _runner(model, "reference", **kw)
        gate = _lazy_warmup_held(runner)  # what is ready now was compiled before serving
        # One stream's call of this kind at the fewest rows, besides the largest (a lone request
        # padded to the largest runs slower); the other shapes wait for the thread.
        sizes = runner.batch_buckets if kind == "multi_decode" else runner.verify_buckets
        assert runner.lazy.is_ready((kind, sizes[0], 3)) and runner.lazy.is_ready((kind, sizes[-1], 3))
        assert runner.lazy.pending
        gate.set()
        assert runner.lazy.wait(300) and not runner.lazy.failed
        before = _compiles_here()
        out = call(runner)
        assert np.all(out.num_valid >= 1)
        assert _compiles_here() == before and runner.num_compilations_after_warmup == 0
        runner.close()
