"""vLLM's command line on `jserve serve`: aliases reach jserve's settings, parallel sizes become the
mesh, no-ops are logged once, and what jserve cannot honour is an error naming it."""

from __future__ import annotations

import logging
import shlex

import pytest

from jserve.cli import build_parser, engine_kwargs
from jserve.engine.config import EngineConfig
from jserve.vllm_args import NO_OPS, apply_vllm_args

# A typical `vllm serve` line from a deployment guide, the model aside.
VLLM_LINE = ("--host 0.0.0.0 --port 8000 --served-model-name llama --dtype bfloat16 --max-model-len 4096 "
             "--tensor-parallel-size 1 --gpu-memory-utilization 0.85 --max-num-seqs 64 "
             "--max-num-batched-tokens 2048 --enable-prefix-caching --enable-chunked-prefill --block-size 16 "
             "--kv-cache-dtype auto --swap-space 4 --seed 0 --trust-remote-code --enable-auto-tool-choice "
             "--tool-call-parser hermes --disable-log-requests --api-key sk-test "
             "--distributed-executor-backend mp --uvicorn-log-level info")


def _parse(line: str):
    args = build_parser().parse_args(["serve", *shlex.split(line)])
    apply_vllm_args(args)
    return args


def test_a_vllm_serve_line_sets_jserve_settings(caplog):
    with caplog.at_level(logging.INFO, logger="jserve"):
        args = _parse(VLLM_LINE)
    config = EngineConfig.from_settings(**engine_kwargs(args))
    assert (config.memory_fraction, config.page_size, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len, config.kv_cache_dtype, config.mesh) == (0.85, 16, 64, 2048, 4096, "auto", None)
    assert (args.host, args.port, args.api_key, args.tool_call_parser) == ("0.0.0.0", 8000, ["sk-test"], "hermes")
    for flag in ("--enable-chunked-prefill", "--trust-remote-code", "--enable-auto-tool-choice",
                 "--disable-log-requests", "--swap-space", "--distributed-executor-backend", "--uvicorn-log-level"):
        assert caplog.text.count(f"{flag}: accepted, no effect: {NO_OPS[flag]}") == 1, flag


@pytest.mark.parametrize("line,mesh", [
    ("-tp 4", "tp=4"),
    ("-tp 2 -dp 2", "dp=2,tp=2"),
    ("--tensor-parallel-size 4 --enable-expert-parallel", "ep=4"),
    ("-tp 1 -dp 1", None),
    ("--mesh tp=2", "tp=2"),
    ("--kv-cache-memory-bytes 2GiB", None),
])
def test_parallel_sizes_become_the_mesh(line, mesh):
    args = _parse(line)
    assert args.mesh == mesh
    if "kv-cache-memory" in line:
        assert engine_kwargs(args)["kv_cache_bytes"] == 2 * 2**30


@pytest.mark.parametrize("line,needle", [
    ("-pp 2", "--pipeline-parallel-size 2: jserve has no pipeline parallelism"),
    ("-tp 2 --mesh tp=2", "give --mesh or -tp"),
    ("-tp 0", "the tp size must be >= 1, got 0"),
    ("--generation-config /no/such/folder", "--generation-config /no/such/folder: give 'auto', 'vllm' or a folder"),
])
def test_what_jserve_cannot_honour_is_named(line, needle):
    with pytest.raises(ValueError, match=needle):
        _parse(line)


def test_an_unknown_flag_is_still_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-such-vllm-flag"])
