"""vLLM's extra request fields over HTTP (jserve.server.reply_fields): stop_reason, return_token_ids,
return_tokens_as_token_ids, stream_options.continuous_usage_stats, truncate_prompt_tokens,
add_special_tokens, continue_final_message; and bad_words and best_of through the server.

The server is test_server's (the tiny SmolLM2-shaped model on the real tokenizer), its tokenizer
set to add BOS so that add_special_tokens shows."""

from __future__ import annotations

import json

import pytest

from test_server import CHAT, MAX_MODEL_LEN, MODEL, assert_error, engine, request, server  # noqa: F401

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected(engine):  # noqa: F811
    """In place of test_server's (which its `server` fixture waits for): the tokenizer set to add
    BOS, before the server's tokenizer worker copies it."""
    engine.tokenizer.add_bos = True


@pytest.fixture(scope="module")
def tok(engine):  # noqa: F811
    return engine.tokenizer


def post(server, path, **body):
    status, _, answer = request(server, "POST", path, {"model": MODEL, **body})
    assert status == 200, answer
    return answer


def stream(server, path, **body) -> list[dict]:
    """The SSE events of a streamed request, [DONE] left out."""
    status, _, raw = request(server, "POST", path, {"model": MODEL, "stream": True, **body})
    assert status == 200, raw
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def complete(server, **body):
    return post(server, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 6, **GREEDY, **body})


# ------------------------------------------------------------------------------ stop_reason

def test_stop_reason_names_the_stop_string_or_id(server, tok):
    free = complete(server, return_token_ids=True)["choices"][0]
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    ids, text = free["token_ids"], free["text"]
    word = text[len(text) // 2:len(text) // 2 + 2]
    by_string = complete(server, stop=[word])["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == word
    by_id = complete(server, stop_token_ids=[ids[2]])["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == ids[2]
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=4, stop_token_ids=[ids[0]], **GREEDY)
    assert chat["choices"][0]["stop_reason"] in (None, ids[0])
    events = stream(server, "/v1/completions", prompt=PROMPT, max_tokens=6, stop=[word], **GREEDY)
    assert [c["stop_reason"] for e in events for c in e["choices"]][-1] == word
    assert all(c["stop_reason"] is None for e in events[:-1] for c in e["choices"])


# ------------------------------------------------------------------------------ return_token_ids

def test_return_token_ids_completions(server, tok):
    plain = complete(server)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    choice = complete(server, return_token_ids=True)["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(PROMPT) and choice["prompt_token_ids"][0] == tok.bos_token_id
    assert len(choice["token_ids"]) == 6 and tok.decode(choice["token_ids"]) == choice["text"] == plain["text"]
    events = stream(server, "/v1/completions", prompt=PROMPT, max_tokens=6, return_token_ids=True, **GREEDY)
    chunks = [c for e in events for c in e["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]


def test_return_token_ids_chat(server, tok):
    body = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=5, return_token_ids=True, **GREEDY)
    assert body["prompt_token_ids"] == tok.encode_chat(CHAT)
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 5 and tok.decode(ids) == body["choices"][0]["message"]["content"]
    events = stream(server, "/v1/chat/completions", messages=CHAT, max_tokens=5, return_token_ids=True, **GREEDY)
    assert events[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == ids


# ------------------------------------------------------------------------------ return_tokens_as_token_ids

def test_tokens_as_token_ids(server):
    choice = complete(server, logprobs=2, echo=True, return_token_ids=True, return_tokens_as_token_ids=True,
                      )["choices"][0]
    named = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert named == choice["prompt_token_ids"] + choice["token_ids"]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"][1:] for k in top)
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                return_token_ids=True, return_tokens_as_token_ids=True, **GREEDY)["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert all(a["token"].startswith("token_id:") for c in content for a in c["top_logprobs"])


# ------------------------------------------------------------------------------ continuous_usage_stats

def test_continuous_usage_stats(server, tok):
    events = stream(server, "/v1/completions", prompt=PROMPT, max_tokens=5, **GREEDY,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, last = events
    prompt = len(tok.encode(PROMPT))
    done = [e["usage"]["completion_tokens"] for e in chunks]
    assert done == sorted(done) and done[-1] == 5 and last["choices"] == []
    assert all(e["usage"]["prompt_tokens"] == prompt and e["usage"]["total_tokens"] == prompt + d
               for e, d in zip(chunks, done))
    assert last["usage"]["completion_tokens"] == 5
    # without include_usage it asks for nothing (vLLM's rule)
    quiet = stream(server, "/v1/completions", prompt=PROMPT, max_tokens=3, **GREEDY,
                   stream_options={"continuous_usage_stats": True})
    assert all("usage" not in e for e in quiet)


# ------------------------------------------------------------------------------ the prompt's tokens

def test_truncate_prompt_tokens(server, tok):
    long = "one two three four five six seven eight nine ten"
    full = tok.encode(long)
    choice = post(server, "/v1/completions", prompt=long, max_tokens=4, truncate_prompt_tokens=5,
                  return_token_ids=True, echo=True, **GREEDY)
    kept = choice["choices"][0]["prompt_token_ids"]
    assert kept == full[-5:] and choice["usage"]["prompt_tokens"] == 5
    assert choice["choices"][0]["text"].startswith(tok.decode(full[-5:]))
    as_ids = post(server, "/v1/completions", prompt=full[-5:], max_tokens=4, return_token_ids=True, **GREEDY)
    assert as_ids["choices"][0]["token_ids"] == choice["choices"][0]["token_ids"]
    ids = post(server, "/v1/completions", prompt=full, max_tokens=4, truncate_prompt_tokens=5, return_token_ids=True,
               **GREEDY)
    assert ids["choices"][0]["prompt_token_ids"] == full[-5:]
    short = post(server, "/v1/completions", prompt=long, max_tokens=1, truncate_prompt_tokens=-1,
                 return_token_ids=True, **GREEDY)
    assert short["choices"][0]["prompt_token_ids"] == full  # -1: the model's length, more than it has
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=1, truncate_prompt_tokens=3,
                return_token_ids=True, **GREEDY)
    assert chat["prompt_token_ids"] == tok.encode_chat(CHAT)[-3:]


@pytest.mark.parametrize("value", [0, -2, MAX_MODEL_LEN + 1, "5", 1.5])
def test_truncate_prompt_tokens_refused(server, value):
    status, _, answer = request(server, "POST", "/v1/completions", {"prompt": PROMPT,
                                                                     "truncate_prompt_tokens": value})
    assert_error(status, answer, 400, contains=["truncate_prompt_tokens"])
    assert answer["error"]["param"] == "truncate_prompt_tokens"


def test_add_special_tokens(server, tok):
    bare = tok.encode(PROMPT, add_special_tokens=False)
    off = complete(server, add_special_tokens=False, return_token_ids=True)["choices"][0]
    assert off["prompt_token_ids"] == bare
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=1, return_token_ids=True, **GREEDY)
    with_bos = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=1, return_token_ids=True,
                    add_special_tokens=True, **GREEDY)
    assert with_bos["prompt_token_ids"] == [tok.bos_token_id] + chat["prompt_token_ids"]
    status, _, answer = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "add_special_tokens": 1})
    assert_error(status, answer, 400, contains=["add_special_tokens"])


def test_continue_final_message(server, tok):
    messages = CHAT + [{"role": "assistant", "content": "The answer is"}]
    body = post(server, "/v1/chat/completions", messages=messages, max_tokens=3, continue_final_message=True,
                return_token_ids=True, **GREEDY)
    want = tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert body["prompt_token_ids"] == want and tok.decode(want).endswith("The answer is")
    status, _, answer = request(server, "POST", "/v1/chat/completions", {
        "messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert_error(status, answer, 400, contains=["continue_final_message", "add_generation_prompt"])
    status, _, answer = request(server, "POST", "/v1/chat/completions", {
        "messages": messages, "continue_final_message": "yes"})
    assert_error(status, answer, 400, contains=["continue_final_message"])


# ------------------------------------------------------------------------------ bad_words

def test_bad_words(server, tok):
    free = complete(server, max_tokens=8, return_token_ids=True)["choices"][0]
    word = tok.decode(free["token_ids"][:1]).strip() or tok.decode(free["token_ids"][1:2]).strip()
    sequences = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    banned = complete(server, max_tokens=8, bad_words=[word], return_token_ids=True)["choices"][0]
    ids = banned["token_ids"]
    assert len(ids) == 8 and ids != free["token_ids"]
    assert not any(ids[i:i + len(s)] == s for s in sequences for i in range(len(ids)))
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=4, bad_words=[word], **GREEDY)
    assert chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value, named", [("word", "'word'"), (["ok", " "], "' '"), ([3], "3"),
                                          (["w"] * 129, "128"), (["x" * 300], "256")])
def test_bad_words_refused(server, value, named):
    status, _, answer = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "bad_words": value})
    assert_error(status, answer, 400, contains=["bad_words", named])
    assert answer["error"]["param"] == "bad_words"


# ------------------------------------------------------------------------------ best_of

def test_best_of(server):
    body = post(server, "/v1/completions", prompt=PROMPT, max_tokens=4, n=2, best_of=3, temperature=1.0, seed=5)
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 8
    for bad in ({"n": 2, "best_of": 1}, {"best_of": 3, "stream": True}, {"best_of": 1000}, {"best_of": "2"}):
        status, _, answer = request(server, "POST", "/v1/completions", {"prompt": PROMPT, **bad})
        assert_error(status, answer, 400, contains=["best_of"])
