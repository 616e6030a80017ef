"""Running a validated completions / chat request: one engine stream per prompt, merged, sent as
one JSON body or as SSE chunks in OpenAI's shapes, with usage and jserve timings.

The request is admitted (`Admission`: sequences and tokens) for as long as it runs. Each write (an
SSE event, or a whole JSON body) must drain within the write timeout; a client that stops reading
loses its connection and its request is aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

from jserve.core.request import RequestOutput
from jserve.engine.async_engine import EngineDeadError
from jserve.server import protocol, replies, reply_fields
from jserve.server.errors import APIError
from jserve.server.response_logprobs import TokenIdNames, prompt_logprobs
from jserve.server.tenancy import TENANT, engine_salt
from jserve.server.watchdog import CLIENT_MESSAGE

logger = logging.getLogger(__name__)

# Set on a request whose client went away (the metrics count it as 499).
DISCONNECTED = web.RequestKey("disconnected", bool) if hasattr(web, "RequestKey") else "jserve_disconnected"

if TYPE_CHECKING:
    from jserve.server.app import ServerState


async def _merge(state: "ServerState", rids: list[str], req: protocol.GenerateRequest, salt: str | None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from every prompt's stream as they come; closing this closes
    (so aborts) them all."""
    lora = {} if req.lora_request is None else {"lora_request": req.lora_request}
    gens = [state.engine.generate(rid, ids, req.params, prompt=text, priority=req.priority, cache_salt=salt, **lora)
            for rid, (text, ids) in zip(rids, req.prompts)]
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):  # the cause is in the log, not for clients
        return APIError(503, CLIENT_MESSAGE, code="engine_unavailable", headers={"Retry-After": "10"})
    return APIError(400, str(e))  # ValueError: the engine rejected the request and said why


def _usage(state: "ServerState", rids: list[str], req: protocol.GenerateRequest, choices: dict) -> dict:
    timings = [t for t in map(state.engine.request_timings, rids) if t is not None]

    def ms(name: str) -> float:
        values = [getattr(t, name) for t in timings if getattr(t, name) is not None]
        return round(max(values) * 1000, 3) if values else 0.0

    prompt_tokens = sum(len(ids) for _, ids in req.prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(t.num_cached_tokens for t in timings)},
            "queue_ms": ms("queue_time"), "prefill_ms": ms("prefill_time"), "decode_ms": ms("decode_time")}


def _timing_headers(usage: dict, request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, "x-jserve-queue-ms": str(usage["queue_ms"]),
            "x-jserve-prefill-ms": str(usage["prefill_ms"]), "x-jserve-decode-ms": str(usage["decode_ms"])}


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id (kept, as vLLM keeps it: in the response's id and header and in
    the log), or None; 400 for one that is not 1-128 visible ASCII characters."""
    value = request.headers.get("X-Request-Id")
    if value is None:
        return None
    if not 1 <= len(value) <= 128 or not all("!" <= c <= "~" for c in value):
        raise APIError(400, f"X-Request-Id must be 1 to 128 visible ASCII characters, got {value[:140]!r}",
                       param="X-Request-Id")
    return value


async def run_generation(request: web.Request, state: "ServerState",
                         req: protocol.GenerateRequest) -> web.StreamResponse:
    gen = _Generation(request, state, req)
    if state.log_requests:
        logger.info("request %s: %s%s, %d prompt(s) of %s tokens, %s", gen.header_id, request.path,
                    "" if req.lora_request is None else f" with LoRA adapter {req.lora_request.lora_name!r}",
                    len(req.prompts), ", ".join(str(len(ids)) for _, ids in req.prompts if ids is not None) or "?",
                    req.params)
    gen.admit()
    salt = engine_salt(request.get(TENANT, ""), req.cache_salt)
    try:
        if not await gen.stream(salt):
            return gen.response
        gen.release()
        return await gen.finish()
    except ConnectionResetError:  # the client went away (or stopped reading): closing the stream aborted it
        request[DISCONNECTED] = True
        return gen.response if gen.response is not None else web.Response(status=499)
    finally:
        gen.release()
        if state.log_requests:
            logger.info("request %s done: %s", gen.header_id, ", ".join(
                f"{ch.finish_reason or 'aborted'} after {len(ch.token_ids)} tokens" for ch in gen.choices.values()))


class _Generation:
    """One request's run: its choices as the engine's outputs fill them, its admission, and the
    response (None until its headers go out)."""

    def __init__(self, request: web.Request, state: "ServerState", req: protocol.GenerateRequest):
        self.request, self.state, self.req = request, state, req
        client_id = client_request_id(request)
        self.request_id = ("chatcmpl-" if req.chat else "cmpl-") + (client_id or uuid.uuid4().hex)
        self.header_id = client_id or self.request_id  # the response's X-Request-Id
        # Engine ids stay unique when two clients send the same X-Request-Id.
        unique = f"{self.request_id}-{uuid.uuid4().hex[:8]}" if client_id else self.request_id
        self.rids = [f"{unique}-{i}" for i in range(len(req.prompts))]
        self.n = n = req.params.n
        self.choices: dict[int, replies.Choice] = {}
        for p, (text, ids) in enumerate(req.prompts):
            prefix = (text if text is not None else state.tokenizer.decode(ids)) if req.echo else ""
            for i in range(n):
                self.choices[p * n + i] = replies.Choice(p * n + i, prefix, replies.tool_parser(req), req.reasoning)
                self.choices[p * n + i].prompt_token_ids = ids
        created = int(time.time())
        self.head = {"id": self.request_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
                     "created": created, "model": state.model_name if req.lora_request is None
                     else req.lora_request.lora_name}
        self.tok = TokenIdNames(state.tokenizer) if req.tokens_as_ids else state.tokenizer
        self.prompt_ids_sent = False  # a chat stream's first chunk carries them (return_token_ids)
        self.scored: dict[int, list] = {}  # prompt index -> its prompt logprobs (None first), when asked for
        self.admission = (req.num_seqs, req.cost_tokens(state.ctx.limits.max_total_tokens))
        self.released = False
        self.write_timeout = state.timeouts.write
        self.response: web.StreamResponse | None = None
        self.last_time: float | None = None

    def admit(self) -> None:
        self.state.begin_request(*self.admission)

    def release(self) -> None:
        """Give the admission back, once: when the engine is done with the request (its last
        writes may then wait on the client without holding a place)."""
        if not self.released:
            self.released = True
            self.state.end_request(*self.admission)

    async def stream(self, salt: str | None) -> bool:
        """Run the prompts' engine streams to their end, sending SSE chunks when streaming. False:
        an engine error ended it after the headers went out (sent as an error event, then [DONE]);
        before them the error is raised as an APIError."""
        async with contextlib.aclosing(_merge(self.state, self.rids, self.req, salt)) as stream:
            try:
                async for p, out in stream:
                    self._observe_itl()
                    chunks = self._absorb(p, out)
                    if self.req.stream and chunks:
                        await self._send_chunks(chunks)
            except (ValueError, EngineDeadError) as e:
                error = _engine_error(e)
                if self.response is None:
                    raise error from None
                await _send(self.request, self.response, error.body(), self.write_timeout)
                await _write(self.request, self.response, b"data: [DONE]\n\n", self.write_timeout)
                return False
        return True

    def _observe_itl(self) -> None:
        now = time.monotonic()
        if self.last_time is not None:
            self.state.metrics.observe_itl(now - self.last_time)
        self.last_time = now

    def _absorb(self, p: int, out: RequestOutput) -> list[dict]:
        """Add prompt `p`'s delta output to its choices; the SSE chunks it makes when streaming."""
        chunks = []
        if out.prompt_logprobs is not None:
            # The engine's own list, whole once the sample that scores the prompt (the first admitted)
            # ends its prefill, which comes no later than any sample's first output.
            self.scored.setdefault(p, out.prompt_logprobs)
        for c in out.outputs:
            ch = self.choices[p * self.n + c.index]
            offset = len(ch.prefix) + len(ch.text)
            ch.text += c.text
            ch.token_ids += c.token_ids
            if c.logprobs is not None:
                ch.logprobs += c.logprobs
            ch.finish_reason = c.finish_reason
            ch.stop_reason = c.stop_reason
            if self.req.stream:
                chunk = replies.chunk(self.req, ch, c, offset, self.tok, self._scored(p))
                if chunk is not None:
                    reply_fields.stream_extras(self.req, ch, chunk)
                    chunks.append(chunk)
        return chunks

    async def _send_chunks(self, chunks: list[dict]) -> None:
        if self.response is None:  # headers go out with the first output: errors before it get a status
            self.response = await _start_sse(self.request, self.header_id, self.write_timeout)
        for chunk in chunks:
            extra = _null_usage(self.req)
            if self.req.continuous_usage:
                extra = {"usage": reply_fields.chunk_usage(self.choices[chunk["index"]])}
            if self.req.chat and self.req.return_token_ids and not self.prompt_ids_sent:
                extra["prompt_token_ids"], self.prompt_ids_sent = self.req.prompts[0][1], True
            await _send(self.request, self.response, {**self.head, "choices": [chunk], **extra}, self.write_timeout)

    async def finish(self) -> web.StreamResponse:
        """After the engine is done: the metrics' timings, then the JSON body with usage, or the
        stream's usage chunk (if asked for) and end."""
        req, request, timeout = self.req, self.request, self.write_timeout
        usage = _usage(self.state, self.rids, req, self.choices)
        self._observe_timings()
        if not req.stream:
            choices = [replies.final_choice(req, ch, self.tok, self._scored(i // self.n))
                       for i, ch in self.choices.items()]
            for ch, choice in zip(self.choices.values(), choices):
                reply_fields.final_extras(req, ch, choice)
            body = {**self.head, "object": "chat.completion" if req.chat else "text_completion", "choices": choices,
                    "usage": usage}
            if req.chat and req.return_token_ids:
                body["prompt_token_ids"] = req.prompts[0][1]
            if req.chat and req.prompt_logprobs is not None:  # vLLM's place for them in a chat reply
                body["prompt_logprobs"] = prompt_logprobs(*self._scored(0), self.tok, req.prompt_logprobs)
            self.response = web.json_response(body, headers=_timing_headers(usage, self.header_id))
            await _bounded(request, self.response.prepare(request), timeout)  # sent here, under the same
            await _bounded(request, self.response.write_eof(), timeout)  # write timeout as a stream
            return self.response
        if self.response is None:
            self.response = await _start_sse(request, self.header_id, timeout)
        if req.include_usage:
            await _send(request, self.response, {**self.head, "choices": [], "usage": usage}, timeout)
        await _write(request, self.response, b"data: [DONE]\n\n", timeout)
        await _bounded(request, self.response.write_eof(), timeout)
        return self.response

    def _scored(self, p: int) -> tuple[list[int], list] | None:
        """Prompt `p`'s ids and logprobs, where the request asked for them."""
        if self.req.prompt_logprobs is None and self.req.echo_logprobs is None:
            return None
        return self.req.prompts[p][1], self.scored[p]

    def _observe_timings(self) -> None:
        for p, rid in enumerate(self.rids):
            timings = self.state.engine.request_timings(rid)
            if timings is not None:
                samples = [len(self.choices[p * self.n + i].token_ids) for i in range(self.n)]
                self.state.metrics.observe_timings(timings, self.req.params, samples)


def _null_usage(req: protocol.GenerateRequest) -> dict:
    return {"usage": None} if req.include_usage else {}


async def _start_sse(request: web.Request, request_id: str, timeout: float) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "x-request-id": request_id})
    await _bounded(request, response.prepare(request), timeout)
    return response


async def _send(request: web.Request, response: web.StreamResponse, obj: dict, timeout: float) -> None:
    await _write(request, response, b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n", timeout)


async def _write(request: web.Request, response: web.StreamResponse, data: bytes, timeout: float) -> None:
    await _bounded(request, response.write(data), timeout)


async def _bounded(request: web.Request, write, timeout: float) -> None:
    """Await `write`; past `timeout` seconds (0: never) the client is not reading: drop the
    connection and raise ConnectionResetError (the caller's stream then aborts the request)."""
    try:
        await asyncio.wait_for(write, timeout or None)
    except asyncio.TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        raise ConnectionResetError(f"the client read nothing for {timeout:g} s") from None
