"""`jserve serve` as a process: a tiny engine behind the real CLI, driven over HTTP and signals.

The engine is the tiny random SmolLM2-shaped model (tests/data/arch/smollm2) beside the real
SmolLM2 tokenizer, prompted with token ids and built without warm-up: its shapes come from the
persistent compilation cache the suite shares. $FAIL_AT_STEP makes its step raise there (a
fault injected mid-batch).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import aiohttp

from conftest import DATA, free_port, wait_healthy

_SERVE = '''
import dataclasses
import os
import sys
import jax.numpy as jnp
import jserve.cli
import jserve.server.cli as cli
from jserve.model.checkpoint import read_params
from jserve.engine import EngineConfig, build_engine
from jserve.llm import enable_compilation_cache
from jserve.text.tokenizer import Tokenizer

enable_compilation_cache()  # the test run's cache (JSERVE_COMPILATION_CACHE is inherited)


class Tiny:
    def __init__(self, args):
        config, params = read_params(sys.argv[1])
        # Streams of 800 tokens: past the tiny model's 256 positions (rotary extrapolates).
        config = dataclasses.replace(config, max_position_embeddings=2048)
        # test_async_engine's knobs: the shapes come from the persistent compilation cache
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, page_size=4, num_pages=400,
                           backend="cpu", warmup=False)
        self.engine = engine = build_engine(config, {k: jnp.asarray(v) for k, v in params.items()},
                                            Tokenizer.load(sys.argv[2]), [], cfg)
        fail_at, step = int(os.environ.get("FAIL_AT_STEP", 0)), engine.step

        def faulty_step():
            if fail_at and engine.num_steps >= fail_at:
                raise RuntimeError("injected fault")
            return step()

        engine.step = faulty_step


cli._load = Tiny
sys.exit(jserve.cli.main(["serve", "--port", sys.argv[3], "--served-model-name", "tiny", *sys.argv[4:]]))
'''


def _start(checkpoint, *args: str, **env: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(DATA / "arch" / "smollm2"), str(checkpoint), str(port),
                             *args], env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, [proc], 60)
    return proc, url


async def _stream(session, url: str, body: dict, first: asyncio.Event | None = None) -> list:
    """The events of one streamed completion ("[DONE]" for the end marker)."""
    events = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.strip():
                events.append("[DONE]" if line.strip() == b"data: [DONE]" else json.loads(line[6:]))
                if first is not None:
                    first.set()
    return events


def test_sigterm_under_load_drains_and_exits_zero(smollm2_checkpoint):
    """SIGTERM with three streams and a plain request in flight: /health and new requests get
    503, every in-flight request finishes within the grace period, exit status 0."""
    proc, url = _start(smollm2_checkpoint, "--grace-period", "30")
    try:
        async def load_and_terminate():
            async with aiohttp.ClientSession() as session:
                # Long enough that the drain outlasts the 0.3 s below (150 tokens did not, once: the
                # tiny model's steps take 1-5 ms).
                body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 800, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                firsts = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.ensure_future(_stream(session, url, body, e)) for e in firsts]
                plain = asyncio.ensure_future(session.post(url + "/v1/completions", json={**body, "max_tokens": 400}))
                await asyncio.gather(*(e.wait() for e in firsts))
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with session.get(url + "/health") as health:
                    assert health.status == 503 and (await health.json())["status"] == "shutting_down"
                async with session.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}) as late:
                    assert late.status == 503 and (await late.json())["error"]["code"] == "shutting_down"
                resp = await plain
                return await asyncio.gather(*streams), (resp.status, await resp.json())

        streams, (status, plain) = asyncio.run(load_and_terminate())
        for events in streams:
            assert events[-1] == "[DONE]"
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 800  # finished within the grace period
        assert status == 200 and plain["usage"]["completion_tokens"] == 400
        assert proc.wait(60) == 0
        # The loaded engine's objects were frozen out of the garbage collector (freeze_startup_heap).
        log = proc.stderr.read()
        frozen = re.search(r"; (\d+) startup objects frozen", log)
        assert frozen and int(frozen.group(1)) > 10_000, frozen
        # the engine's own modes: this loader's EngineConfig has async scheduling off, single steps
        assert "(async scheduling off; decode steps a call: 1;" in log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_fault_mid_batch_ends_requests_cleanly_and_exits_one(smollm2_checkpoint):
    """The step raises while two streams run: each ends with a generic error event and [DONE],
    the pages are all given back, and the process exits 1 (for its supervisor to restart it)."""
    proc, url = _start(smollm2_checkpoint, FAIL_AT_STEP="30")
    try:
        async def run():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": [5, 6, 7], "max_tokens": 600, "ignore_eos": True}
                return await asyncio.gather(*(_stream(session, url, body) for _ in range(2)))

        for events in asyncio.run(run()):
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable", events[-3:]
            assert "injected" not in json.dumps(events)
        assert proc.wait(30) == 1
        log = proc.stderr.read()
        assert "injected fault" in log  # the cause is logged
        assert re.search(r"requests left in flight: 0, pages in use: 0", log), log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_vllm_serve_command_line_runs_unchanged(smollm2_checkpoint):
    """A typical `vllm serve` line (test_vllm_args.VLLM_LINE, its served name `llama` last; its host
    and port are the test's)
    starts the server: timestamped INFO lines, each no-op flag logged once, and a request with
    the line's API key answered; then the periodic stats line."""
    from test_vllm_args import VLLM_LINE

    line = shlex.split(VLLM_LINE)
    for flag in ("--host", "--port"):
        i = line.index(flag)
        del line[i:i + 2]
    proc, url = _start(smollm2_checkpoint, *line, "--log-stats-interval", "0.5", "--enable-log-requests")
    try:
        async def chat():
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-test"}) as session:
                body = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
                async with session.post(url + "/v1/completions", json=body,
                                        headers={"X-Request-Id": "trace-42"}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-request-id"] == "trace-42"  # the client's id is kept
                    result = await resp.json()
                    assert result["id"] == "cmpl-trace-42"
                async with session.post(url + "/v1/completions", json=body,
                                        headers={"X-Request-Id": "x" * 129}) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "X-Request-Id"
                await asyncio.sleep(1.2)  # two stats intervals
                async with session.get(url + "/version") as version:
                    assert version.status == 200
                return result

        assert asyncio.run(chat())["usage"]["completion_tokens"] == 40
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO jserve.server.cli: ready: serving llama", log,
                         re.M), log
        assert log.count("--trust-remote-code: accepted, no effect") == 1, log
        assert re.search(r"INFO jserve.stats: [\d.]+ tokens/s computed, 1 requests finished", log), log
        assert "request trace-42: /v1/completions, 1 prompt(s) of 3 tokens" in log, log
        assert "request trace-42 done: length after 40 tokens" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
