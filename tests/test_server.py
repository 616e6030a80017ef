"""The OpenAI-compatible server: real aiohttp app on a loopback port, driven by the `openai` client and raw HTTP.

The engine is the tiny random SmolLM2-shaped model (tests/data/arch/smollm2) with its vocabulary
padded to the real SmolLM2 tokenizer's 49152 ids, so that text prompts and the chat template
work end to end; greedy outputs are compared with the plain LLMEngine's for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time

import openai
import pytest
from aiohttp import web

from arch_helpers import widened
from jserve.core.request import MAX_LOGPROBS, SamplingParams
from jserve.engine import EngineConfig, build_engine
from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server import ServerState, build_app
from jserve.server.http import CappedSite
from jserve.text.tokenizer import Tokenizer

MODEL = "tiny-smollm2"
MAX_MODEL_LEN = 128
GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time"]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


class Server:
    """An aiohttp app on its own event-loop thread, on a free loopback port."""

    def __init__(self, state: ServerState, **app_kwargs):
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(build_app(state, **app_kwargs), **state.timeouts.runner_kwargs())

        async def start():
            await self.runner.setup()
            site = CappedSite(self.runner, "127.0.0.1", 0, max_connections=state.timeouts.max_connections)
            await site.start()
            return site.port

        self.port = self.call(start())
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def request(server: Server, method: str, path: str, body=None, headers=None, timeout: float = 60):
    """Raw HTTP: (status, headers, parsed JSON body or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, dict(resp.getheaders()), json.loads(data)
    except ValueError:
        return resp.status, dict(resp.getheaders()), data


def assert_error(status, body, want_status, code=None, *, contains=()):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    for text in contains:
        assert text in body["error"]["message"], body


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint):
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    config, params = widened("smollm2", tokenizer.vocab_size)
    # few buckets (5 shapes): a 49152-wide vocabulary makes each compile slow on a cold cache
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN, page_size=4,
                       num_pages=256, backend="cpu", warmup=True)
    return build_engine(config, params, tokenizer, [], cfg)


def run_sync(engine, prompts, params):
    """Final outputs of the plain LLMEngine (before the async engine owns it)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"sync-{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[f"sync-{i}"].outputs[0] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(engine):
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=8, **GREEDY)
    ids = [tok.encode(p) for p in PROMPTS] + [tok.encode_chat(CHAT)]
    outs = run_sync(engine, ids, params)
    return {"completions": {p: o.text for p, o in zip(PROMPTS, outs)}, "chat": outs[-1].text,
            "ids": dict(zip(PROMPTS, ids))}


@contextlib.contextmanager
def serving(engine, model_names, **app_kwargs):
    """`engine` (an LLMEngine) behind a live server on a loopback port; its engine thread is shut
    down after."""
    aengine = AsyncLLMEngine(engine)
    state = ServerState(model_names)
    state.attach(aengine)
    srv = Server(state, **app_kwargs)
    try:
        yield srv
    finally:
        srv.close()
        assert aengine.shutdown(timeout=30)


@pytest.fixture(scope="module")
def server(engine, expected):
    with serving(engine, MODEL, max_body_bytes=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_idle(server, timeout: float = 10.0) -> dict:
    """Engine stats once nothing runs (polled: an abort lands within one step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.call(server.state.engine.stats())
        if (stats["pages_in_use"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


# ------------------------------------------------------------------------------ happy paths

def test_completion_matches_engine(client, expected):
    prompt = PROMPTS[1]
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                      extra_body={"ignore_eos": True})
    out = raw.parse()
    assert out.choices[0].text == expected["completions"][prompt]
    assert out.choices[0].finish_reason == "length" and out.object == "text_completion"
    n = len(expected["ids"][prompt])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n, 8, n + 8)
    extra = out.usage.model_extra
    assert {"queue_ms", "prefill_ms", "decode_ms"} <= set(extra) and extra["prefill_ms"] > 0
    assert float(raw.headers["x-jserve-decode-ms"]) == extra["decode_ms"]


def test_completion_stream_matches_engine(client, expected):
    prompt = PROMPTS[0]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["completions"][prompt]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_plain_and_streamed_match_engine(client, expected):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == expected["chat"] and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = resp.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_many_prompts_n_and_token_ids(client, expected):
    ids = expected["ids"]
    out = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[2]], n=2, max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected["completions"][PROMPTS[0]]] * 2 + \
        [expected["completions"][PROMPTS[2]]] * 2
    out = client.completions.create(model=MODEL, prompt=[ids[PROMPTS[3]], ids[PROMPTS[1]]], max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [expected["completions"][PROMPTS[3]], expected["completions"][PROMPTS[1]]]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPTS[3])
    # sampled with seed: reproducible, and the extras are accepted
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0.9, top_p=0.9, seed=7, stop=["zzz"],
              presence_penalty=0.5, frequency_penalty=0.5, user="u1",
              extra_body=dict(top_k=50, min_p=0.01, repetition_penalty=1.1, priority=0, ignore_eos=True))
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == out.choices[0].text and all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))  # greedy: the top token
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_models_tokenize_detokenize(server, client, expected):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = request(server, "POST", "/tokenize", {"prompt": PROMPTS[1]})
    assert status == 200 and body["tokens"] == expected["ids"][PROMPTS[1]] and body["count"] == len(body["tokens"])
    status, _, body = request(server, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and body["tokens"] == server.state.tokenizer.encode_chat(CHAT)
    status, _, body = request(server, "POST", "/detokenize", {"tokens": expected["ids"][PROMPTS[1]]})
    assert status == 200 and body["prompt"] == PROMPTS[1]


# ------------------------------------------------------------------------------ errors

ERRORS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 413, None),
    ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, None),  # nesting past the recursion limit
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "1000000000"),
    ("/v1/completions", {"prompt": [1, True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "-1"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "1.5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 5}}, 400, "1000000"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    ("/tokenize", {"prompt": None}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "-1"),
    # validated before any work: ids against the vocabulary, strict UTF-8 and JSON, every field known
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**62]}, 400, "4611686018427387904"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [49152]}, 400, "49152"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "-1"),
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b"}', 400, "UTF-8"),  # a surrogate as raw bytes
    ("/v1/completions", b'{"prompt": "a\xc3"}', 400, "UTF-8"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["x", "\\ud800"]}', 400, "stop[1]"),
    ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "model": "other", "prompt": "hi"}', 400, "model"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "NaN"),
    ("/v1/completions", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),  # chat only
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "every_step": True}}, 400,
     "stream_options.every_step"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 257]}, 400, "256"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, 400,
     "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]},
     400, "messages[0].content[0].cache"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
]


@pytest.mark.parametrize("path,body,status,needle", ERRORS, ids=range(len(ERRORS)))
def test_client_errors(server, path, body, status, needle):
    got, _, answer = request(server, "POST", path, body)
    assert_error(got, answer, status, contains=() if needle is None else (needle,))


EXTREME = [dict(temperature=1e300), dict(temperature=1e-300), dict(top_p=1e-300), dict(min_p=1.0),
           dict(top_k=2**31 - 1),
           dict(top_k=-1), dict(repetition_penalty=0.01), dict(repetition_penalty=10), dict(presence_penalty=-2,
           frequency_penalty=2), dict(seed=-2**63), dict(seed=2**64 - 1), dict(n=8, logprobs=MAX_LOGPROBS),
           dict(stop_token_ids=[0, 49151], min_tokens=MAX_MODEL_LEN), dict(priority=0, echo=True),
           dict(stop=["a"] * 16, include_stop_str_in_output=True, skip_special_tokens=False)]


@pytest.mark.parametrize("extra", EXTREME, ids=range(len(EXTREME)))
def test_extreme_valid_values(server, extra):
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, **extra})
    assert status == 200, body
    assert len(body["choices"]) == extra.get("n", 1)


def test_unknown_model_long_prompt_routes(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.code == "model_not_found" and "gpt-4" in e.value.message
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": list(range(5, 5 + MAX_MODEL_LEN))})
    assert_error(status, body, 400, "context_length_exceeded", contains=(str(MAX_MODEL_LEN), str(MAX_MODEL_LEN)))
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": [5] * 100, "max_tokens": 50})
    assert_error(status, body, 400, "context_length_exceeded", contains=("100", "50", "150", str(MAX_MODEL_LEN)))
    assert_error(*request(server, "POST", "/v1/nothing", {})[::2], 404)
    assert_error(*request(server, "GET", "/v1/completions")[::2], 405)


def test_auth_and_queue_limit(server):
    state = server.state
    state.api_keys = (b"k1", b"k2")
    try:
        assert_error(*request(server, "POST", "/v1/completions", {"prompt": "hi"})[::2], 401, "invalid_api_key")
        bad = {"Authorization": "Bearer k3"}
        assert_error(*request(server, "GET", "/v1/models", headers=bad)[::2], 401)
        assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer k2"})[0] == 200
        assert request(server, "GET", "/health")[0] == 200  # stays open
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="k1", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        state.api_keys = ()
    admission = state.admission
    saved, admission.seqs = admission.seqs, admission.max_seqs  # as if that many sequences were in flight
    try:
        status, headers, body = request(server, "POST", "/v1/completions", {"prompt": "hi"})
        assert_error(status, body, 429, "queue_full")
        assert headers["Retry-After"] == "1"
    finally:
        admission.seqs = saved


def test_warming_up_and_draining(engine):
    """/health is 503 until attach, 200 while serving; drain lets in-flight requests finish, then 503."""
    state = ServerState(MODEL)
    srv = Server(state)
    try:
        assert request(srv, "GET", "/health")[:3:2] == (503, {"status": "warming_up"})
        assert_error(*request(srv, "POST", "/v1/completions", {"prompt": "hi"})[::2], 503, "warming_up")
        aengine = AsyncLLMEngine(engine)
        state.attach(aengine)
        assert request(srv, "GET", "/health")[0] == 200

        result = {}
        thread = threading.Thread(target=lambda: result.update(out=request(
            srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 20, "ignore_eos": True})))
        thread.start()
        while state.num_in_flight == 0:
            time.sleep(0.01)
        future = asyncio.run_coroutine_threadsafe(state.drain(grace=30), srv.loop)
        time.sleep(0.05)
        assert request(srv, "GET", "/health")[:3:2] == (503, {"status": "shutting_down"})
        assert_error(*request(srv, "POST", "/v1/completions", {"prompt": "hi"})[::2], 503, "shutting_down")
        future.result(60)
        thread.join(60)
        status, _, body = result["out"]
        assert status == 200 and body["usage"]["completion_tokens"] == 20  # finished within the grace period
        assert not aengine.is_running and engine.stats()["pages_in_use"] == 0
    finally:
        srv.close()
