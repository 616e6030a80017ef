"""`jserve serve` as a process: a tiny engine behind the real CLI, driven over HTTP and signals.

The engine is the tiny random SmolLM2-shaped model (tests/data/arch/smollm2) beside the real
SmolLM2 tokenizer, prompted with token ids and built without warm-up: its shapes come from the
persistent compilation cache the suite shares.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import aiohttp

from conftest import DATA, free_port, wait_healthy


_SERVE = '''
import sys
import jax.numpy as jnp
import jserve.cli
import jserve.server.cli as cli
from jserve.checkpoint import read_params
from jserve.engine import EngineConfig, build_engine
from jserve.llm import enable_compilation_cache
from jserve.tokenizer import Tokenizer

enable_compilation_cache()  # the test run's cache (JSERVE_COMPILATION_CACHE is inherited)


class Tiny:
    def __init__(self, args):
        config, params = read_params(sys.argv[1])
        # test_async_engine's knobs: the shapes come from the persistent compilation cache
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, page_size=4, num_pages=400,
                           backend="cpu", warmup=False)
        self.engine = build_engine(config, {k: jnp.asarray(v) for k, v in params.items()},
                                   Tokenizer.load(sys.argv[2]), [], cfg)


cli._load = Tiny
sys.exit(jserve.cli.main(["serve", "--port", sys.argv[3], "--served-model-name", "tiny", "--grace-period", "30"]))
'''


def test_sigterm_drains_and_exits_zero(smollm2_checkpoint):
    """`jserve serve` in a subprocess (a tiny engine, no warm-up): SIGTERM -> 503, the stream in flight
    finishes, exit status 0."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(DATA / "arch" / "smollm2"), str(smollm2_checkpoint),
                             str(port)], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], 60)

        async def stream_and_terminate():
            async with aiohttp.ClientSession() as session:
                # Long enough that the drain outlasts the 0.3 s below (30 tokens once took longer
                # than that; with the native decode kernel the tiny model drained them sooner).
                body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 600, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    lines = [await resp.content.readline()]
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.3)
                    async with session.get(url + "/health") as health:
                        assert health.status == 503
                    lines += [line async for line in resp.content]
            return [json.loads(x[6:]) for x in lines if x.strip() and x.strip() != b"data: [DONE]"], lines

        chunks, lines = asyncio.run(stream_and_terminate())
        assert lines[-2].strip() == b"data: [DONE]"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 600  # finished within the grace period
        assert proc.wait(60) == 0
        # The loaded engine's objects were frozen out of the garbage collector (freeze_startup_heap).
        frozen = re.search(r"\((\d+) startup objects frozen", proc.stderr.read())
        assert frozen and int(frozen.group(1)) > 10_000, frozen
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
