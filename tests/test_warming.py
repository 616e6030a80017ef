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


def test_warm_up_compiles_the_largest_and_one_streams_now_then_decode_shapes_smallest_first():
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
        # one stream's shapes (a short prompt alone, its decode) are compiled before serving too
        assert runner.lazy.is_ready(("decode", 1, 1)) and runner.lazy.is_ready(("mixed", 1, 16))
        assert seen[:1] == [("decode", 2, 1)]  # the small decodes first
        mixed = [k for k in seen if k[0] == "mixed"]
        assert seen[1:] == mixed and mixed == sorted(mixed, key=lambda k: (k[1] * k[2], k))
        assert set(seen) == {("decode", 2, 1), ("mixed", 1, 32), ("mixed", 2, 16), ("mixed", 2, 32),
                             ("mixed", 4, 16)}
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


def test_a_held_thread_compiles_only_wanted_shapes_and_counts_busy_from_the_release():
    """`BucketCompiler.held` (a server's setup between warm-up and ready): an idle runner's shapes
    wait inside, a wanted one compiles; on leaving, `last_call` is that moment."""
    done: list = []
    lazy = BucketCompiler(ready=[("decode", 4, 1)], busy=lambda: False)
    with lazy.held():
        lazy.start([(k, lambda k=k: done.append(k)) for k in [("decode", 1, 1), ("decode", 2, 1)]])
        time.sleep(0.3)
        assert done == []  # idle, but held
        assert lazy.cover("decode", 2, 1, [(1, 1), (2, 1), (4, 1)]) == (4, 1)
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == [("decode", 2, 1)]  # wanted: compiled inside
        left = time.perf_counter()
    assert lazy.last_call >= left
    assert lazy.wait(10) and done == [("decode", 2, 1), ("decode", 1, 1)]


@pytest.fixture(scope="module")
def lazy_engine(smollm2_checkpoint):
    """A tiny-vocabulary engine with lazy buckets whose background thread waits for `gate`."""
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    config, params = widened("smollm2", tokenizer.vocab_size)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=4, num_pages=64,
                       backend="cpu", warmup=True, lazy_buckets=True)  # 4 rows: shapes beyond one stream's
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
    from jserve.engine.async_engine import AsyncLLMEngine

    engine, gate = lazy_engine
    pending = len(engine.runner.lazy.pending)
    assert pending > 0
    with AsyncLLMEngine(engine, start=False).lazy_buckets_held():  # the server's setup before ready
        engine.runner.lazy.last_call = 0.0  # idle long since: held, it still waits
        assert engine.runner.lazy._next([("shape", None)]) is None
    assert engine.runner.lazy.last_call > time.perf_counter() - 1
    with serving(engine, "tiny-smollm2") as srv:
        assert request(srv, "GET", "/health")[:3:2] == (200, {"status": "ok", "warming": True,
                                                              "buckets_pending": pending})
        assert _metric(srv, "jserve_warming") == 1 and _metric(srv, "jserve_buckets_pending") == pending
        gate.set()
        assert engine.runner.lazy.wait(120) and not engine.runner.lazy.failed
        assert request(srv, "GET", "/health")[:3:2] == (200, {"status": "ok"})
        assert _metric(srv, "jserve_warming") == 0 and _metric(srv, "jserve_buckets_pending") == 0


class _Health:
    """A stand-in /health on a loopback port: `answers` in turn (status, body), the last repeated."""

    def __init__(self, answers: list[tuple[int, bytes]]):
        import http.server

        owner = self
        self.answers, self.polls = answers, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = owner.answers[min(owner.polls, len(owner.answers) - 1)]
                owner.polls += self.path == "/health"
                self.send_response(status if self.path == "/health" else 404)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


WARMING = (200, b'{"status": "ok", "warming": true, "buckets_pending": 3}')
OK = (200, b'{"status": "ok"}')


def test_bench_waits_until_the_server_is_warm_and_says_how_long():
    from jserve.bench import runs, server

    health = _Health([(503, b'{"status": "warming_up"}'), WARMING, WARMING, OK])
    try:
        args = runs.argparse.Namespace(base_url=health.url + "/v1/", quiet=True, no_wait_warm=False,
                                       wait_warm_timeout=30.0)
        out = runs.wait_for_warm(args)
        assert health.polls == 4 and out["warm_at_start"] is True
        assert 1.0 <= out["waited_for_warmup_s"] < 10  # three polls 0.5 s apart
        health.polls = 1  # warming again: --no-wait-warm measures at once and says it was not warm
        assert runs.wait_for_warm(runs.argparse.Namespace(**{**vars(args), "no_wait_warm": True})) == {
            "waited_for_warmup_s": None, "warm_at_start": False}
        health.answers = [WARMING]  # warming for ever: the timeout ends the wait, not warm
        waited, warm = server.wait_warm(health.url, timeout=0.3, poll=0.1)
        assert 0.3 <= waited < 5 and warm is False
        waited, warm = server.wait_warm(health.url, timeout=30, poll=0.1, alive=lambda: False)  # the server died
        assert waited < 5 and warm is False
        for answer, warming in (((200, b"ok"), False), ((503, b""), True), ((404, b"no such route"), False),
                                (OK, False), ((200, b'{"warming": false}'), False)):
            health.answers = [answer]
            assert server.is_warming(health.url) is warming, answer
    finally:
        health.close()
    assert server.is_warming(health.url) is False  # nothing listens: the load itself will fail


def test_bench_command_line_wait_flags():
    from jserve.bench.cli import parse_args

    args = parse_args(["--workload", "mix"])
    assert (args.no_wait_warm, args.wait_warm_timeout) == (False, 600.0)
    args = parse_args(["--no-wait-warm", "--wait-warm-timeout", "5"])
    assert (args.no_wait_warm, args.wait_warm_timeout) == (True, 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--wait-warm-timeout", "-1"])


_WARMS_FOR_A_SECOND = r"""
import http.server, sys, time
start = time.monotonic()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        warming = time.monotonic() - start < 1.5
        self.wfile.write(b'{"status": "ok", "warming": true}' if warming else b'{"status": "ok"}')
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_waits_for_warm_unless_told_not_to(tmp_path):
    import sys

    from jserve.bench import ServerProcess

    command = [sys.executable, "-c", _WARMS_FOR_A_SECOND, "{port}"]
    with ServerProcess(command=command, log=tmp_path / "a.log", wait_warm=None) as server:
        assert server.warmup_s is None and server.warm is None
    with ServerProcess(command=command, log=tmp_path / "b.log") as server:
        assert server.warm is True and 0 < server.warmup_s < 10
