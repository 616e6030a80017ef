"""Two processes joined with `jax.distributed` (gloo CPU collectives, one CPU device each) run
one engine: process 0 schedules and serves, process 1 follows its steps. Same tokens as one
process, for `jserve generate` and for a request stream through `jserve serve`.

The model is tiny (2 layers, SmolLM2's 9/3 heads, so tp=2 pads heads) with SmolLM2's tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port, wait_healthy

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
           "The best thing about", "In 1969, astronauts"]
ENGINE_FLAGS = ["--max-model-len", "256", "--kv-cache-bytes", "4MiB", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_checkpoint, tmp_path_factory) -> Path:
    from jserve.model.checkpoint import save_params
    from jserve.model.config import ModelConfig
    from jserve.model.llama import param_shapes

    out = tmp_path_factory.mktemp("tiny") / "tiny-smollm2"
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    params = {k: (np.ones(s) if k.endswith("norm") else rng.standard_normal(s) * 0.1).astype(np.float32)
              for k, s in param_shapes(config).items()}
    out.mkdir(parents=True)
    save_params(out / "params", params)
    (out / "config.json").write_text(config.to_json())
    for name in ("tokenizer.json", "jserve_tokenizer.json"):
        shutil.copy(smollm2_checkpoint / name, out / name)
    generation = json.loads((smollm2_checkpoint / "generation.json").read_text())
    (out / "generation.json").write_text(json.dumps({**generation, "dtype": "float32"}))
    return out


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return env


def _jserve(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jserve.cli", *args], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _distributed(port: int, pid: int) -> list[str]:
    return ["--distributed", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
            "--process-id", str(pid)]


def test_generate_on_two_processes_matches_one(tiny_checkpoint):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", PROMPTS[0], "--max-tokens", "12",
            "--ignore-eos", "--json", *ENGINE_FLAGS]
    single = _jserve(*args)
    out, err = single.communicate(timeout=300)
    assert single.returncode == 0, err
    expected = json.loads(out)
    port = free_port()
    follower = _jserve("-v", *args, *_distributed(port, 1))  # -v: its INFO line below
    leader = _jserve(*args, *_distributed(port, 0))
    out, err = leader.communicate(timeout=300)
    assert leader.returncode == 0, err
    f_out, f_err = follower.communicate(timeout=60)
    assert follower.returncode == 0, f_err
    # (gloo prints a connection line on stdout; the JSON is the last line)
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == expected["token_ids"]
    assert len(expected["token_ids"]) == 12
    # The follower ran the steps and printed no result of its own.
    assert "stopped the run after" in f_err
    assert not [line for line in f_out.splitlines() if not line.startswith("[Gloo]")]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_server_on_two_processes_serves_a_request_stream(tiny_checkpoint):
    from jserve import LLM
    from jserve.core.request import SamplingParams

    llm = LLM(str(tiny_checkpoint), max_model_len=256, kv_cache_bytes=4 << 20, max_num_seqs=4,
              max_num_batched_tokens=32, warmup=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    assert len(set(expected)) > 1

    coord, http = free_port(), free_port()
    serve = ["serve", "--model", str(tiny_checkpoint), "--port", str(http), *ENGINE_FLAGS]
    follower = _jserve(*serve, *_distributed(coord, 1))
    leader = _jserve(*serve, *_distributed(coord, 0))
    try:
        wait_healthy(f"http://127.0.0.1:{http}", [leader, follower], 300)
        body = dict(model="tiny-smollm2", max_tokens=8, temperature=0.0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched steps
            got = list(pool.map(lambda p: _post(http, {**body, "prompt": p})["choices"][0]["text"], PROMPTS))
        assert got == expected
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) == 0  # released by the leader's stop broadcast
        assert "stopped the run after" in follower.stderr.read()
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
