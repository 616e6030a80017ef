"""--reasoning-parser over HTTP: a tiny random Qwen3 (tests/data/arch/qwen3) with a tokenizer whose
`<think>` / `</think>` are tokens (reasoning_helpers.py). Its text is random, so logit_bias puts the
tags in it, and each chat reply is checked against the parser run on the same output taken raw
from /v1/completions (same prompt, seed and sampling), whole and streamed."""

from __future__ import annotations

import json

import pytest

from arch_helpers import widened
from jserve.engine import EngineConfig, build_engine
from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server import ServerState
from jserve.structured.reasoning import ReasoningParser
from reasoning_helpers import END_THINK, THINK, VOCAB, load_tokenizer
from test_server import Server, assert_error, request

MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
TAGS = {str(THINK): 2.5, str(END_THINK): 2.5}  # both tags now and then in the random text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tokenizer):
    config, params = widened("qwen3", VOCAB)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, page_size=4, num_pages=256,
                       backend="cpu", warmup=True)
    engine = AsyncLLMEngine(build_engine(config, params, tokenizer, [], cfg))
    state = ServerState(MODEL, reasoning_parser="qwen3")
    state.attach(engine)
    srv = Server(state)
    yield srv
    srv.close()
    assert engine.shutdown(timeout=30)


def chat(server, **body):
    status, _, out = request(server, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "max_tokens": 24, **body})
    assert status == 200, out
    return out


def chat_stream(server, **body):
    """(reasoning, content) a streamed reply's deltas concatenate to, and its chunks' deltas."""
    status, _, raw = request(server, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "max_tokens": 24, "stream": True, **body})
    assert status == 200, raw
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    thought = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return thought or None, content or None, deltas


def raw_text(server, tokenizer, messages=ASK, kwargs=None, **body):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(kwargs or {}))
    status, _, out = request(server, "POST", "/v1/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": 24, **body})
    assert status == 200, out
    return out["choices"][0]["text"]


SAMPLED = dict(temperature=1.0, logit_bias=TAGS)


def test_reasoning_and_content_split_whole_and_streamed(server, tokenizer):
    seen = set()
    for seed in range(6):
        raw = raw_text(server, tokenizer, seed=seed, **SAMPLED)
        want = ReasoningParser().parse(raw)
        message = chat(server, seed=seed, **SAMPLED)["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == want, raw
        thought, content, deltas = chat_stream(server, seed=seed, **SAMPLED)
        assert (thought, content) == want, raw
        assert not any("<think>" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas[:1])
        assert "reasoning_content" not in message and all("reasoning_content" not in d for d in deltas)
        seen.add(("</think>" in raw, want[0] is not None, want[1] is not None))
    assert (True, True, True) in seen, seen  # some output had thinking and content both


def test_include_reasoning_false_drops_it(server, tokenizer):
    for seed in range(3):
        raw = raw_text(server, tokenizer, seed=seed, **SAMPLED)
        message = chat(server, seed=seed, include_reasoning=False, **SAMPLED)["choices"][0]["message"]
        assert message["reasoning"] is None and message["content"] == ReasoningParser().parse(raw)[1]
        thought, content, deltas = chat_stream(server, seed=seed, include_reasoning=False, logprobs=True, **SAMPLED)
        assert thought is None and content == message["content"]


def test_enable_thinking_false_is_all_content(server, tokenizer):
    kwargs = {"enable_thinking": False}
    raw = raw_text(server, tokenizer, kwargs=kwargs, seed=1, **SAMPLED)
    message = chat(server, seed=1, chat_template_kwargs=kwargs, **SAMPLED)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": raw, "reasoning": None}
    assert chat_stream(server, seed=1, chat_template_kwargs=kwargs, **SAMPLED)[:2] == (None, raw)


def test_a_constraint_applies_after_the_thinking(server):
    thoughts = []
    for seed in range(5):
        for stream in (False, True):
            body = dict(seed=seed, temperature=1.0, max_tokens=60, logit_bias={str(END_THINK): 3},
                        structured_outputs={"choice": ["yes", "no"]})
            if stream:
                thought, content, _ = chat_stream(server, **body)
            else:
                out = chat(server, **body)["choices"][0]
                assert out["finish_reason"] == "stop", out
                thought, content = out["message"]["reasoning"], out["message"]["content"]
            assert content in ("yes", "no"), (thought, content)
            thoughts.append(thought)
    assert any(thoughts), thoughts  # the thinking was free text before the answer


def test_reasoning_sent_back_reaches_the_template(server, tokenizer):
    for key in ("reasoning", "reasoning_content"):
        messages = [*ASK, {"role": "assistant", "content": "4", key: "2 and 2 make 4"}, ASK[0]]
        status, _, out = request(server, "POST", "/tokenize", {"model": MODEL, "messages": messages})
        assert status == 200, out
        assert "assistant<think>\n2 and 2 make 4\n</think>4<|im_end|>" in tokenizer.decode(out["tokens"])
    bad = [*ASK, {"role": "assistant", "content": "4", "reasoning": "a", "reasoning_content": "b"}]
    status, _, out = request(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": bad})
    assert_error(status, out, 400, contains=["differ"])
    bad = [{"role": "user", "content": "hi", "reasoning": "a"}]
    status, _, out = request(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": bad})
    assert_error(status, out, 400, contains=["messages[0].reasoning is for assistant messages"])


@pytest.mark.parametrize("kwargs,message", [
    ({"messages": []}, "chat_template_kwargs.messages is set by the server"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ([1], "chat_template_kwargs must be an object"),
])
def test_chat_template_kwargs_refused(server, kwargs, message):
    status, _, out = request(server, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs})
    assert_error(status, out, 400, contains=[message])


def test_include_reasoning_must_be_a_boolean(server):
    status, _, out = request(server, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "include_reasoning": "no"})
    assert_error(status, out, 400, contains=["include_reasoning"])


def test_a_tokenizer_without_the_tags_is_refused_at_start():
    from jserve.structured.reasoning import check_tokenizer

    with pytest.raises(ValueError, match="--reasoning-parser qwen3: this tokenizer has no <think> token"):
        check_tokenizer("qwen3", lambda text: list(text.encode()))
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerState(MODEL, reasoning_parser="nope")
