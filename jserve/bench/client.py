"""The benchmark's HTTP client: streaming OpenAI requests over raw SSE (aiohttp), timed per chunk,
sent at a fixed concurrency and/or with Poisson arrivals.

The client only talks to the given base URL (proxy variables are ignored) and every request has a
timeout; a failed request is recorded with its error, never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from jserve.bench.workloads import RequestSpec


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds, relative to the start of its run."""

    index: int
    kind: str
    max_tokens: int
    input_len_est: int
    model: str = ""
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    content_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    text_chars: int = 0


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


def request_body(spec: RequestSpec, model: str, extra: dict | None = None) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if extra:
        body.update(extra)
    return body


async def _sse_events(resp: aiohttp.ClientResponse):
    """Yield the data of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        if line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class _Failed(Exception):
    """A request's failure: its message becomes the record's `error`."""


async def send_request(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord,
                       t0: float, timeout: float, headers: dict) -> RequestRecord:
    """Send one streaming request and fill `rec` in (its times relative to `t0`); a failure is
    recorded in `rec.error`, never raised."""
    start = time.perf_counter()
    rec.start = start - t0
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:500]
                raise _Failed(f"HTTP {resp.status}: {text}")
            usage = await _read_stream(resp, rec, start)
        end = time.perf_counter()
    except _Failed as e:
        rec.error = str(e)
        return rec
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout:g}s"
        return rec
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: an over-long SSE line
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    return _complete(rec, end - start, usage)


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> dict | None:
    """Read the SSE stream into `rec` (time to the first content, the gaps between content chunks,
    their count and characters); returns the usage the stream carried, if any. Raises _Failed on
    bad data or an error event."""
    last = None
    usage = None
    async for data in _sse_events(resp):
        if data.strip() == "[DONE]":
            break
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise _Failed(f"bad SSE data: {data[:200]}") from None
        if obj.get("error"):
            err = obj["error"]
            raise _Failed(f"stream error: {err.get('message', err) if isinstance(err, dict) else err}")
        if obj.get("usage"):
            usage = obj["usage"]
        text = "".join(_chunk_text(c) for c in obj.get("choices") or [])
        if text:
            now = time.perf_counter()
            if last is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
            rec.content_chunks += 1
            rec.text_chars += len(text)
    return usage


def _complete(rec: RequestRecord, e2e: float, usage: dict | None) -> RequestRecord:
    """`rec` after a stream that ended: its token counts (from `usage`, else one per content
    chunk), server-side timings and time per output token; ok unless no content came."""
    rec.e2e = e2e
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
        for key in ("queue_ms", "prefill_ms", "decode_ms"):
            if usage.get(key) is not None:
                setattr(rec, key, float(usage[key]))
    else:  # server without include_usage: one content chunk ~ one token
        rec.output_tokens = rec.content_chunks
    if rec.ttft is None:
        rec.error = "no content received"
        return rec
    if rec.output_tokens > 1:
        rec.tpot = (rec.e2e - rec.ttft) / (rec.output_tokens - 1)
    rec.ok = True
    return rec


async def fetch_model(args: argparse.Namespace) -> str:
    """The first model the server lists at /v1/models."""
    url = endpoint_url(args.base_url, "completions").rsplit("/", 1)[0] + "/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            resp.raise_for_status()
            data = (await resp.json()).get("data") or []
    if not data:
        raise ValueError(f"{url} lists no models; pass --model")
    return data[0]["id"]


def request_models(args: argparse.Namespace, n: int) -> list[str]:
    """The model each of `n` requests names: `args.model`, or with `args.lora_modules` one of those,
    in turn (`lora_assignment` "round-robin") or at random, seeded by `args.seed`."""
    names = getattr(args, "lora_modules", None)
    if not names:
        return [args.model] * n
    if getattr(args, "lora_assignment", "random") == "round-robin":
        return [names[i % len(names)] for i in range(n)]
    rng = random.Random(args.seed + 2)
    return [rng.choice(names) for _ in range(n)]


async def run_load(specs: list[RequestSpec], args: argparse.Namespace, concurrency: int | None,
                   rate: float | None) -> tuple[list[RequestRecord], float]:
    """Send all ``specs`` at ``concurrency`` (max in flight) and/or Poisson ``rate`` (req/s)."""
    url = endpoint_url(args.base_url, args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = json.loads(args.extra_body) if args.extra_body else None
    models = request_models(args, len(specs))
    records = [RequestRecord(i, s.kind, s.max_tokens, s.input_len, m) for i, (s, m) in enumerate(zip(specs, models))]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in specs:
        arrivals.append(t)
        if rate and math.isfinite(rate):
            t += rng.expovariate(rate)
    # One connection per request: reusing idle keep-alive connections races with servers that
    # close them (one llama-server request failed so: ServerDisconnectedError, never seen by the server).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(specs[i], models[i], extra)
            if sem is None:
                await send_request(session, url, body, records[i], t0, args.request_timeout, headers)
            else:
                async with sem:
                    await send_request(session, url, body, records[i], t0, args.request_timeout, headers)

        await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = time.perf_counter() - t0
    return records, duration

