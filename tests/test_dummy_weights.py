"""`load_format="dummy"` (`--load-format dummy`): random weights of any config's shapes, served
like real ones (shapes, dtypes and norms checked; generation, compilations, the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jserve.engine.config import EngineConfig
from jserve.model.checkpoint import read_model_config
from jserve.model.dummy import dummy_params
from jserve.model.llama import param_shapes

ARCH = Path(__file__).parent / "data" / "arch"


@pytest.mark.parametrize("arch", sorted(p.name for p in ARCH.iterdir() if (p / "config.json").is_file()))
def test_dummy_params_have_the_configs_shapes(arch):
    config, _ = read_model_config(ARCH / arch)
    params = dummy_params(config, "bfloat16", seed=1)
    assert {k: tuple(v.shape) for k, v in params.items()} == param_shapes(config)
    for name, value in params.items():
        assert str(value.dtype) == "bfloat16", name
        x = np.asarray(value, np.float32)
        if name.endswith("norm"):  # a scale of 1: Gemma's norms scale by (1 + weight)
            assert (x == 1 - config.norm_offset).all(), name
        else:
            assert abs(x.std() - 0.02) < 0.005 and abs(x.mean()) < 0.005, (name, x.std(), x.mean())
    again = dummy_params(config, "bfloat16", seed=1)
    assert all(np.array_equal(np.asarray(params[k], np.float32), np.asarray(again[k], np.float32)) for k in params)


def test_a_dummy_model_serves_without_its_weights(tmp_path):
    """A folder with only config.json (a bigger Qwen3-shaped one) is enough."""
    from jserve import LLM, SamplingParams

    cfg = json.loads((ARCH / "qwen3" / "config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=3, eos_token_id=7)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32)
    assert llm.config.num_layers == 3 and llm.config.hidden_size == 128
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert llm.engine.stats()["compilations_after_warmup"] == 0
    assert llm.engine.eos_token_ids == {7}
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the default tokenizer's ids
        llm.generate("a long word: antidisestablishmentarianism", SamplingParams(max_tokens=1))


def test_dummy_settings_are_checked():
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")
    with pytest.raises(ValueError, match="no quantization"):
        EngineConfig(load_format="dummy", quantization="int8")
    with pytest.raises(ValueError, match="dtype"):
        dummy_params(read_model_config(ARCH / "llama3")[0], "float16")


def test_cli_generate_with_dummy_weights(capsys):
    from jserve import cli

    rc = cli.main(["generate", "--model", str(ARCH / "llama3"), "--load-format", "dummy", "--prompt", "a",
                   "--max-tokens", "4", "--max-model-len", "64", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4


def test_step_floor_script_on_a_config_only_model(tmp_path):
    """benchmarks.step.floor (the device check's `step` part) on dummy weights of a bare
    config.json: a row per (batch, context), the pages that do not fit reported as such."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    out = tmp_path / "floor.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.step.floor", "--model",
                           str(ARCH / "qwen3" / "config.json"), "--load-format", "dummy", "--batches", "1,2",
                           "--contexts", "32,120", "--reps", "2", "--kv-bytes", "64KiB", "--copy-bytes", "8MiB",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (2, 32), (1, 120), (2, 120)]
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["step_ms"] > 0 and r["floor_bytes"] > 0 for r in fitting)
    assert not all(r["fits"] for r in rows)  # 64 KiB of pages cannot hold two rows of 120 tokens
