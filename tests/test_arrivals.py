"""Requests on their way to the engine (`jserve.engine.arrivals`): requests that come together start
in the same step, the wait for them is bounded and settled on every path, and a request that
arrives while a step runs is scheduled in the next one. A fake engine (test_async_engine's) records
the requests each step ran."""

from __future__ import annotations

import asyncio
import threading
import time
import types

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from jserve.core.request import SamplingParams
from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server import arrivals
from test_async_engine import FakeEngine


class Recording(FakeEngine):
    """A FakeEngine that records the request ids of each step (after its gate lets it run)."""

    def __init__(self, gate: threading.Semaphore | None = None):
        super().__init__(gate=gate)
        self.steps: list[list[str]] = []
        self.in_step = threading.Event()

    def step(self):
        self.in_step.set()
        gate, self.gate = self.gate, None
        if gate is not None:
            assert gate.acquire(timeout=10)
        self.steps.append(sorted(self.requests))
        try:
            return super().step()
        finally:
            self.gate = gate


async def _collect(gen) -> list:
    return [out async for out in gen]


def test_requests_being_read_join_the_first_step():
    fake = Recording()
    engine = AsyncLLMEngine(fake, gather_seconds=5.0)

    async def client(rid: str, reading: float):
        with engine.expect():  # the server's route: read for `reading` seconds, then added
            await asyncio.sleep(reading)
            return await _collect(engine.generate(rid, [0], SamplingParams(max_tokens=2)))

    async def main():
        t0 = time.monotonic()
        outs = await asyncio.gather(client("a", 0.0), client("b", 0.05), client("c", 0.1))
        return outs, time.monotonic() - t0

    try:
        outs, seconds = asyncio.run(main())
        assert fake.steps[0] == ["a", "b", "c"], fake.steps  # the first add did not start a step alone
        assert all(o[-1].finished for o in outs)
        assert seconds < 2.0  # the wait ended when the last one came, not at gather_seconds
        assert engine._arrivals.pending == 0
    finally:
        assert engine.shutdown(timeout=10)


def test_without_a_wait_the_first_request_starts_alone():
    """The control: gather_seconds=0 runs the first add's step at once (so the test above can fail)."""
    fake = Recording()
    engine = AsyncLLMEngine(fake, gather_seconds=0.0)

    async def client(rid: str, reading: float):
        with engine.expect():
            await asyncio.sleep(reading)
            return await _collect(engine.generate(rid, [0], SamplingParams(max_tokens=2)))

    async def main():
        await asyncio.wait_for(asyncio.gather(client("a", 0.0), client("b", 0.2)), 10)

    try:
        asyncio.run(main())
        assert fake.steps[0] == ["a"], fake.steps
    finally:
        assert engine.shutdown(timeout=10)


def test_the_wait_is_bounded_and_every_path_settles():
    fake = Recording()
    engine = AsyncLLMEngine(fake, gather_seconds=0.05)

    async def main():
        stalled = asyncio.Event()

        async def never_added():  # a request whose body never comes: it must not hold the others
            with engine.expect():
                await stalled.wait()

        async def refused():  # a request refused before its add (a 400): settled as the route ends
            with engine.expect():
                raise ValueError("bad field")

        hold = asyncio.ensure_future(never_added())
        await asyncio.sleep(0)
        try:
            await refused()
        except ValueError:
            pass
        assert engine._arrivals.pending == 1
        t0 = time.monotonic()
        with engine.expect():
            outs = await asyncio.wait_for(_collect(engine.generate("a", [0], SamplingParams(max_tokens=1))), 5)
            assert engine._arrivals.pending == 1  # its own add settled it; the stalled one is still counted
        seconds = time.monotonic() - t0
        stalled.set()
        await hold
        return outs, seconds

    try:
        outs, seconds = asyncio.run(main())
        assert outs[-1].finished and 0.04 < seconds < 2.0  # served after the bounded wait
        assert engine._arrivals.pending == 0
    finally:
        assert engine.shutdown(timeout=10)


def test_a_request_arriving_during_a_step_runs_in_the_next_step():
    gate = threading.Semaphore(0)
    fake = Recording(gate=gate)
    engine = AsyncLLMEngine(fake)

    async def main():
        first = asyncio.ensure_future(_collect(engine.generate("a", [0], SamplingParams(max_tokens=3))))
        assert await asyncio.to_thread(fake.in_step.wait, 10)  # step 1 runs (held by the gate)
        second = asyncio.ensure_future(_collect(engine.generate("b", [5], SamplingParams(max_tokens=1))))
        await asyncio.sleep(0.05)  # b's add is queued while step 1 runs
        for _ in range(3):
            gate.release()
        return await asyncio.wait_for(first, 10), await asyncio.wait_for(second, 10)

    try:
        a, b = asyncio.run(main())
        assert fake.steps == [["a"], ["a", "b"], ["a"]]
        assert b[-1].finished and b[-1].outputs[0].token_ids == [6]
        assert [t for o in a for t in o.outputs[0].token_ids] == [1, 2, 3]
    finally:
        assert engine.shutdown(timeout=10)


def test_the_middleware_counts_generation_routes_until_their_add():
    fake = Recording()
    engine = AsyncLLMEngine(fake, gather_seconds=0.0)
    key = web.AppKey("state", object)
    seen: dict[str, list[int]] = {}

    async def generation(request: web.Request) -> web.Response:
        name = request.path
        seen[name] = [engine._arrivals.pending]
        await _collect(engine.generate(name, [0], SamplingParams(max_tokens=1)))
        seen[name].append(engine._arrivals.pending)
        return web.json_response({})

    async def main():
        app = web.Application(middlewares=[arrivals.middleware(key)])
        app[key] = types.SimpleNamespace(engine=engine)
        app.router.add_post("/v1/completions", generation)
        app.router.add_post("/tokenize", generation)
        async with TestClient(TestServer(app)) as client:
            for path in ("/v1/completions", "/tokenize"):
                assert (await client.post(path, json={})).status == 200
        app2 = web.Application(middlewares=[arrivals.middleware(key)])
        app2[key] = types.SimpleNamespace(engine=None)  # still loading: passed through
        app2.router.add_post("/v1/completions", lambda request: asyncio.sleep(0, web.json_response({})))
        async with TestClient(TestServer(app2)) as client:
            assert (await client.post("/v1/completions", json={})).status == 200

    try:
        asyncio.run(main())
        assert seen == {"/v1/completions": [1, 0], "/tokenize": [0, 0]}
    finally:
        assert engine.shutdown(timeout=10)
