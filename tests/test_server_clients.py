"""The OpenAI-compatible server against clients that leave early (mid-stream, while waiting for a
plain reply, many at once under load) and against fuzzed bodies: pages always come back and no
answer is a 5xx. The server and its engine are test_server.py's fixtures (a server of its own,
for this module)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import CHAT, MODEL, PROMPTS, assert_error, client, engine, engine_idle, expected, request, server  # noqa: F401

# ------------------------------------------------------------------------------ disconnects and load

async def _stream(url: str, body: dict, *, drop_after: int | None = None) -> tuple[str, str | None] | None:
    """Stream one completion; with drop_after, close the connection after that many chunks."""
    text, finish = "", None
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            count = 0
            async for line in resp.content:
                line = line.strip()
                if not line:
                    continue
                assert line.startswith(b"data: ")
                if line == b"data: [DONE]":
                    return text, finish
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
                count += 1
                if drop_after is not None and count >= drop_after:
                    resp.close()
                    return None
    raise AssertionError("stream ended without [DONE]")


def test_disconnect_mid_stream_frees_pages(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    steps = server.call(server.state.engine.stats())["num_steps"]
    assert asyncio.run(_stream(server.url, body, drop_after=2)) is None
    stats = engine_idle(server)
    assert stats["pages_in_use"] == 0 and stats["num_running"] == 0
    assert stats["num_steps"] - steps < 60  # aborted long before its 100 tokens


def test_disconnect_while_waiting_for_a_plain_reply_aborts(server):
    # The client gives up after 0.1 s. Each engine step is held to >= 4 ms for this test, so the
    # 100 tokens would take >= 0.4 s: the abort must land well before them (unpaced, a tiny-model
    # step takes about a millisecond and the whole request could finish inside the 0.1 s).
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(server.url + "/v1/completions",
                                   json={"prompt": PROMPTS[2], "max_tokens": 100, "ignore_eos": True})

    llm = server.state.engine.engine
    step = llm.step

    def paced_step():
        t0 = time.monotonic()
        out = step()
        time.sleep(max(0.0, 0.004 - (time.monotonic() - t0)))
        return out

    steps = server.call(server.state.engine.stats())["num_steps"]
    llm.step = paced_step  # the engine thread looks the method up at every step
    try:
        asyncio.run(go())
        stats = engine_idle(server)
    finally:
        del llm.step
    assert 0 < stats["num_steps"] - steps < 90  # it ran, and stopped well before its 100 tokens


def test_concurrent_streams_with_disconnects(server, expected):
    async def main():
        jobs = []
        for i in range(200):
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            drop = 1 + i % 3 if i % 4 == 3 else None
            jobs.append(_stream(server.url, body if drop is None else {**body, "max_tokens": 60}, drop_after=drop))
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        if i % 4 == 3:
            assert result is None
        else:
            assert result == (expected["completions"][PROMPTS[i % len(PROMPTS)]], "length")
    engine_idle(server)
    status, _, text = request(server, "GET", "/metrics")
    assert status == 200
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.decode().splitlines()
               if line and not line.startswith("#")}
    assert metrics["jserve_kv_pages_used"] == 0 and metrics["jserve_num_requests_running"] == 0
    assert metrics["jserve_compilations_after_warmup"] == 0
    assert metrics['jserve_requests_total{route="/v1/completions",status="200"}'] >= 150
    assert metrics["jserve_time_to_first_token_seconds_count"] >= 150
    for name in ("jserve_inter_token_latency_seconds_count", "jserve_time_per_output_token_seconds_count",
                 "jserve_request_queue_time_seconds_count", "jserve_request_decode_time_seconds_count",
                 "jserve_achieved_bytes_per_second", "jserve_achieved_flops_per_second",
                 "jserve_step_tokens_per_second"):
        assert metrics[name] > 0, name


# ------------------------------------------------------------------------------ fuzz

_SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 20, 21, 2**31, 2**63, -2**63, 10**30]),
                     st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, 1e-300, 1e300]),
                     st.text(max_size=8))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=8)
_FIELDS = ["model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p",
           "seed", "stop", "logprobs", "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "user",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "stream", "stream_options", "best_of",
           "logit_bias", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens"]
_BODIES = st.one_of(
    st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6).map(
        lambda d: {"prompt": "Hi", "messages": CHAT, "max_tokens": 2, **d}),
    _JSON.map(json.dumps),
    st.binary(max_size=40),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       body=_BODIES)
def test_fuzz_bodies_never_5xx(server, path, body):
    status, _, answer = request(server, "POST", path, body, timeout=60)
    assert status < 500, answer
    if status >= 400:
        assert_error(status, answer, status)


def test_still_serving_after_fuzz(client, server, expected):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected["completions"][PROMPTS[1]]
    stats = engine_idle(server)
    assert stats["pages_in_use"] == 0 and stats["compilations_after_warmup"] == 0
