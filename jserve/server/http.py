"""The listening socket and its connection-level limits: timeouts and a cap on open connections.

- keep-alive timeout: aiohttp closes a connection that has sent no complete request headers for
  this long, counted from when it opened or from its last response. The same timer is the
  header read timeout: a client trickling its headers byte by byte is cut off by it.
- body timeout: a request's body must arrive whole within it (`body.read_json`), else 408 and the
  connection is closed.
- write timeout: a write to a client that stopped reading must drain within it, else its
  request is aborted (its pages freed) and the connection dropped (`generate._send`).
- max connections: past it a new connection gets a 503 and is closed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

from aiohttp import web

from jserve.server.errors import error_body

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Connection limits, in seconds (0: none) and connections."""

    keepalive: float = 15.0
    body: float = 30.0
    write: float = 30.0
    max_connections: int = 1024

    def runner_kwargs(self) -> dict:
        """`web.AppRunner` keyword arguments for these limits. After an early answer (408, 413)
        aiohttp reads and drops what is left of the body before closing, so that the client sees
        the answer rather than a reset; 1 s of that (aiohttp's default: 10 s), not more."""
        return dict(handler_cancellation=True, keepalive_timeout=self.keepalive or 3630.0, lingering_time=1.0)


_REFUSAL = json.dumps(error_body(503, "too many open connections; retry later", code="too_many_connections")).encode()


class _Refuse(asyncio.Protocol):
    """Answers one 503 and closes: a connection over the cap never reaches aiohttp."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))
        transport.close()


class CappedSite(web.TCPSite):
    """A TCPSite that answers connections past `max_connections` (0: no cap) with a 503."""

    __slots__ = ("_max_connections", "_num_refused")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int):
        super().__init__(runner, host, port, reuse_address=True)
        self._max_connections = max_connections
        self._num_refused = 0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        if self._max_connections and len(server.connections) >= self._max_connections:
            self._num_refused += 1
            if self._num_refused in (1, 10, 100) or self._num_refused % 1000 == 0:
                logger.warning("refused %d connections over the cap of %d", self._num_refused, self._max_connections)
            return _Refuse()
        return server()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (cleanup stops it)
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
