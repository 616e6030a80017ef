"""The aiohttp application: OpenAI routes, SSE streaming, auth, limits, health, /metrics, draining.

Requests flow: the error middleware (OpenAI-shaped errors for everything) -> the auth middleware
(Bearer keys; /health and /metrics stay open) -> a route, which validates the body
(`protocol`), checks the queue limit, and streams `AsyncLLMEngine.generate` for each prompt.
Leaving a stream early (client gone: handler cancelled or a failed write) aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web

from jserve.async_engine import AsyncLLMEngine, EngineDeadError
from jserve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from jserve.server import protocol
from jserve.server.errors import APIError, bad_request, error_body
from jserve.server.generate import DISCONNECTED, run_generation

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_OPEN_PATHS = ("/health", "/metrics")


class ServerState:
    """What the routes share: the engine once it is ready, limits, keys, metrics, in-flight count.

    Args:
      model_name: the name clients must pass as `model`.
      api_keys: accepted Bearer keys; empty: no auth.
      max_queue: engine requests allowed to wait beyond `max_num_seqs` before answering 429.
    """

    def __init__(self, model_name: str = "jserve", *, api_keys: tuple[str, ...] = (), max_queue: int = 256,
                 metrics: ServerMetrics | None = None):
        self.model_name = model_name
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.engine: AsyncLLMEngine | None = None
        self.tokenizer: Any = None
        self.ctx: protocol.Context | None = None
        self.shutting_down = False
        self.num_in_flight = 0  # engine requests started and not yet finished
        self.created = int(time.time())
        self._idle: asyncio.Event | None = None

    def attach(self, engine: AsyncLLMEngine) -> None:
        """Serve with `engine` (its LLMEngine built and warmed up): the server is now ready."""
        llm = engine.engine
        self.engine = engine
        self.tokenizer = llm.tokenizer
        self.capacity = llm.config.max_num_seqs
        self.ctx = protocol.Context(self.model_name, llm.config.max_model_len, llm.runner.config.vocab_size)
        self.metrics.ready.set(1)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.shutting_down and not self.engine.errored

    def check_ready(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None:
            raise APIError(503, "the model is loading and warming up; retry shortly", code="warming_up",
                           headers={"Retry-After": "5"})
        if self.engine.errored:
            raise APIError(503, f"the engine loop died: {self.engine.error!r}", code="engine_unavailable")

    async def drain(self, grace: float) -> None:
        """Stop taking requests (503), let in-flight ones finish for `grace` seconds, abort the
        rest, and stop the engine thread."""
        self.shutting_down = True
        self.metrics.ready.set(0)
        if self.num_in_flight:
            self._idle = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown, 30.0, abort=True)

    def _begin(self, count: int) -> None:
        if self.num_in_flight + count > self.capacity + self.max_queue:
            raise APIError(429, f"too many requests waiting ({self.num_in_flight} in flight, limit "
                                f"{self.capacity + self.max_queue}); retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self.num_in_flight += count
        self.metrics.in_flight.set(self.num_in_flight)

    def _end(self, count: int) -> None:
        self.num_in_flight -= count
        self.metrics.in_flight.set(self.num_in_flight)
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()


STATE = web.AppKey("state", ServerState)


def build_app(state: ServerState, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The aiohttp app around `state`. Run it with `handler_cancellation=True` so that a client
    that goes away cancels (and so aborts) its request."""
    app = web.Application(middlewares=[_errors, _auth], client_max_size=max_body_bytes)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app


# ------------------------------------------------------------------------------ middlewares

def _route(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        response = await handler(request)
    except APIError as e:
        response = e.response()
    except web.HTTPException as e:  # aiohttp's own: 404 route, 405 method, 413 body too large
        if e.status < 400:
            raise
        response = web.json_response(error_body(e.status, e.reason if e.status != 413 else e.text),
                                     status=e.status)
    except asyncio.CancelledError:
        state.metrics.observe_request(_route(request), 499)  # the client went away
        raise
    except Exception as e:  # noqa: BLE001 - a bug of ours: log it, answer 500 in OpenAI's shape
        logger.exception("error serving %s %s", request.method, request.path)
        response = web.json_response(error_body(500, f"internal error: {type(e).__name__}"), status=500)
    state.metrics.observe_request(_route(request), 499 if request.get(DISCONNECTED) else response.status)
    return response


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    keys = request.app[STATE].api_keys
    if keys and request.path not in _OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8", "replace")
        # compare against every key (no early exit) so timing says nothing about which matched
        ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(given, k) for k in keys) > 0
        if not ok:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
    return await handler(request)


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()  # raises 413 past client_max_size
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    if b"\\u" in raw:  # an escaped lone surrogate would break the tokenizer and our own replies
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise bad_request(f"the body holds an invalid unicode escape (a lone surrogate): {e.reason}") from None
    return body


# ------------------------------------------------------------------------------ simple routes

async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ok"})
    status = "shutting_down" if state.shutting_down else "warming_up" if state.engine is None else "engine_dead"
    return web.json_response({"status": status}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        with contextlib.suppress(EngineDeadError):
            stats = await state.engine.stats()
            records = state.engine.engine.runner.records.copy()  # a C-level copy: safe beside the thread
            state.metrics.update_engine(stats, records)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "jserve",
        "max_model_len": state.ctx.max_model_len}]})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    body = await _json_body(request)
    protocol.check_model(body, state.ctx)
    if "messages" in body:
        add_gen = protocol._bool(body, "add_generation_prompt", True)
        _, ids = protocol.encode_chat(state.tokenizer, protocol.parse_messages(body), add_gen)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string (or give messages), got {protocol._show(prompt)}",
                              param="prompt")
        ids = state.tokenizer.encode(prompt, add_special_tokens=protocol._bool(body, "add_special_tokens", True))
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.ctx.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    body = await _json_body(request)
    protocol.check_model(body, state.ctx)
    tokens = body.get("tokens")
    if tokens == []:
        return web.json_response({"prompt": ""})
    ids = protocol._token_ids(tokens, "tokens", state.tokenizer.vocab_size)
    return web.json_response({"prompt": state.tokenizer.decode(ids)})


# ------------------------------------------------------------------------------ generation

async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.check_ready()
    req = protocol.parse_completion(await _json_body(request), state.ctx, state.tokenizer)
    return await run_generation(request, state, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.check_ready()
    req = protocol.parse_chat(await _json_body(request), state.ctx, state.tokenizer)
    return await run_generation(request, state, req)

