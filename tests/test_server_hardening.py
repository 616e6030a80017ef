"""The server against hostile and careless clients: tenants, limits, timeouts, a dead engine.

One server (test_server.py's engine: the tiny SmolLM2-shaped model with the real tokenizer) with
short timeouts and a small connection cap; the fault tests wrap the same engine in a step that
raises or hangs, behind a server of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server import ServerState, tokenizer_pool
from jserve.server.cli import DEFAULT_MODEL_NAMES
from jserve.server.http import Timeouts
from jserve.server.limits import Limits
from test_server import CHAT, Server, assert_error, engine, engine_idle, request  # noqa: F401 - fixtures

README = Path(__file__).parents[1] / "README.md"
TIMEOUTS = Timeouts(keepalive=1.0, body=0.5, write=0.3, max_connections=12)
LIMITS = Limits(max_input_tokens=64, max_total_tokens=100)
PROMPT = list(range(1000, 1040))  # 40 token ids: 10 full pages of 4


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811 - the fixture imported above
    aengine = AsyncLLMEngine(engine)
    state = ServerState(DEFAULT_MODEL_NAMES, limits=LIMITS, timeouts=TIMEOUTS)
    state.attach(aengine)
    srv = Server(state, max_body_bytes=8 * 2**20)
    yield srv
    srv.close()
    assert aengine.shutdown(timeout=30)
    assert engine.stats()["pages_in_use"] == 0


def completion(server, body, key=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return request(server, "POST", "/v1/completions", {"max_tokens": 2, **body}, headers=headers, **kw)


def cached_tokens(server, key, **extra) -> int:
    status, headers, body = completion(server, {"prompt": PROMPT, "max_tokens": 1, **extra}, key=key)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ------------------------------------------------------------------------------ isolation

def test_tenants_do_not_share_the_prefix_cache(server):
    state = server.state
    state.api_keys = (b"key-a", b"key-b")
    try:
        cached_tokens(server, "key-a")
        assert cached_tokens(server, "key-a") > 0  # the same tenant reuses its own pages
        assert cached_tokens(server, "key-b") == 0  # another key never sees them
        assert cached_tokens(server, "key-a", cache_salt="s1") == 0  # a salt partitions further
        assert cached_tokens(server, "key-a", cache_salt="s1") > 0
        assert cached_tokens(server, "key-b", cache_salt="s1") == 0  # same salt, other tenant: apart
    finally:
        state.api_keys = ()
    assert cached_tokens(server, None) == 0  # keyless clients are one more tenant
    assert cached_tokens(server, None) > 0


# ------------------------------------------------------------------------------ limits

def test_admission_counts_sequences_and_tokens(server):
    adm = server.state.admission
    assert (adm.seqs, adm.tokens) == (0, 0)
    saved = adm.max_seqs, adm.max_tokens
    try:
        adm.max_seqs, adm.max_tokens = 8, 400
        body = {"prompt": [5] * 10, "max_tokens": 30}
        assert_error(*completion(server, {**body, "n": 9})[::2], 400, "request_too_large", contains=("9", "8"))
        adm.seqs = 5  # as if 5 sequences were running: n=4 does not fit now, n=3 does
        status, headers, answer = completion(server, {**body, "n": 4})
        assert_error(status, answer, 429, "queue_full", contains=("5",))
        assert headers["Retry-After"] == "1"
        assert completion(server, {**body, "n": 3})[0] == 200
        adm.seqs = 0
        # tokens: 10 prompt + 30 max_tokens per sequence
        assert_error(*completion(server, {**body, "n": 11})[::2], 400)  # n past max_seqs
        adm.max_seqs = 64
        assert_error(*completion(server, {**body, "n": 11})[::2], 400, "request_too_large", contains=("440",))
        adm.tokens = 300
        assert_error(*completion(server, {**body, "n": 3})[::2], 429, "queue_full", contains=("120",))
        assert completion(server, {**body, "n": 2})[0] == 200
        adm.tokens = 0
    finally:
        adm.max_seqs, adm.max_tokens = saved
    assert (adm.seqs, adm.tokens) == (0, 0)  # every request gave back what it took


def test_input_and_total_token_limits(server):
    assert_error(*completion(server, {"prompt": [5] * 65})[::2], 400, "context_length_exceeded", contains=("64", "65"))
    assert_error(*completion(server, {"prompt": [5] * 60, "max_tokens": 41})[::2], 400, "context_length_exceeded",
                 contains=("100", "101"))
    assert completion(server, {"prompt": [5] * 60, "max_tokens": 40})[0] == 200
    # a huge text prompt is refused from its size alone, before it is tokenized
    status, _, body = completion(server, {"prompt": "hello world, " * 280_000})
    assert_error(status, body, 400, "context_length_exceeded", contains=("bytes of text",))
    # chat without max_tokens is admitted at max_total_tokens per sequence
    status, _, body = request(server, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 2})
    assert status == 200 and len(body["choices"]) == 2


def test_priority_needs_the_priority_policy(server):
    state = server.state
    assert_error(*completion(server, {"prompt": "hi", "priority": -3})[::2], 400, contains=("priority",))
    ctx = state.ctx
    state.ctx = dataclasses.replace(ctx, allow_priority=True)
    try:
        assert completion(server, {"prompt": "hi", "priority": -3})[0] == 200
    finally:
        state.ctx = ctx


def test_fields_that_ask_for_nothing_are_accepted(server):
    body = {"messages": CHAT, "max_tokens": 2, "tools": None, "response_format": {"type": "text"}, "store": False,
            "stream_options": None}
    status, _, answer = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, answer


# ------------------------------------------------------------------------------ off the event loop

def test_large_tokenization_runs_off_the_event_loop(server):
    pool = server.state.pool
    text = "The quick brown fox jumps over the lazy dog. " * 22_000  # ~1 MB: about 0.6 s to encode

    async def encode_while_ticking():
        lags = []

        async def tick():
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lags.append(time.monotonic() - t - 0.01)

        ticker = asyncio.ensure_future(tick())
        t = time.monotonic()
        ids = await pool.run(len(text), tokenizer_pool.encode, text, False)
        seconds = time.monotonic() - t
        ticker.cancel()
        return ids, seconds, max(lags)

    ids, seconds, lag = server.call(encode_while_ticking())
    assert ids == server.state.tokenizer.encode(text, add_special_tokens=False)
    assert lag < max(0.2, seconds / 3), (lag, seconds)  # inline, the loop would have stalled for all of it
    assert pool.num_jobs == 0


def test_tokenizer_workers_end_with_a_server_that_exits_at_once(smollm2_checkpoint):
    """A server that `os._exit`s (after a fatal engine fault) leaves no time to stop its pool: its
    worker must still go, or the worker holds the server's stderr open and a reader of the log
    waits forever (test_serve_process's fault test hung so once in CI)."""
    import sys

    code = (f"import asyncio, os\n"
            f"from jserve.server.tokenizer_pool import TokenizerPool, encode\n"
            f"from jserve.text.tokenizer import Tokenizer\n"
            f"pool = TokenizerPool(Tokenizer.load({str(smollm2_checkpoint)!r}))\n"
            f"print(asyncio.run(pool.run(10 ** 6, encode, 'hello world', False)), flush=True)\n"
            f"os._exit(1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = {}
    reader = threading.Thread(target=lambda: result.update(out=proc.stdout.read(), err=proc.stderr.read()),
                              daemon=True)
    reader.start()
    reader.join(60)  # EOF comes once every holder of the pipes, the worker too, is gone
    try:
        assert not reader.is_alive(), "the tokenizer worker outlived its server"
        assert proc.wait(10) == 1 and result["out"].strip().startswith("[")
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------------ connections

def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, if it closed within `seconds`; None if still open."""
    sock.settimeout(seconds)
    data = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    except socket.timeout:
        return None
    return None


def test_slow_headers_slow_bodies_and_idle_connections_are_cut(server):
    slow_headers, slow_body, idle = _connect(server), _connect(server), _connect(server)
    try:
        t = time.monotonic()
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _closed_within(slow_body, 3)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        assert b"body_timeout" in answer
        health = _closed_within(idle, 4)  # answered, then closed once idle for the keep-alive timeout
        assert health is not None and health.startswith(b"HTTP/1.1 200"), health
        assert _closed_within(slow_headers, 4) is not None  # the keep-alive timer bounds headers too
        assert time.monotonic() - t < 5
    finally:
        for s in (slow_headers, slow_body, idle):
            s.close()


def test_connections_past_the_cap_get_503(server):
    held = []
    try:
        runner = server.runner
        for _ in range(TIMEOUTS.max_connections):
            held.append(_connect(server))
        deadline = time.monotonic() + 5
        while len(runner.server.connections) < TIMEOUTS.max_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        extra = _connect(server)
        answer = _closed_within(extra, 3)
        extra.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while request(server, "GET", "/health")[0] != 200:  # the held ones are gone: served again
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _disconnects(state) -> float:
    text = state.metrics.render().decode()
    found = re.search(r'jserve_requests_total\{route="/v1/completions",status="499"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_stops_reading_is_aborted(server):
    state = server.state
    disconnects = _disconnects(state)
    before = set(server.runner.server.connections)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: a tiny window
    sock.connect(("127.0.0.1", server.port))
    deadline = time.monotonic() + 5
    while not set(server.runner.server.connections) - before:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    (handler,) = set(server.runner.server.connections) - before
    # a slow path to the client: small kernel buffers on both ends (loopback's would hold it all)
    handler.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 96, "n": 4, "logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()  # ~400 KB of events
    state.timeouts = dataclasses.replace(TIMEOUTS, write=0.1)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while state.num_in_flight == 0 and time.monotonic() < deadline:  # admitted
            time.sleep(0.005)
        while state.num_in_flight and time.monotonic() < deadline:  # never read: the write timeout aborts it
            time.sleep(0.01)
        assert state.num_in_flight == 0
        stats = engine_idle(server)
        assert stats["pages_in_use"] == 0 and stats["num_running"] == 0
        assert _disconnects(state) == disconnects + 1  # its handler gave up on the client
        assert _closed_within(sock, 2) is not None  # and dropped the connection
    finally:
        state.timeouts = TIMEOUTS
        sock.close()


# ------------------------------------------------------------------------------ README

def test_readme_curl_examples_work_as_written(server):
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    # (the embeddings block runs against an embedding server: test_embeddings_server.py; the LoRA
    # block against one with adapters: test_lora_server.py)
    commands = [b for b in blocks if "curl" in b and "localhost:8000/v1" in b and "--task embed" not in b
                and "--enable-lora" not in b]
    assert commands, "the README shows no curl example"
    for command in commands:
        done = subprocess.run(["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{server.port}")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert "error" not in answer, answer
        assert answer["model"] == DEFAULT_MODEL_NAMES[0] and answer["choices"], answer


# ------------------------------------------------------------------------------ a dead engine

class Faulty:
    """The shared LLMEngine with a step that can be made to raise or to hang."""

    def __init__(self, engine):  # noqa: F811 - the wrapped LLMEngine
        self._engine = engine
        self.raise_next = False
        self.hang = threading.Event()  # set: the next step blocks until `release` is set
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if self.raise_next:
            raise RuntimeError("injected fault: secret internal detail")
        if self.hang.is_set():
            self.release.wait(30)
        return self._engine.step()


async def _stream_events(url: str, body: dict, started: asyncio.Event) -> list:
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                line = line.strip()
                if line:
                    events.append(json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]")
                    started.set()
    return events


def _fail_mid_batch(engine, trigger, step_timeout: float):  # noqa: F811
    """Three streams and a plain request in flight, then `trigger(faulty)`: what each client
    got, /health, a later request, and what on_fatal heard."""
    faulty = Faulty(engine)
    fatal = []
    state = ServerState(DEFAULT_MODEL_NAMES, step_timeout=step_timeout, tokenizer_workers=0, on_fatal=fatal.append)
    aengine = AsyncLLMEngine(faulty)
    state.attach(aengine)
    srv = Server(state)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}

        async def main():
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(_stream_events(srv.url, body, e)) for e in started]
            async with aiohttp.ClientSession() as session:
                plain = asyncio.ensure_future(session.post(srv.url + "/v1/completions", json=body))
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                trigger(faulty)
                resp = await asyncio.wait_for(plain, 30)
                plain_answer = (resp.status, await resp.json())
            return await asyncio.wait_for(asyncio.gather(*streams), 30), plain_answer

        events, plain = asyncio.run(main())
        deadline = time.monotonic() + 15
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        health = request(srv, "GET", "/health")
        later = request(srv, "POST", "/v1/completions", {"prompt": "hi"})
        return faulty, aengine, events, plain, health, later, fatal
    finally:
        faulty.release.set()
        srv.close()


def _assert_failed_cleanly(events, plain, health, later, fatal, problem):
    for stream in events:
        assert stream[-1] == "[DONE]" and "error" in stream[-2], stream[-3:]
        assert stream[-2]["error"]["type"] == "service_unavailable"
        assert "injected" not in json.dumps(stream) and "secret" not in json.dumps(stream)  # generic text only
    status, answer = plain
    assert_error(status, answer, 503, "engine_unavailable")
    assert "secret" not in answer["error"]["message"]
    assert health[:3:2] == (503, {"status": problem})
    assert_error(later[0], later[2], 503, "engine_unavailable")
    assert fatal == [problem]


def test_an_exception_in_a_step_fails_every_request_cleanly(engine):  # noqa: F811
    _, aengine, *answers = _fail_mid_batch(engine, lambda f: setattr(f, "raise_next", True), 120.0)
    _assert_failed_cleanly(*answers, "engine_dead")
    assert aengine.shutdown(timeout=10)
    stats = engine.stats()
    assert stats["pages_in_use"] == 0 and not engine.has_unfinished_requests()  # every page given back


def test_a_hung_step_trips_the_watchdog(engine):  # noqa: F811
    faulty, aengine, *answers = _fail_mid_batch(engine, lambda f: f.hang.set(), 0.5)
    _assert_failed_cleanly(*answers, "engine_hung")
    faulty.release.set()  # the step returns at last: the thread sees it was failed and ends
    assert aengine.shutdown(timeout=10)
    assert engine.stats()["pages_in_use"] == 0 and not engine.has_unfinished_requests()
