"""The server's log: timestamped lines (or JSON objects, one a line) and a periodic stats line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

logger = logging.getLogger("jserve.stats")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                 + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    """The root logger at `level`, writing `fmt` lines to stderr (replacing earlier handlers)."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level must be one of {LEVELS} and format one of {FORMATS}, got {level!r}, {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # requests: --enable-log-requests


class StatsLine:
    """Every `interval` seconds while requests run (and once after they stop), one line: computed
    tokens per second, requests finished, running and waiting sequences, KV use, prefix-cache hit
    rate and preemptions over the interval (vLLM's "Avg prompt throughput ..." line)."""

    def __init__(self, stats: Callable[[], Awaitable[dict[str, Any]]], finished: Callable[[], int],
                 interval: float = 10.0):
        self.stats, self.finished, self.interval = stats, finished, interval
        self._last: dict[str, float] | None = None

    async def _snapshot(self) -> dict[str, float]:
        s = await self.stats()
        return {"time": time.monotonic(), "tokens": s.get("computed_tokens", 0), "finished": self.finished(),
                "hits": s.get("prefix_cache_hit_tokens", 0), "queries": s.get("prefix_cache_query_tokens", 0),
                "preemptions": s.get("num_preemptions", 0), "running": s.get("num_running", 0),
                "waiting": s.get("num_waiting", 0), "used": s.get("pages_in_use", 0),
                "pages": s.get("num_pages", 0) or 1}

    async def line(self) -> str | None:
        """The interval's line (None when nothing ran in it, or on the first call), and start the
        next interval."""
        now, last = await self._snapshot(), self._last
        self._last = now
        if last is None or (now["tokens"] == last["tokens"] and not now["running"] and not now["waiting"]):
            return None
        seconds = max(now["time"] - last["time"], 1e-9)
        queries = now["queries"] - last["queries"]
        hit_rate = 100.0 * (now["hits"] - last["hits"]) / queries if queries else 0.0
        return (f"{(now['tokens'] - last['tokens']) / seconds:.1f} tokens/s computed, "
                f"{now['finished'] - last['finished']} requests finished; running {now['running']}, "
                f"waiting {now['waiting']}; KV cache {100.0 * now['used'] / now['pages']:.1f} % used; "
                f"prefix cache hit rate {hit_rate:.1f} %; {now['preemptions'] - last['preemptions']} preemptions")

    async def run(self) -> None:
        await self.line()
        while True:
            await asyncio.sleep(self.interval)
            try:
                text = await self.line()
            except Exception:  # noqa: BLE001 - the stats line never takes the server down
                logger.exception("stats line failed")
                continue
            if text:
                logger.info(text)
