"""Models by Hugging Face Hub id (`jserve.model.hub`), offline: a Hub cache laid out on disk
(`models--org--name/snapshots/<commit>/`, `refs/<name>` holding the commit) under HF_HUB_OFFLINE,
with tests/data/arch/llama3 (a tiny Llama 3 with transformers' greedy reference) as the model and
a word-level tokenizer of its 256 ids. Resolving converts once into the checkpoint root, keyed by
commit, dtype and quantization; the errors are one line naming the id and what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx2
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import DATA
from jserve.model import checkpoint, hub
from jserve.model.model_args import add_model_args, model_source

MAIN = "a" * 40
OTHER = "b" * 40
REPO = "jserve-test/tiny-llama3"


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))


def lay_out(cache: Path, repo: str, commit: str, *, refs=("main",), config: dict | None = None,
            scale: float = 1.0, weights: bool = True, extra: dict | None = None) -> Path:
    """One snapshot of `repo` in a Hub cache at `cache`: the tiny model (its weights times `scale`),
    `config` merged into its config.json, `extra` files (name -> bytes) beside them."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    src = DATA / "arch" / "llama3"
    (snapshot / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                       **(config or {})}))
    if weights:
        save_file({k: v * np.float32(scale) for k, v in load_file(src / "model.safetensors").items()},
                  snapshot / "model.safetensors")
    _tokenizer(snapshot)
    for name, data in (extra or {}).items():
        (snapshot / name).write_bytes(data)
    for ref in refs:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty Hub cache as the default one, offline; converted models under tmp_path/ckpt."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (huggingface_hub reads both at its import: patched too)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("JSERVE_CHECKPOINTS", str(tmp_path / "ckpt"))
    return cache


def test_snapshot_download_resolves_a_laid_out_cache_offline(offline):
    """What the tests below stand on: the installed huggingface_hub finds refs + snapshots offline."""
    from huggingface_hub import snapshot_download

    lay_out(offline, REPO, MAIN)
    lay_out(offline, REPO, OTHER, refs=("v2",))
    assert Path(snapshot_download(REPO, allow_patterns=["config.json"])).name == MAIN
    assert Path(snapshot_download(REPO, revision="v2")).name == OTHER
    assert Path(snapshot_download(REPO, revision=OTHER)).name == OTHER


def test_a_hub_id_converts_once_and_revision_picks_its_snapshot(offline, tmp_path, monkeypatch):
    lay_out(offline, REPO, MAIN)
    lay_out(offline, REPO, OTHER, refs=("v2",), scale=2.0)
    converts = []
    real = checkpoint.convert
    monkeypatch.setattr(checkpoint, "convert", lambda *a, **kw: converts.append(a) or real(*a, **kw))
    path = checkpoint.resolve_model(REPO, dtype="auto")
    assert path == tmp_path / "ckpt" / "hub" / "jserve-test--tiny-llama3" / MAIN / "float32"
    _, params, generation = checkpoint.load_checkpoint(path)
    reference = load_file(DATA / "arch" / "llama3" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), reference["model.norm.weight"])
    assert generation["source_dtype"] == "float32" and MAIN in generation["source"]
    assert checkpoint.resolve_model(REPO, dtype="auto") == path and len(converts) == 1  # reused
    # another revision (a ref or its commit) is another snapshot and another conversion
    other = checkpoint.resolve_model(REPO, dtype="auto", revision="v2")
    assert other == path.parents[1] / OTHER / "float32" and len(converts) == 2
    assert checkpoint.resolve_model(REPO, dtype="auto", revision=OTHER) == other and len(converts) == 2
    np.testing.assert_array_equal(np.asarray(checkpoint.load_checkpoint(other)[1]["final_norm"]),
                                  2 * reference["model.norm.weight"])
    # the dtype is in the key: bfloat16 asked for is its own conversion
    assert checkpoint.resolve_model(REPO, dtype="bfloat16") == path.parent / "bfloat16" and len(converts) == 3
    # converted: its weights are not needed again (the Hugging Face cache may be cleared)
    (offline / "models--jserve-test--tiny-llama3" / "snapshots" / MAIN / "model.safetensors").unlink()
    assert checkpoint.resolve_model(REPO, dtype="auto") == path and len(converts) == 3
    assert checkpoint.resolve_model(REPO, dtype="half") == path.parent / "bfloat16" and len(converts) == 3


def test_the_dtype_it_is_served_in_keys_the_conversion(offline, monkeypatch):
    """A float32 repo on an accelerator is converted in bfloat16 (auto) and said once."""
    lay_out(offline, REPO, MAIN)
    monkeypatch.setattr(checkpoint, "current_platform", lambda: "tpu")
    path = checkpoint.resolve_model(REPO, dtype="auto")
    assert path.name == "bfloat16"
    assert json.loads((path / "generation.json").read_text())["dtype"] == "bfloat16"
    assert checkpoint.served_dtype(path, "auto") == "bfloat16"
    assert checkpoint.served_dtype(path, "float32") == "float32"


def test_a_gguf_file_of_a_repo(offline, monkeypatch):
    """`org/name:file.gguf` (or gguf_file=) fetches that file alone; the file is in the key."""
    from test_dtype import _gguf

    snapshot = lay_out(offline, "jserve-test/tiny-GGUF", MAIN, weights=False)
    _gguf(snapshot / "tiny-Q8_0.gguf", 7)
    seen = []

    def fake_convert(source, out, **kw):
        seen.append((Path(source), kw))
        (out / "params").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "generation.json").write_text(json.dumps({"format_version": checkpoint.FORMAT_VERSION}))
        return out

    monkeypatch.setattr(checkpoint, "convert", fake_convert)
    path = checkpoint.resolve_model("jserve-test/tiny-GGUF:tiny-Q8_0.gguf", dtype="auto", keep_quantized=True)
    assert path.parts[-3:] == ("jserve-test--tiny-GGUF", MAIN, "tiny-Q8_0-float32-gguf")
    assert seen == [(snapshot / "tiny-Q8_0.gguf", {"dtype": "float32", "keep_quantized": True})]
    assert checkpoint.resolve_model("jserve-test/tiny-GGUF", gguf_file="tiny-Q8_0.gguf", dtype="auto",
                                    keep_quantized=True) == path
    with pytest.raises(ValueError, match=r"^jserve-test/tiny-GGUF \(commit a+\) has no file 'other.gguf'"):
        checkpoint.resolve_model("jserve-test/tiny-GGUF:other.gguf")
    with pytest.raises(ValueError, match="needs a .gguf file: name one"):
        checkpoint.resolve_model("jserve-test/tiny-GGUF", keep_quantized=True)
    with pytest.raises(ValueError, match="names the GGUF file 'a.gguf' but gguf_file is 'b.gguf'"):
        checkpoint.resolve_model("jserve-test/tiny-GGUF:a.gguf", gguf_file="b.gguf")


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and excinfo.value.__cause__ is None
    return message


def test_errors_are_one_line_naming_the_id_and_what_to_do(offline, tmp_path, monkeypatch):
    for check in (checkpoint.resolve_model, checkpoint.check_model):  # (check_model: before a port opens)
        with pytest.raises(ValueError) as e:
            check("jserve-test/missing")
        assert _one_line(e) == (f"HF_HUB_OFFLINE is set and jserve-test/missing is not in the cache {offline}; "
                                f"run once online or pass a folder")
    lay_out(offline, REPO, MAIN)
    with pytest.raises(ValueError, match=f"^HF_HUB_OFFLINE is set and {REPO} at revision 'v9' is not in the cache"):
        checkpoint.resolve_model(REPO, revision="v9")
    checkpoint.check_model(REPO)  # cached: its config is enough
    with pytest.raises(ValueError, match=f"{REPO} at revision 'v9'"):
        checkpoint.check_model(REPO, revision="v9")
    lay_out(offline, "jserve-test/no-weights", MAIN, weights=False)
    with pytest.raises(ValueError) as e:
        checkpoint.resolve_model("jserve-test/no-weights")
    assert "jserve-test/no-weights (commit aaaa" in _one_line(e) and "lacks its weights" in str(e.value)
    with pytest.raises(ValueError, match="revision 'v2' applies to a Hugging Face Hub id"):
        checkpoint.resolve_model(str(DATA / "arch" / "llama3"), revision="v2")
    # what the Hub itself answers, online
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    response = httpx2.Response(401, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    for error, want in (
            (GatedRepoError, "meta-llama/Llama-3.1-8B-Instruct is gated: accept the license at "
                             "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct and set HF_TOKEN"),
            (RepositoryNotFoundError, "model 'meta-llama/Llama-3.1-8B-Instruct' is not a local path, and the "
                                      "Hugging Face Hub has no model meta-llama/Llama-3.1-8B-Instruct (a private "
                                      "one needs HF_TOKEN): check the id, or pass a folder or .gguf file"),
            (RevisionNotFoundError, "meta-llama/Llama-3.1-8B-Instruct has no revision 'nope': give --revision a "
                                    "branch, tag or commit hash that exists")):
        def refuse(*a, error=error, **kw):
            raise error("the Hub's own long message\nover lines", response=response)

        monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
        with pytest.raises(ValueError) as e:
            checkpoint.resolve_model("meta-llama/Llama-3.1-8B-Instruct", revision="nope")
        assert _one_line(e).startswith(want)
    assert not (tmp_path / "ckpt").exists()  # nothing converted


def test_the_cli_names_a_missing_model_on_one_line(offline, capsys):
    from jserve import cli

    assert cli.main(["generate", "--model", "jserve-test/missing", "--prompt", "w5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jserve: error: HF_HUB_OFFLINE is set and jserve-test/missing is not in the cache {offline}; "
                   f"run once online or pass a folder"]


def test_what_is_a_hub_id():
    assert hub.parse_hub_id("meta-llama/Llama-3.1-8B-Instruct") == hub.HubModel("meta-llama/Llama-3.1-8B-Instruct")
    assert hub.parse_hub_id("Qwen/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M.gguf").gguf_file == "Qwen3-8B-Q4_K_M.gguf"
    assert hub.parse_hub_id("org/name", gguf_file="f.gguf") == hub.HubModel("org/name", "f.gguf")
    for not_an_id in ("/abs/path", "./rel/path", "a/b/c", "dir/model.gguf", "dir/config.json", "a--b/c", "a/..",
                      "name", None, Path("org/name")):
        assert hub.parse_hub_id(not_an_id) is None, not_an_id
    with pytest.raises(ValueError, match="must be a .gguf file, got 'model.bin'"):
        hub.parse_hub_id("org/name:model.bin")


def test_read_model_config_and_a_dummy_model_need_only_the_config(offline):
    lay_out(offline, "jserve-test/config-only", MAIN, weights=False)
    config, _ = checkpoint.read_model_config("jserve-test/config-only")
    assert config.num_layers == 2 and config.vocab_size == 256
    from jserve import LLM, SamplingParams

    llm = LLM("jserve-test/config-only", load_format="dummy", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, warmup=False)
    assert llm.dtype == "bfloat16" and llm.tokenizer.vocab_size == 256  # the repo's own tokenizer
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    llm.close()


def test_llm_generates_from_a_hub_id_with_its_flags(offline, tmp_path):
    """End to end: the model's flags (`add_model_args`) -> `model_source` -> `LLM`, greedy tokens
    equal to transformers' on the same weights; --tokenizer from another repo."""
    import argparse

    from jserve import LLM, SamplingParams

    download_dir = tmp_path / "downloads"
    lay_out(download_dir, REPO, OTHER, refs=("v2",))
    lay_out(download_dir, "jserve-test/tokenizer", MAIN,  # another EOS: the model's and this one's end
            extra={"tokenizer_config.json": json.dumps({"eos_token": "w3"}).encode()})
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args([REPO, "--revision", "v2", "--download-dir", str(download_dir), "--dtype", "float",
                              "--tokenizer", "jserve-test/tokenizer"])
    source = model_source(args)
    assert source.llm_kwargs() == {"model": REPO, "dtype": "float", "revision": "v2",
                                   "download_dir": str(download_dir), "gguf_file": None,
                                   "tokenizer": "jserve-test/tokenizer"}
    llm = LLM(**source.llm_kwargs(), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
    assert OTHER in str(llm.path) and llm.dtype == "float32"
    ref = np.load(DATA / "arch" / "llama3" / "reference.npz")
    prompt = " ".join(f"w{int(t)}" for t in ref["input_ids"][0, :10])
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert got.prompt_token_ids == ref["input_ids"][0, :10].tolist()
    assert got.outputs[0].token_ids == ref["greedy_ids"][0].tolist()
    assert llm.engine.eos_token_ids == {2, 3}
    llm.close()


def test_the_environment_variables_reach_huggingface_hub(tmp_path):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, in a fresh process (read at import there)."""
    lay_out(tmp_path / "home" / "hub", REPO, MAIN)
    code = ("from jserve.model.checkpoint import resolve_model, read_model_config; "
            f"print(resolve_model({REPO!r}, dtype='auto')); print(read_model_config({REPO!r})[0].num_layers)")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HF_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
                               "JSERVE_CHECKPOINTS": str(tmp_path / "ckpt"), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    path, layers = done.stdout.split()
    assert Path(path) == tmp_path / "ckpt" / "hub" / "jserve-test--tiny-llama3" / MAIN / "float32" and layers == "2"
