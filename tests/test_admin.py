"""The management routes behind the admin key (/sleep, /wake_up, /is_sleeping, /update_weights) and
the AsyncLLMEngine's in-flight policies for a weight update (drain, abort, continue)."""

from __future__ import annotations

import asyncio

import pytest

from jserve.core.request import SamplingParams
from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server import ServerState
from test_server import Server, assert_error, request
from test_update_weights import SETTINGS, checkpoints  # noqa: F401 - the fixture

ADMIN = {"Authorization": "Bearer admin-secret"}
USER = {"Authorization": "Bearer user-key"}
BODY = {"model": "tiny", "prompt": [5, 9, 17, 33, 65, 129], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(checkpoints):  # noqa: F811
    from jserve import LLM

    llm = LLM(str(checkpoints[0]), **SETTINGS)
    engine = AsyncLLMEngine(llm.engine)
    state = ServerState("tiny", api_keys=("user-key",))
    state.attach(engine)
    server = Server(state, admin_key="admin-secret")
    yield server, engine
    server.close()
    engine.shutdown()


def _text(server) -> str:
    status, _, body = request(server, "POST", "/v1/completions", BODY, USER)
    assert status == 200, body
    return body["choices"][0]["text"]


def test_sleep_wake_and_update_through_http(served, checkpoints):  # noqa: F811
    server, engine = served
    before = _text(server)
    assert_error(*request(server, "POST", "/sleep")[::2], 401, "invalid_admin_key")
    assert_error(*request(server, "POST", "/sleep", headers=USER)[::2], 401, "invalid_admin_key")
    assert_error(*request(server, "POST", "/sleep?level=3", headers=ADMIN)[::2], 400, contains=["level"])
    status, _, body = request(server, "POST", "/sleep?level=1", headers=ADMIN)
    assert status == 200 and body == {"is_sleeping": True, "level": 1}
    status, _, body = request(server, "GET", "/is_sleeping", headers=ADMIN)
    assert body == {"is_sleeping": True, "level": 1, "weights": "host", "kv_cache": False}
    status, _, body = request(server, "POST", "/v1/completions", BODY, USER)
    assert_error(status, body, 503, "sleeping", contains=["POST /wake_up"])
    assert request(server, "GET", "/health")[0] == 503
    status, _, body = request(server, "POST", "/wake_up", headers=ADMIN)
    assert status == 200 and body == {"is_sleeping": False}
    assert _text(server) == before
    status, _, body = request(server, "POST", "/update_weights", {"path": str(checkpoints[1])}, ADMIN)
    assert status == 200 and body["updated"] and body["seconds"] > 0, body
    assert _text(server) != before
    request(server, "POST", "/update_weights", {"path": str(checkpoints[0]), "policy": "abort"}, ADMIN)
    assert _text(server) == before
    status, _, body = request(server, "POST", "/update_weights", {"path": "/nonexistent"}, ADMIN)
    assert_error(status, body, 400, contains=["/nonexistent"])
    status, _, body = request(server, "POST", "/update_weights", {"path": "/x", "when": 1}, ADMIN)
    assert_error(status, body, 400, contains=["'when'"])
    assert server.call(engine.stats())["compilations_after_warmup"] == 0


def test_no_admin_key_no_routes(served):
    server, engine = served
    bare = Server(ServerState("tiny"))
    try:
        assert request(bare, "POST", "/sleep", headers=ADMIN)[0] == 404
    finally:
        bare.close()


@pytest.mark.parametrize("policy, reason", [("drain", "length"), ("abort", "abort"), ("continue", "length")])
def test_in_flight_policies(served, checkpoints, policy, reason):  # noqa: F811
    server, engine = served
    from jserve.engine.weights import load_weights

    weights = load_weights(checkpoints[0], "float32")

    async def run():
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        stream = engine.generate(f"long-{policy}", [5, 9, 17], params, delta=False)
        first = await stream.__anext__()  # in flight now
        update = asyncio.ensure_future(engine.update_weights(weights, policy=policy))
        last = first
        async for out in stream:
            last = out
        await update
        return last, update.done()

    last, done = server.call(run())
    assert done and last.outputs[0].finish_reason == reason
    if reason == "length":
        assert len(last.outputs[0].token_ids) == 40
