"""A model's sampling defaults (generation_config.json), applied as vLLM's `--generation-config auto`
applies them: recorded at conversion, used for the fields a request leaves out."""

from __future__ import annotations

import json

import pytest

from jserve import cli
from jserve.model.checkpoint import load_checkpoint
from jserve.model.sampling_defaults import read_generation_config, resolve
from jserve.server.limits import Limits
from jserve.server.protocol import Context, check_prompts, parse_chat, parse_completion
from test_checkpoint import tiny_hf_folder  # noqa: F401 (fixture)

QWEN3 = {"do_sample": True,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0, "transformers_version": "4.51.0"}


def test_only_the_keys_the_creator_set_apart_from_transformers_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3, "max_new_tokens": 300}))
    assert read_generation_config(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 300}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 1.0}))
    assert read_generation_config(tmp_path) == {}  # transformers' own defaults: nobody chose them
    assert read_generation_config(tmp_path / "missing") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 2.5}))
    with pytest.raises(ValueError, match="top_k must be an integer, got 2.5"):
        read_generation_config(tmp_path)
    assert resolve("vllm", {"temperature": 0.6}) == {} and resolve("auto", {"top_p": 0.5}) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="give 'auto', 'vllm' or a folder"):
        resolve(str(tmp_path / "nowhere"), {})


def test_conversion_records_them_in_the_checkpoint(tiny_hf_folder, tmp_path):  # noqa: F811
    (tiny_hf_folder / "generation_config.json").write_text(json.dumps(QWEN3))
    assert cli.main(["convert", str(tiny_hf_folder), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    _, _, generation = load_checkpoint(tmp_path / "ckpt")
    assert generation["sampling_defaults"] == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _ctx(defaults):
    limits = Limits().resolve(max_model_len=128, num_kv_tokens=4096, max_num_seqs=8)
    return Context(("m",), 128, 1000, limits, sampling_defaults=defaults)


def test_a_request_takes_the_defaults_for_what_it_leaves_out():
    ctx = _ctx({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 100})
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    p = parse_chat(chat, ctx).params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.6, 20, 0.95, 0.05, 1.1)
    p = parse_chat({**chat, "temperature": 0, "top_k": -1, "top_p": 1}, ctx).params
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 0, 1.0)  # the request's own values win (-1: none)
    assert parse_completion({"prompt": "x"}, ctx).params.max_tokens == 16  # the completions API's default stays
    for prompt_len, want in ((10, 100), (60, 68)):  # max_new_tokens as max_tokens, within the context
        req = parse_chat(chat, ctx)
        req.prompts = [(None, list(range(1, prompt_len + 1)))]
        check_prompts(req, ctx)
        assert req.params.max_tokens == want
    req = parse_chat({**chat, "max_tokens": 7}, ctx)
    req.prompts = [(None, [1, 2, 3])]
    check_prompts(req, ctx)
    assert req.params.max_tokens == 7
    assert parse_chat(chat, _ctx({})).params.temperature == 1.0  # none recorded: the API's defaults
