"""Soak `jserve serve`: normal traffic beside abusive clients for N minutes, then a verdict table.

Starts the server on a free 127.0.0.1 port (the default model unless `--model`; extra
`jserve serve` flags after `--`), with two API keys, or drives one already running (`--url`,
`--pid` for its memory, `--api-key` x2), loopback only. For `--minutes`, normal clients send
completions and chats (plain and streamed, two tenants) and check each answer; abusive clients
cycle through: headers or a body trickled byte by byte, a 3.6 MB prompt, lone surrogates (raw
and escaped), duplicate keys, unsupported fields, out-of-vocabulary stop ids, `priority`, long
and many stop strings, too many logprobs, `n=64`, a stream nobody reads, a dropped stream, a
burst of idle connections, and one tenant probing another's prefix cache. Then it waits for the
server to go idle and reports:

- 5xx: answers with a 5xx status (seen by clients, and in the server's own /metrics);
- lost: requests that got no complete answer (no response, a cut stream, no [DONE]);
- wrong: answers other than the one expected (e.g. 200 for a body that must be refused, or a
  cache hit across tenants);
- pages leaked: KV pages in use once nothing is in flight;
- RSS growth: of the server process, from the end of the first minute to the end.

Target: 0, 0, 0, 0 and under 5 %. Exit status 0 when every target is met.

    python -m benchmarks.serving.soak --minutes 3
    python -m benchmarks.serving.soak --minutes 10 -- --max-model-len 1024 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import sys
import time
import urllib.parse
import urllib.request

from benchmarks.harness import ServerProcess, parser
from benchmarks.soak_clients import TIMEOUT, Soak, Tally

KEYS = ("soak-tenant-a", "soak-tenant-b")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def server_flags(args: argparse.Namespace) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "{port}", "--keepalive-timeout", str(TIMEOUT), "--body-timeout",
            str(TIMEOUT), "--write-timeout", str(TIMEOUT), *(["--model", args.model] if args.model else []),
            *(args.serve_args or ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"])]


async def soak(url: str, keys: tuple[str, str], minutes: float, pid: int | None, normal_clients: int) -> dict:
    tally = Tally()
    start = time.monotonic()
    s = Soak(url, keys, start + minutes * 60, tally)
    rss: list[tuple[float, int]] = []

    async def sample():
        while s.running():
            if pid:
                rss.append((time.monotonic() - start, await asyncio.to_thread(rss_bytes, pid)))
            await asyncio.sleep(5)

    async def progress():
        while s.running():
            await asyncio.sleep(30)
            print(f"  {time.monotonic() - start:5.0f} s: {tally.total('ok')} ok, {tally.total('5xx')} 5xx, "
                  f"{tally.total('lost')} lost, {tally.total('wrong')} wrong", flush=True)

    jobs = [s.normal(i % 2) for i in range(normal_clients)] + [s.abusive(), s.slow_clients(), s.connection_bursts(),
                                                                s.cache_probe(), sample(), progress()]
    await asyncio.gather(*jobs)
    if pid:
        rss.append((time.monotonic() - start, await asyncio.to_thread(rss_bytes, pid)))
    return {"tally": tally, "rss": rss, "seconds": time.monotonic() - start}


def status_counts(m: dict[str, float]) -> collections.Counter:
    """Requests the server counted, by status (from /metrics)."""
    statuses: collections.Counter = collections.Counter()
    for k, v in m.items():
        found = re.match(r'jserve_requests_total\{route="([^"]*)",status="(\d+)"\}', k)
        if found:
            statuses[found.group(2)] += int(v)
    return statuses


def verdict(url: str, result: dict, before: collections.Counter) -> bool:
    tally, rss = result["tally"], result["rss"]
    deadline = time.monotonic() + 60  # the unread streams and dropped clients must all be let go
    m = metrics(url)
    busy = ("jserve_num_requests_in_flight", "jserve_kv_pages_used")
    while any(m.get(name, 0) for name in busy) and time.monotonic() < deadline:
        time.sleep(1)
        m = metrics(url)
    statuses = status_counts(m)
    statuses.subtract(before)  # not the 503s /health gave while it warmed up
    server_5xx = sum(v for k, v in statuses.items() if k.startswith("5"))

    print(f"\nper client kind ({result['seconds']:.0f} s):")
    outcomes = ("ok", "429", "wrong", "5xx", "lost")
    print(f"  {'client':<24}" + "".join(f"{o:>8}" for o in outcomes))
    for kind in sorted(tally.rows):
        print(f"  {kind:<24}" + "".join(f"{tally.rows[kind][o]:>8}" for o in outcomes))
    print("  server status codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()) if v))
    for note in tally.notes:
        print("  note:", note)

    growth = None
    if rss:
        after_first = [r for t, r in rss if t >= 60] or [rss[-1][1]]
        base, last = after_first[0], rss[-1][1]
        growth = 100.0 * (last - base) / base if base else 0.0
    rows = [
        ("5xx answers (clients)", tally.total("5xx"), "0", tally.total("5xx") == 0),
        ("5xx answers (server /metrics)", int(server_5xx), "0", server_5xx == 0),
        ("requests lost", tally.total("lost"), "0", tally.total("lost") == 0),
        ("wrong answers", tally.total("wrong"), "0", tally.total("wrong") == 0),
        ("requests in flight at the end", int(m.get("jserve_num_requests_in_flight", 0)), "0",
         m.get("jserve_num_requests_in_flight", 0) == 0),
        ("KV pages leaked", int(m.get("jserve_kv_pages_used", 0)), "0", m.get("jserve_kv_pages_used", 0) == 0),
        ("RSS growth after the first minute",
         "n/a" if growth is None else f"{growth:+.2f} % ({base / 2**20:.0f} -> {last / 2**20:.0f} MiB)",
         "< 5 %", growth is None or growth < 5.0),
        ("requests answered as expected", tally.total("ok"), "> 0", tally.total("ok") > 0),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n  {'check':<{width}}  {'value':>34}  {'target':>7}  ok")
    for name, value, target, ok in rows:
        print(f"  {name:<{width}}  {str(value):>34}  {target:>7}  {'yes' if ok else 'NO'}")
    return all(r[3] for r in rows)


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--normal-clients", type=int, default=4)
    p.add_argument("--url", default=None, help="a running server (127.0.0.1 only); default: start one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    p.add_argument("--api-key", action="append", default=None, help="with --url: two keys (two tenants)")
    p.add_argument("--model", default=None, help="the model of the server it starts (default: jserve's)")
    p.add_argument("--server-log", default="soak_server.log", help="stderr of the server it starts")
    p.add_argument("--warmup-timeout", type=float, default=1800.0)
    p.add_argument("serve_args", nargs="*", help="after --: more `jserve serve` flags")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 120:
        p.error("--minutes must be in (0, 120]")
    server = None
    if args.url:
        host = urllib.parse.urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            p.error("--url must be a loopback address")
        url, pid = args.url.rstrip("/"), args.pid
        keys = tuple((args.api_key or []) + ["", ""])[:2]
    else:
        server = ServerProcess(command=[sys.executable, "-m", "jserve.cli", "serve", *server_flags(args)],
                               env={"JSERVE_API_KEY": ",".join(KEYS)}, log=args.server_log,
                               timeout=args.warmup_timeout)
        print("starting:", " ".join(server.command), flush=True)
        server.start()
        url, pid, keys = server.url, server.pid, KEYS
        print(f"healthy after {server.startup_s:.0f} s", flush=True)
    ok = False
    try:
        print(f"soaking for {args.minutes:g} min", flush=True)
        before = status_counts(metrics(url))
        result = asyncio.run(soak(url, keys, args.minutes, pid, args.normal_clients))
        ok = verdict(url, result, before)
    finally:
        if server is not None:
            code = server.stop(90)
            print(f"  server exit status after SIGTERM: {code}")
            ok = ok and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
