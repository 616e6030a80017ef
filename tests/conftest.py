"""Shared fixtures: the persistent compilation cache, the real model's checkpoint, markers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def pytest_configure(config):
    # Eight CPU devices for the sharding tests (tests/test_sharding.py); every other test runs on
    # device 0 as before. Must be set before JAX creates its CPU client.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    # One persistent compilation cache for the whole run (and across runs on the same machine):
    # engines built by different tests compile the same shapes.
    os.environ.setdefault("JSERVE_COMPILATION_CACHE", str(Path.home() / ".cache" / "jserve" / "jax-tests"))
    from jserve.llm import enable_compilation_cache

    enable_compilation_cache()


def pytest_collection_modifyitems(config, items):
    import jax

    platforms = {d.platform for d in jax.devices()}
    for item in items:
        if "tpu" in item.keywords and "tpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))
        if "gpu" in item.keywords and "gpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="session")
def golden():
    return json.loads((DATA / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> Path:
    """The default model converted once per session (reused from checkpoints/ when present)."""
    from jserve.checkpoint import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_checkpoint):
    from jserve import LLM

    return LLM(str(smollm2_checkpoint), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
