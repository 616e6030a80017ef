"""`EngineConfig` is the one list of engine settings: `LLM(**settings)` and every command's engine
flags come from its fields, with its defaults."""

from __future__ import annotations

import dataclasses

import pytest

from jserve.cli import build_parser, engine_kwargs
from jserve.engine.config import SERVE_DEFAULTS, EngineConfig


def _flagged():
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata["flag"] is not None]


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["plan"]])
def test_every_commands_engine_flags_default_to_the_config(command):
    args = build_parser().parse_args(command)
    kwargs = engine_kwargs(args)
    assert kwargs, command
    for name, value in kwargs.items():  # the server's own defaults are listed in one place
        default = SERVE_DEFAULTS.get(name, getattr(EngineConfig(), name)) if command[0] == "serve" else (
            getattr(EngineConfig(), name))
        assert value == default, (command, name)
    if command[0] == "serve":  # the server takes every flagged setting
        assert set(kwargs) == {f.name for f in _flagged()}


def test_flags_reach_the_settings_by_name():
    args = build_parser().parse_args(["serve", "--max-model-len", "1024", "--kv-cache-bytes", "1GiB",
                                      "--attention-backend", "reference", "--no-enable-prefix-caching",
                                      "--seed", "7", "--kv-cache-dtype", "bfloat16"])
    config = EngineConfig.from_settings(**engine_kwargs(args))
    assert (config.max_model_len, config.kv_cache_bytes, config.backend, config.enable_prefix_caching,
            config.seed, config.kv_cache_dtype) == (1024, 2**30, "reference", False, 7, "bfloat16")
    # plan's older spellings are aliases of the same settings
    args = build_parser().parse_args(["plan", "--context", "4096", "--kv-dtype", "float32", "--kv-budget", "2GiB"])
    assert engine_kwargs(args) | {} == {**engine_kwargs(args), "max_model_len": 4096, "kv_cache_dtype": "float32",
                                        "kv_cache_bytes": 2 * 2**30}
    # generate's --seed seeds the request, not the engine
    args = build_parser().parse_args(["generate", "--prompt", "x", "--seed", "3"])
    assert "seed" not in engine_kwargs(args) and args.seed == 3


@pytest.mark.parametrize("settings,needle", [
    ({"max_num_seq": 4}, "unknown engine setting 'max_num_seq'"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
    ({"page_size": -16}, "page_size must be a positive integer or None, got -16"),
    ({"memory_fraction": 1.5}, r"memory_fraction must be in \(0, 1\], got 1.5"),
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
    ({"backend": "cuda"}, "backend must be one of"),
])
def test_bad_settings_are_named(settings, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_settings(**settings)


def test_llm_names_a_bad_setting_before_loading_anything(tmp_path):
    from jserve.llm import LLM

    with pytest.raises(ValueError, match="unknown engine setting 'max_batch'"):
        LLM(str(tmp_path / "missing"), max_batch=4)


def test_the_backend_names_are_the_backends():
    """`EngineConfig` (pure Python) lists the backend names; `jserve.runtime.backends.create`
    builds them: the two lists must not drift apart."""
    from jserve.engine.config import BACKEND_NAMES
    from jserve.runtime import backends

    assert sorted(BACKEND_NAMES) == sorted(backends.NAMES)
    for name in BACKEND_NAMES:
        assert backends.create(name).name == name


def test_a_backend_refuses_another_backends_option():
    """An option the chosen backend does not take is named, unless it is at its default (the
    Runner passes both)."""
    from jserve.runtime import backends

    assert backends.create("reference", native_matmuls=True).scan is True
    assert backends.create("cpu", scan=True).name == "cpu"
    with pytest.raises(ValueError, match="native_matmuls is an option of the native CPU backend"):
        backends.create("reference", native_matmuls=False)
    with pytest.raises(ValueError, match="scan is an option of the XLA backends"):
        backends.create("cpu", scan=False)
    with pytest.raises(TypeError):
        backends.create("cpu", bogus=1)
