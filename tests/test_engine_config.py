"""`EngineConfig` is the one list of engine settings: `LLM(**settings)` and every command's engine
flags come from its fields, with its defaults."""

from __future__ import annotations

import dataclasses

import pytest

from jserve.cli import build_parser, engine_kwargs
from jserve.engine.config import SERVE_DEFAULTS, EngineConfig, platform_defaults


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
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer or None, got 0"),
    ({"num_scheduler_steps": 0}, "num_scheduler_steps must be an integer >= 1 or None, got 0"),
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
    from jserve.engine.config import BACKEND_ALIASES, BACKEND_NAMES
    from jserve.runtime import backends

    assert sorted(BACKEND_NAMES) == sorted(backends.NAMES)
    assert sorted(BACKEND_ALIASES) == sorted(backends.ALIASES)
    for name in BACKEND_NAMES:
        assert backends.create(name).name == name
    # The older names pick their backend, with the attention kernel they name.
    for alias, (name, kernel) in {"cpu": ("native", "cpu"), "cpu_pallas": ("xla", "cpu_pallas"),
                                  "reference": ("xla-reference", "reference"), "tpu": ("xla", "tpu"),
                                  "gpu": ("xla", "gpu")}.items():
        backend = backends.create(alias)
        assert (backend.name, backend.kernel) == (name, kernel), alias
    assert backends.create("xla").kernel == "cpu_pallas"  # this CPU's Pallas kernel: the interpreter
    assert backends.canonical_name(None) == "native"  # on a CPU
    with pytest.raises(ValueError, match="backend must be one of .*got 'cuda'"):
        backends.canonical_name("cuda")


def test_backend_flag_and_its_older_spelling(caplog):
    args = build_parser().parse_args(["serve", "--backend", "xla-reference"])
    assert engine_kwargs(args)["backend"] == "xla-reference"
    with caplog.at_level("WARNING", logger="jserve"):
        args = build_parser().parse_args(["serve", "--attention-backend", "cpu_pallas"])
    assert engine_kwargs(args)["backend"] == "cpu_pallas"
    assert "--attention-backend is deprecated: use --backend" in caplog.text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend", "cuda"])


@pytest.mark.parametrize("platform,kind,memory,expected", [
    ("cpu", "cpu", None, (16, 512)),
    ("tpu", "TPU v6 lite", 32 * 2**30, (256, 1024)),
    ("tpu", "TPU v5 lite", 16 * 2**30, (256, 512)),
    ("gpu", "NVIDIA H200", 104 * 2**30, (1024, 8192)),
    ("gpu", "NVIDIA H100 80GB HBM3", 60 * 2**30, (1024, 8192)),  # JAX's allocator takes 75 % by default
    ("gpu", "NVIDIA A100-SXM4-80GB", 80 * 2**30, (256, 2048)),
    ("gpu", "NVIDIA L4", 22 * 2**30, (256, 2048)),
])
def test_batch_defaults_follow_the_device(platform, kind, memory, expected):
    assert platform_defaults(platform, kind, memory) == expected
    config = EngineConfig().with_platform_defaults(platform, kind, memory)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == expected
    # What is given stays; the seqs never exceed the tokens; a native backend is a CPU's.
    given = EngineConfig(max_num_batched_tokens=8).with_platform_defaults(platform, kind, memory)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 8)
    assert EngineConfig(max_num_seqs=3).with_platform_defaults(platform, kind, memory).max_num_seqs == 3
    native = EngineConfig(backend="native").with_platform_defaults(platform, kind, memory)
    assert (native.max_num_seqs, native.max_num_batched_tokens) == (16, 512)


def test_unsettled_batch_settings_are_not_scheduled():
    with pytest.raises(ValueError, match="settled first"):
        EngineConfig().scheduler_config()
    with pytest.raises(ValueError, match="num_scheduler_steps are settled first"):
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=None).scheduler_config()


@pytest.mark.parametrize("settings,platform,steps", [
    ({}, "cpu", 2),
    ({}, "tpu", 1),
    ({}, "gpu", 1),
    ({"backend": "native"}, "tpu", 2),  # a native backend is a CPU's
    ({"async_scheduling": True}, "cpu", 1),
    ({"async_scheduling": False}, "cpu", 2),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "cpu", 1),
    ({"mesh": "tp=2"}, "cpu", 1),
    ({"batch_invariant": True}, "cpu", 1),
])
def test_unset_decode_steps_are_two_on_a_cpu_alone(settings, platform, steps):
    """num_scheduler_steps None (`jserve serve`'s default): two decode steps a call on a CPU, where
    async scheduling, speculation and batch invariance are not asked and there is no mesh; one
    elsewhere."""
    config = EngineConfig(num_scheduler_steps=None, **settings).with_platform_defaults(platform)
    assert config.num_scheduler_steps == steps
    # a given count stays, the batch settings given or not
    for given in (1, 4):
        for batch in ({}, {"max_num_seqs": 4, "max_num_batched_tokens": 64}):
            config = EngineConfig(num_scheduler_steps=given, **batch).with_platform_defaults(platform)
            assert config.num_scheduler_steps == given
    assert EngineConfig(num_scheduler_steps=None, max_num_seqs=4, max_num_batched_tokens=64).with_platform_defaults(
        "cpu").num_scheduler_steps == 2


def test_a_backend_refuses_another_backends_option():
    """An option the chosen backend does not take is named, unless it is at its default (the
    Runner passes both)."""
    from jserve.runtime import backends

    assert backends.create("reference", native_matmuls=True).scan is True
    assert backends.create("cpu", scan=True).name == "native"
    with pytest.raises(ValueError, match="native_matmuls is an option of the native CPU backend"):
        backends.create("reference", native_matmuls=False)
    with pytest.raises(ValueError, match="scan is an option of the XLA backends"):
        backends.create("cpu", scan=False)
    with pytest.raises(TypeError):
        backends.create("cpu", bogus=1)
