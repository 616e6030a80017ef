"""OpenAI-compatible HTTP server on aiohttp: routes, validation, SSE, errors, auth, /metrics.

`build_app(state)` makes the aiohttp application around a `ServerState`; the state holds the
async engine once the model is loaded and warmed up (until then every route but /health and
/metrics answers 503). `jserve serve` (see `jserve.server.cli`) wires it to a real model.
"""

from jserve.server.app import ServerState, build_app

__all__ = ["ServerState", "build_app"]
