"""Operating the server: timestamped or JSON logs, the periodic stats line, /version, and one-line
errors for a port in use and a memory plan without room."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket

import pytest
from aiohttp.test_utils import TestClient, TestServer

import jserve
from jserve import cli
from jserve.server import logs
from jserve.server.app import ServerState, build_app


def test_json_logs_are_one_object_a_line(capsys):
    logs.configure("info", "json")
    try:
        logging.getLogger("jserve.test").info("hello %s", "world")
        logging.getLogger("jserve.test").debug("not at info")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        entry = json.loads(lines[0])
        assert (entry["level"], entry["logger"], entry["message"]) == ("INFO", "jserve.test", "hello world")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
        logs.configure("warning", "text")
        logging.getLogger("jserve.test").warning("plain")
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING jserve.test: plain",
                            capsys.readouterr().err.strip())
    finally:
        logging.basicConfig(level=logging.WARNING, force=True)
    with pytest.raises(ValueError, match="log level must be one of"):
        logs.configure("verbose")


def test_the_stats_line_reports_each_interval():
    state = {"computed_tokens": 0, "num_running": 0, "num_waiting": 0, "pages_in_use": 0, "num_pages": 100,
             "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0, "num_preemptions": 0}
    finished = [0]

    async def stats():
        return dict(state)

    async def run():
        line = logs.StatsLine(stats, lambda: finished[0])
        assert await line.line() is None  # the first call starts the interval
        assert await line.line() is None  # nothing ran
        state.update(computed_tokens=500, num_running=3, num_waiting=1, pages_in_use=25,
                     prefix_cache_hit_tokens=30, prefix_cache_query_tokens=120, num_preemptions=2)
        finished[0] = 4
        return await line.line()

    text = asyncio.run(run())
    assert re.fullmatch(r"[\d.]+ tokens/s computed, 4 requests finished; running 3, waiting 1; KV cache 25.0 % "
                        r"used; prefix cache hit rate 25.0 %; 2 preemptions", text), text


def test_version_is_open():
    async def run():
        async with TestClient(TestServer(build_app(ServerState("tiny", api_keys=("k",))))) as client:
            resp = await client.get("/version")
            assert resp.status == 200
            return await resp.json()

    assert asyncio.run(run()) == {"version": jserve.__version__}


def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--disable-log-stats"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"jserve: error: port {port} on 127.0.0.1 is in use (another server?): stop it or pass --port"
    logging.basicConfig(level=logging.WARNING, force=True)


def test_no_room_for_pages_names_the_flags():
    from jserve.model.config import ModelConfig
    from jserve.runtime.kv_cache import plan_memory

    config = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError) as e:
        plan_memory(config, weight_dtype_bytes=4, device_bytes=2**20, memory_fraction=0.5)
    for flag in ("--memory-fraction", "--kv-cache-bytes", "--max-num-batched-tokens", "--kv-cache-dtype",
                 "--quantization", "--mesh tp=N"):
        assert flag in str(e.value)
