"""The whole step lowers for TPU and GPU on this CPU-only machine: the decode, prefill, mixed
(decode rows and a chunk, the ragged kernel) and speculative verify steps and the sampler of the
default model and of Llama-3.1-8B's shapes, exported with `jax.export` for each platform with the
real Mosaic kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jserve.model.checkpoint import read_model_config
from jserve.model.config import ModelConfig
from jserve.runtime.export import export_steps

ROOT = Path(__file__).parents[1]
LLAMA_8B = ROOT / "tests" / "data" / "configs" / "llama-3.1-8b.json"


def _configs(smollm2_checkpoint):
    return {"smollm2-135m": read_model_config(smollm2_checkpoint)[0],
            "llama-3.1-8b": ModelConfig.from_hf_config(json.loads(LLAMA_8B.read_text()))}


@pytest.mark.parametrize("platform", ["tpu", "cuda"], ids=["for-tpu-vm", "for-cuda"])  # not the `tpu` marker: runs here
def test_every_step_exports_with_the_real_kernels(smollm2_checkpoint, platform):
    for name, config in _configs(smollm2_checkpoint).items():
        steps = [step for step, _ in export_steps(config, platform, batch_buckets=(8, 64), token_buckets=(512,))]
        assert [(s.kind, s.bucket) for s in steps] == [
            ("decode", (8, 1)), ("decode", (64, 1)), ("prefill", (1, 512)), ("mixed", (64, 512)), ("verify", (8, 5)),
            ("sample", (8,)), ("sample", (64,))], name
        for s in steps:
            # the scanned layer stack: one kernel call whatever the depth; the sampler has none
            assert s.kernel_calls == (0 if s.kind == "sample" else 1), (name, s)
            assert s.serialized_bytes > 10_000, (name, s)


def test_an_exported_step_keeps_its_shapes(smollm2_checkpoint):
    config = _configs(smollm2_checkpoint)["llama-3.1-8b"]
    step, exported = next(export_steps(config, "tpu", batch_buckets=(64,), token_buckets=()))
    logits, kv = exported.out_avals[0], exported.out_avals[1:]
    assert step.kind == "decode" and logits.shape == (64, 128256) and exported.platforms == ("tpu",)
    assert kv[0].shape == (8, 32 * 1024, 16, 128)  # folded pages: [kv heads, layers * pages, page, head_dim]


def test_jserve_export(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jserve.cli", "export", "--platform", "cuda",
                           "--model", str(LLAMA_8B), "--load-format", "dummy", "--batch-buckets", "16",
                           "--token-buckets", "256"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "exported 5 steps for cuda"
    assert lines[0].split()[:2] == ["decode", "16x1"]
