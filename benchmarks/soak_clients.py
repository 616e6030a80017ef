"""The soak's clients (benchmarks/serving/soak.py): normal and abusive traffic, each outcome
counted in a `Tally` by client kind."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import socket
import time
import urllib.parse

TIMEOUT = 5.0  # the keep-alive, body and write timeouts the soak gives the server it starts
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Explain gravity briefly.",
           "Once upon a time there was", "List three colors:"]


class Tally:
    """Outcomes per client kind."""

    def __init__(self):
        self.rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.notes: list[str] = []

    def add(self, kind: str, outcome: str, note: str | None = None) -> None:
        self.rows[kind][outcome] += 1
        if note and len(self.notes) < 20:
            self.notes.append(f"{kind}: {note}")

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.rows.values())


# ------------------------------------------------------------------------------ raw HTTP

async def raw_exchange(host: str, port: int, data: bytes, *, trickle: float = 0.0, read: bool = True,
                       rcvbuf: int | None = None, limit: float = 30.0) -> tuple[bytes, float]:
    """Send `data` (one byte per `trickle` seconds if set), then read until the server closes;
    (what came back, seconds until it closed). Stops trickling once the server answers."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    await loop.sock_connect(sock, (host, port))
    got = b""
    try:
        if trickle:
            for i in range(len(data)):
                try:
                    await loop.sock_sendall(sock, data[i:i + 1])
                except (ConnectionError, BrokenPipeError):
                    break
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), trickle)
                    got += chunk
                    if not chunk or got:
                        break
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - start > limit:
                    break
        else:
            await loop.sock_sendall(sock, data)
        if not read:
            await asyncio.sleep(limit)
            return got, time.monotonic() - start
        while time.monotonic() - start < limit:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), limit - (time.monotonic() - start))
            except (asyncio.TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            got += chunk
        return got, time.monotonic() - start
    finally:
        sock.close()


def http_request(path: str, body: bytes, headers: dict | None = None) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "soak", "Content-Type": "application/json",
                                                  "Content-Length": str(len(body)), "Connection": "close",
                                                  **(headers or {})}.items())
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def status_of(answer: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.1 (\d{3})", answer)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ clients

class Soak:
    def __init__(self, url: str, keys: tuple[str, str], deadline: float, tally: Tally):
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlparse(self.url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.keys = keys
        self.deadline = deadline
        self.tally = tally
        self.rng = random.Random(0)

    def auth(self, tenant: int = 0) -> dict:
        return {"Authorization": f"Bearer {self.keys[tenant]}"} if self.keys[tenant] else {}

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    async def post(self, session, path: str, body, tenant: int = 0, kind: str = "normal"):
        """(status, parsed body or SSE events); None on a transport failure."""
        import aiohttp

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            async with session.post(self.url + path, data=data, headers={"Content-Type": "application/json",
                                                                          **self.auth(tenant)}) as resp:
                if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    events = []
                    async for line in resp.content:
                        line = line.strip()
                        if line:
                            events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
                    return resp.status, events
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.tally.add(kind, "lost", f"{path}: {type(e).__name__}: {e}")
            return None

    async def normal(self, tenant: int) -> None:
        import aiohttp

        kind = f"normal (tenant {'ab'[tenant]})"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            while self.running():
                chat, stream = self.rng.random() < 0.5, self.rng.random() < 0.5
                prompt = self.rng.choice(PROMPTS)
                body = {"max_tokens": self.rng.randint(4, 24), "temperature": self.rng.choice([0, 0.8]),
                        "stream": stream}
                if chat:
                    body["messages"] = [{"role": "user", "content": prompt}]
                else:
                    body["prompt"] = prompt
                path = "/v1/chat/completions" if chat else "/v1/completions"
                got = await self.post(session, path, body, tenant, kind)
                if got is None:
                    continue
                status, answer = got
                if status == 429:
                    self.tally.add(kind, "429")
                    await asyncio.sleep(1)
                elif status >= 500:
                    self.tally.add(kind, "5xx", f"{status} {answer}")
                elif status != 200:
                    self.tally.add(kind, "wrong", f"{status} {answer}")
                elif stream and (not answer or answer[-1] != "[DONE]" or any("error" in e for e in answer[:-1])):
                    self.tally.add(kind, "lost", f"stream ended without [DONE]: {answer[-2:]}")
                elif not stream and not answer.get("choices"):
                    self.tally.add(kind, "wrong", str(answer)[:200])
                else:
                    self.tally.add(kind, "ok")

    async def expect(self, session, kind: str, path: str, body, want: set[int], tenant: int = 0) -> None:
        got = await self.post(session, path, body, tenant, kind)
        if got is None:
            return
        status, answer = got
        if status >= 500:
            self.tally.add(kind, "5xx", f"{status} {str(answer)[:200]}")
        elif status in want:
            self.tally.add(kind, "ok")
        else:
            self.tally.add(kind, "wrong", f"{status} (wanted {sorted(want)}): {str(answer)[:200]}")

    async def abusive(self) -> None:
        import aiohttp

        bad_bodies = [
            ("huge prompt", {"prompt": "hello world, " * 280_000}, {400, 413}),
            ("escaped lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 2}', {400}),
            ("raw surrogate bytes", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', {400}),
            ("invalid UTF-8", b'{"prompt": "a\xff", "max_tokens": 2}', {400}),
            ("duplicate keys", b'{"model": "x", "model": "y", "prompt": "hi"}', {400}),
            ("unsupported field", {"prompt": "hi", "response_format": {"type": "json_object"}}, {400}),
            ("tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, {400}),
            ("stop id past int32", {"prompt": "hi", "stop_token_ids": [2**40]}, {400}),
            ("stop id past vocab", {"prompt": "hi", "stop_token_ids": [10**6]}, {400}),
            ("priority", {"prompt": "hi", "priority": -100}, {400}),
            ("long stop string", {"prompt": "hi", "stop": ["x" * 5000]}, {400}),
            ("many stop strings", {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}, {400}),
            ("too many logprobs", {"prompt": "hi", "logprobs": 50}, {400}),
            ("n=64", {"prompt": "hi", "n": 64, "max_tokens": 16}, {200, 400, 429}),
        ]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            while self.running():
                name, body, want = self.rng.choice(bad_bodies)
                path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
                await self.expect(session, name, path, body, want)
                await asyncio.sleep(0.05)

    async def slow_clients(self) -> None:
        """One at a time: trickled headers, a trickled body, a stream nobody reads, a dropped stream."""
        import aiohttp

        n = 0
        while self.running():
            n += 1
            which = n % 4
            if which == 0:  # headers, a byte every 0.5 s: cut by the keep-alive timeout
                got, took = await raw_exchange(self.host, self.port, http_request("/v1/completions", b"{}" * 64),
                                               trickle=0.5, limit=TIMEOUT * 4)
                ok = took < TIMEOUT * 2 + 2
                self.tally.add("trickled headers", "ok" if ok else "wrong", None if ok else f"open {took:.1f} s")
            elif which == 1:  # a body, a byte every 0.5 s: 408 after the body timeout
                req = http_request("/v1/completions", json.dumps({"prompt": "hi " * 40}).encode(), self.auth())
                head, _, body = req.partition(b"\r\n\r\n")
                got, took = await self._trickle_body(head + b"\r\n\r\n", body)
                status = status_of(got)
                ok = status == 408 and took < TIMEOUT * 2 + 2
                self.tally.add("trickled body", "5xx" if status and status >= 500 else "ok" if ok else "wrong",
                               None if ok else f"status {status} after {took:.1f} s")
            elif which == 2:  # streams ~300 KB of logprobs into a 2 KB window and never reads
                body = json.dumps({"prompt": "Count: 1, 2, 3,", "max_tokens": 128, "n": 2, "logprobs": 20,
                                   "ignore_eos": True, "stream": True}).encode()
                got, took = await raw_exchange(self.host, self.port, http_request("/v1/completions", body, self.auth()),
                                               read=False, rcvbuf=2048, limit=TIMEOUT * 3)
                self.tally.add("stream nobody reads", "ok")  # the verdict is the pages check at the end
            else:  # reads two events, then hangs up
                try:
                    async with aiohttp.ClientSession() as session:
                        async with session.post(self.url + "/v1/completions", headers=self.auth(),
                                                json={"prompt": "Tell me a story", "max_tokens": 200,
                                                      "ignore_eos": True, "stream": True}) as resp:
                            count = 0
                            async for line in resp.content:
                                count += bool(line.strip())
                                if count >= 2:
                                    break
                    self.tally.add("dropped stream", "ok")
                except aiohttp.ClientError as e:
                    self.tally.add("dropped stream", "lost", str(e))
            await asyncio.sleep(0.2)

    async def _trickle_body(self, head: bytes, body: bytes) -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        start = time.monotonic()
        await loop.sock_connect(sock, (self.host, self.port))
        got = b""
        try:
            await loop.sock_sendall(sock, head)
            for i in range(len(body)):
                try:
                    await loop.sock_sendall(sock, body[i:i + 1])
                    chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.5)
                    got += chunk
                    if got or not chunk:
                        break
                except asyncio.TimeoutError:
                    continue
                except ConnectionError:
                    break
                if time.monotonic() - start > TIMEOUT * 4:
                    break
            return got, time.monotonic() - start
        finally:
            sock.close()

    async def connection_bursts(self) -> None:
        """50 idle connections held for 2 s, every 10 s; then a normal request must still work."""
        loop = asyncio.get_running_loop()
        while self.running():
            socks = []
            for _ in range(50):
                s = socket.socket()
                s.setblocking(False)
                try:
                    await loop.sock_connect(s, (self.host, self.port))
                    socks.append(s)
                except OSError:
                    s.close()
            await asyncio.sleep(2)
            for s in socks:
                s.close()
            self.tally.add("idle connection burst", "ok" if len(socks) == 50 else "wrong")
            await asyncio.sleep(8)

    async def cache_probe(self) -> None:
        """Tenant b sends tenant a's fresh prompt: it must see no cached tokens."""
        import aiohttp

        if not (self.keys[0] and self.keys[1]):
            return
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            n = 0
            while self.running():
                n += 1
                prompt = f"Tenant a's private note number {n}: " + "the secret words are " * 8
                body = {"prompt": prompt, "max_tokens": 1}
                first = await self.post(session, "/v1/completions", body, 0, "cross-tenant probe")
                second = await self.post(session, "/v1/completions", body, 1, "cross-tenant probe")
                if first is None or second is None:
                    continue
                if first[0] != 200 or second[0] != 200:
                    self.tally.add("cross-tenant probe", "5xx" if max(first[0], second[0]) >= 500 else "wrong",
                                   f"{first[0]} {second[0]}")
                    continue
                cached = second[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
                self.tally.add("cross-tenant probe", "ok" if cached == 0 else "wrong",
                               None if cached == 0 else f"tenant b saw {cached} cached tokens of tenant a's prompt")
                await asyncio.sleep(1)
