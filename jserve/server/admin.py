"""Management routes behind the admin key (`--admin-key` / $JSERVE_ADMIN_KEY; without one they do
not exist: 404), as vLLM names them in its dev mode, plus weight updates:

    POST /sleep?level=1|2          free the KV pages; weights to host memory (1) or dropped (2)
    POST /wake_up[?tags=weights&tags=kv_cache]
    GET  /is_sleeping              {"is_sleeping": bool, "level", "weights", "kv_cache"}
    POST /update_weights           {"path": a jserve (Orbax) checkpoint or HF folder, "policy"?}

Each sends `Authorization: Bearer <admin key>` (API keys do not manage the server). While asleep
the generation routes answer 503 "sleeping" (`ServerState.check_ready`).
"""

from __future__ import annotations

import asyncio
import hmac
import os

from aiohttp import web

from jserve.server.body import read_json
from jserve.server.errors import APIError

PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/update_weights", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ADMIN_KEY = web.AppKey("admin_key", bytes)
SERVER = web.AppKey("admin_server_state", object)  # the ServerState (jserve.server.app)


def admin_key(value: str | None) -> str | None:
    """--admin-key, else $JSERVE_ADMIN_KEY (not visible in `ps`); None: no admin routes."""
    return value or os.environ.get("JSERVE_ADMIN_KEY") or None


def register(app: web.Application, state, key: str | None) -> None:
    """Add the admin routes to `app` when a key is given."""
    if not key:
        return
    app[ADMIN_KEY] = key.encode()
    app[SERVER] = state
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/update_weights", update_weights)


def admin_engine(request: web.Request):
    """The engine, once the admin key is checked; 503 while the model loads."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                             request.app[ADMIN_KEY]):
        raise APIError(401, "this route needs the admin key: send 'Authorization: Bearer <admin key>'",
                       code="invalid_admin_key")
    engine = request.app[SERVER].engine
    if engine is None:
        raise APIError(503, "the model is loading and warming up; retry shortly", code="warming_up")
    return engine


async def as_400(coro) -> None:
    try:
        return await coro
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def sleep(request: web.Request) -> web.Response:
    engine = admin_engine(request)
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise APIError(400, f"level must be 1 or 2, got {raw!r}", param="level")
    await as_400(engine.sleep(int(raw), policy=request.query.get("policy")))
    return web.json_response({"is_sleeping": True, "level": int(raw)})


async def wake_up(request: web.Request) -> web.Response:
    engine = admin_engine(request)
    tags = request.query.getall("tags", None)
    await as_400(engine.wake_up(tags))
    return web.json_response({"is_sleeping": engine.is_sleeping})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response(admin_engine(request).sleep_state())


async def update_weights(request: web.Request) -> web.Response:
    """Read the checkpoint on a thread (off the event loop and the engine thread), then swap."""
    from jserve.engine.weights import load_weights

    engine = admin_engine(request)
    body = await read_json(request, request.app[SERVER].timeouts.body)
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise APIError(400, f"'path' must be a checkpoint folder on the server, got {path!r}", param="path")
    unknown = sorted(set(body) - {"path", "policy"})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}: give 'path' and optionally 'policy'", param=unknown[0])
    dtype = engine.served_dtype
    try:
        weights = await asyncio.to_thread(load_weights, path, dtype)
    except (ValueError, OSError) as e:
        raise APIError(400, f"cannot read weights from {path!r}: {e}", param="path") from None
    timings = await as_400(engine.update_weights(weights, policy=body.get("policy")))
    return web.json_response({"updated": True, **{k: round(v, 4) for k, v in timings.items()}})

