"""The middleware that tells the engine a generation request is on its way (`AsyncLLMEngine.expect`,
`jserve.engine.arrivals`): from the moment its route starts reading it until its add is queued,
so that the first step after an idle spell waits for requests that came together."""

from __future__ import annotations

from aiohttp import web

# The routes whose requests become engine requests.
ENGINE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def middleware(state_key: web.AppKey) -> object:
    @web.middleware
    async def expect_arrivals(request: web.Request, handler) -> web.StreamResponse:
        expect = getattr(request.app[state_key].engine, "expect", None)  # None: no engine yet
        if request.method != "POST" or request.path not in ENGINE_PATHS or expect is None:
            return await handler(request)
        with expect():
            return await handler(request)

    return expect_arrivals
