"""Warming: the lazy buckets' order (decode shapes first, a shape a call fell back from next, the
rest while the runner is idle), /health's body and the jserve_warming gauge while they compile."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import pytest

from arch_helpers import widened
from conftest import DATA
from jserve.engine import EngineConfig, build_engine
from jserve.model.checkpoint import read_params
from jserve.runtime import warmup
from jserve.runtime.lazy_buckets import BucketCompiler
from jserve.runtime.runner import Runner
from jserve.text.tokenizer import Tokenizer
from test_server import Server, request, serving


def _held_start(gate: threading.Event, seen: list):
    """A `BucketCompiler.start` whose first job waits for `gate`; `seen` gets the jobs' keys in order."""
    start = BucketCompiler.start

    def held(self, jobs):
        seen.extend(key for key, _ in jobs)
        start(self, [(jobs[0][0], lambda job=jobs[0][1]: (gate.wait(), job()))] + list(jobs[1:]))
    return start, held


def test_warm_up_compiles_the_largest_now_then_decode_shapes_smallest_first():
    config, params = read_params(DATA / "arch" / "llama3")
    runner = Runner(config, {k: jnp.asarray(v) for k, v in params.items()}, num_pages=64, page_size=4,
                    max_model_len=64, backend="cpu", batch_buckets=(1, 2, 4), max_num_batched_tokens=32)
    gate, seen = threading.Event(), []
    start, BucketCompiler.start = _held_start(gate, seen)
    try:
        runner.warmup(progress=False, lazy=True)
    finally:
        BucketCompiler.start = start
        gate.set()
    try:
        assert runner.lazy.is_ready(("decode", 4, 1)) and runner.lazy.is_ready(("mixed", 4, 32))
        assert seen[:2] == [("decode", 1, 1), ("decode", 2, 1)]  # batch 1 first, then the small decodes
        mixed = [k for k in seen if k[0] == "mixed"]
        assert seen[2:] == mixed and mixed == sorted(mixed, key=lambda k: (k[1] * k[2], k))
        assert set(seen) == {("decode", 1, 1), ("decode", 2, 1), ("mixed", 1, 16), ("mixed", 1, 32),
                             ("mixed", 2, 16), ("mixed", 2, 32), ("mixed", 4, 16)}
        assert runner.lazy.wait(300) and not runner.lazy.failed and not runner.lazy.warming
    finally:
        runner.close()


def test_compile_order_puts_every_decode_kind_before_the_mixed_steps():
    shapes = [("mixed", 1, 16), ("verify", 2, 3), ("decode", 8, 1), ("multi_decode", 1, 4), ("decode", 1, 1),
              ("mixed", 2, 16), ("mixed", 1, 64)]
    assert warmup.compile_order(shapes) == [("decode", 1, 1), ("multi_decode", 1, 4), ("verify", 2, 3),
                                            ("decode", 8, 1), ("mixed", 1, 16), ("mixed", 2, 16), ("mixed", 1, 64)]


def test_a_busy_runner_compiles_only_the_shapes_its_calls_fell_back_from():
    busy = threading.Event()
    busy.set()
    done: list = []
    keys = [("decode", 1, 1), ("decode", 2, 1), ("mixed", 1, 16), ("mixed", 2, 16)]
    lazy = BucketCompiler(ready=[("decode", 4, 1), ("mixed", 4, 32)], busy=busy.is_set)
    lazy.start([(k, lambda k=k: done.append(k)) for k in keys])
    assert lazy.warming
    time.sleep(0.3)
    assert done == []  # busy: nothing wanted yet
    assert lazy.cover("mixed", 2, 10, [(b, t) for b in (1, 2, 4) for t in (16, 32)]) == (4, 32)
    assert lazy.wanted == {("mixed", 2, 16)}  # the call's own shape, which it fell back from
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert done == [("mixed", 2, 16)] and lazy.is_ready(("mixed", 2, 16)) and not lazy.wanted
    assert lazy.cover("mixed", 2, 10, [(b, t) for b in (1, 2, 4) for t in (16, 32)]) == (2, 16)
    busy.clear()  # idle: the rest, in their order
    assert lazy.wait(10)
    assert done == [("mixed", 2, 16), ("decode", 1, 1), ("decode", 2, 1), ("mixed", 1, 16)]
    assert not lazy.warming and lazy.pending == []


@pytest.fixture(scope="module")
def lazy_engine(smollm2_checkpoint):
    """A tiny-vocabulary engine with lazy buckets whose background thread waits for `gate`."""
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    config, params = widened("smollm2", tokenizer.vocab_size)
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, page_size=4, num_pages=64,
                       backend="cpu", warmup=True, lazy_buckets=True)
    gate, seen = threading.Event(), []
    start, BucketCompiler.start = _held_start(gate, seen)
    try:
        engine = build_engine(config, params, tokenizer, [], cfg)
    finally:
        BucketCompiler.start = start
    yield engine, gate
    gate.set()


def _metric(srv: Server, name: str) -> float:
    text = request(srv, "GET", "/metrics")[2].decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_health_and_metrics_say_warming_while_buckets_compile(lazy_engine):
    engine, gate = lazy_engine
    pending = len(engine.runner.lazy.pending)
    assert pending > 0
    with serving(engine, "tiny-smollm2") as srv:
        assert request(srv, "GET", "/health")[:3:2] == (200, {"status": "ok", "warming": True,
                                                              "buckets_pending": pending})
        assert _metric(srv, "jserve_warming") == 1 and _metric(srv, "jserve_buckets_pending") == pending
        gate.set()
        assert engine.runner.lazy.wait(120) and not engine.runner.lazy.failed
        assert request(srv, "GET", "/health")[:3:2] == (200, {"status": "ok"})
        assert _metric(srv, "jserve_warming") == 0 and _metric(srv, "jserve_buckets_pending") == 0
