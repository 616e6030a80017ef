"""Where the time to the first token goes for short prompts at low load, stage by stage.

Each variant is a `jserve serve` in a child process of this module (`--child`), which wraps a few
server and engine functions to stamp each request with `time.monotonic()` (one clock across
processes on Linux) as it passes them; the client stamps its send and the first SSE event it
reads. Rounds of C concurrent streaming `/v1/completions` of one short prompt (max_tokens small,
eos ignored, greedy) go to each variant in turn, the server idle between rounds, so the variants
see the same machine. Per variant and concurrency: the client's TTFT p50 and the median of each
stage, each request's stamps in the JSON, and the median over rounds of each round's TTFT p50 over
the first variant's in that round (`vs_FIRST`: the side-by-side figure on a noisy machine).

Stages (a request's, in order): `http` client send -> the route's handler runs (connection, HTTP
parse); `parse` reading and validating the body; `tokenize`; `submit` the rest of the route until
the engine's add command is queued; `handover` queued -> taken by the engine thread; `sched` taken
-> the step that computes its prompt starts (a running step, a step boundary); `prefill` that
step (plan, device call, sampling, update); `post` step end -> its output posted to the event
loop; `wake` posted -> the stream reads it; `write` the SSE chunk built and written; `client` ->
the client reads it. `steps` counts the engine steps run from the request's arrival to its
first token; `rows`/`tokens` the first-token step's.

    python -m benchmarks.serving.ttft_breakdown --concurrency 1 4 --rounds 8 --out ttft.json
    python -m benchmarks.serving.ttft_breakdown --variants before=/tmp/base now=. --rounds 8
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.harness import ServerProcess, parser, report

PROMPT = "The quick brown fox jumps over the lazy dog and then"  # 11 tokens (12 with a BOS)
STAGES = ("http", "parse", "tokenize", "submit", "handover", "sched", "prefill", "post", "wake", "write", "client")
# (stage, stamp it starts at, stamp it ends at)
_BOUNDS = [("http", "sent", "route"), ("parse", "route", "parsed"), ("tokenize", "parsed", "tokenized"),
           ("submit", "tokenized", "submitted"), ("handover", "submitted", "taken"),
           ("sched", "taken", "step_start"), ("prefill", "step_start", "step_end"), ("post", "step_end", "posted"),
           ("wake", "posted", "delivered"), ("write", "delivered", "written"), ("client", "written", "first_byte")]


# ------------------------------------------------------------------------------ the child (server side)

def instrument(out_path: str) -> None:
    """Wrap the server's and engine's functions to stamp each request; one JSON line per request
    (after it ends) to `out_path`."""
    from jserve.core.scheduler import Scheduler
    from jserve.engine import async_engine, stream_output
    from jserve.engine.llm_engine import LLMEngine
    from jserve.server import app, generate, protocol

    current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ttft_stamps", default=None)
    by_rid: dict[str, dict] = {}  # engine request id -> its stamps
    steps = {"n": 0, "now": None}
    out = open(out_path, "a", buffering=1)

    def stamp(stamps: dict | None, key: str) -> None:
        if stamps is not None and key not in stamps:
            stamps[key] = time.monotonic()

    def wrap(owner: Any, name: str, make) -> None:
        setattr(owner, name, make(getattr(owner, name)))

    def route(orig):
        async def completions(request):
            stamps = {"route": time.monotonic(), "id": request.headers.get("X-Request-Id")}
            current.set(stamps)
            try:
                return await orig(request)
            finally:
                rid = stamps.get("rid")
                timings = request.app[app.STATE].engine.request_timings(rid) if rid else None
                if timings is not None:
                    stamps.update(arrival=timings.arrival_time, scheduled=timings.first_scheduled_time,
                                  first_token=timings.first_token_time)
                by_rid.pop(rid, None)
                out.write(json.dumps(stamps) + "\n")
        return completions

    def after(key: str):
        def make(orig):
            if asyncio.iscoroutinefunction(orig):
                async def wrapped(*a, **k):
                    result = await orig(*a, **k)
                    stamp(current.get(), key)
                    return result
            else:
                def wrapped(*a, **k):
                    result = orig(*a, **k)
                    stamp(current.get(), key)
                    return result
            return wrapped
        return make

    def submit(orig):
        def _submit(self, command, *a, **k):
            stamps = current.get()
            if command.kind == "add" and stamps is not None:
                stamps["rid"] = command.request_id
                by_rid[command.request_id] = stamps
                stamp(stamps, "submitted")
            return orig(self, command, *a, **k)
        return _submit

    def apply(orig):  # taken by the engine thread; the steps it has run so far
        def _apply(self, command):
            if command.kind == "add" and command.request_id in by_rid:
                stamp(by_rid[command.request_id], "taken")
                by_rid[command.request_id]["arrival_step"] = steps["n"]
            return orig(self, command)
        return _apply

    def step(orig):
        def wrapped(self):
            steps["n"] += 1
            steps["now"] = {"n": steps["n"], "t0": time.monotonic()}
            result = orig(self)
            steps["now"]["t1"] = time.monotonic()
            return result
        return wrapped

    def schedule(orig):
        def wrapped(self):
            plan = orig(self)
            now = steps["now"]
            for c in plan.chunks:
                stamps = by_rid.get(c.request.request_id)
                if stamps is not None and c.start == 0 and now is not None:
                    stamps.setdefault("step_start", now["t0"])
                    stamps.setdefault("first_step", now["n"])
                if stamps is not None and c.emits_token and "rows" not in stamps:
                    stamps.update(rows=len(plan.chunks), tokens=sum(ch.num_tokens for ch in plan.chunks),
                                  token_step=steps["n"])
            return plan
        return wrapped

    def dispatch(orig):
        def _dispatch(self, outputs):
            now = time.monotonic()
            for o in outputs:
                stamps = by_rid.get(o.request_id)
                if stamps is not None and "posted" not in stamps:
                    stamps["posted"] = now
                    if steps["now"] is not None:
                        stamps["step_end"] = steps["now"].get("t1", now)
            return orig(self, outputs)
        return _dispatch

    def tracker_next(orig):
        def wrapped(self, item):
            if not isinstance(item, BaseException):
                stamp(by_rid.get(item.request_id), "delivered")
            return orig(self, item)
        return wrapped

    wrap(app, "completions", route)
    wrap(protocol, "parse_completion", after("parsed"))
    wrap(app, "_encode", after("tokenized"))
    wrap(generate._Generation, "_send_chunks", after("written"))
    wrap(async_engine.AsyncLLMEngine, "_submit", submit)
    wrap(async_engine.AsyncLLMEngine, "_apply", apply)
    wrap(async_engine.AsyncLLMEngine, "_dispatch", dispatch)
    wrap(stream_output.Tracker, "next", tracker_next)
    wrap(LLMEngine, "step", step)
    wrap(Scheduler, "schedule", schedule)


def child(argv: list[str]) -> int:
    """`--child OUT serve-args...`: a `jserve serve` with `instrument(OUT)`."""
    instrument(argv[0])
    from jserve.cli import main as jserve_main

    return jserve_main(["serve", *argv[1:]])


# ------------------------------------------------------------------------------ the client

async def _one(session, url: str, rid: str, max_tokens: int) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    sent = time.monotonic()
    first = None
    async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: "):
                first = time.monotonic()
    return {"id": rid, "sent": sent, "first_byte": first}


async def _round(url: str, prefix: str, c: int, max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*[_one(session, url, f"{prefix}-{i}", max_tokens) for i in range(c)])


def _read_stamps(path: str) -> dict[str, dict]:
    try:
        with open(path) as f:
            return {s["id"]: s for s in map(json.loads, f) if s.get("id")}
    except FileNotFoundError:
        return {}


def stages_of(s: dict) -> dict[str, float | None]:
    """A request's stages in ms (None where a stamp is missing)."""
    out = {}
    for name, a, b in _BOUNDS:
        out[name] = 1000 * (s[b] - s[a]) if s.get(a) is not None and s.get(b) is not None else None
    out["ttft"] = 1000 * (s["first_byte"] - s["sent"])
    out["steps"] = (s["token_step"] - s["arrival_step"]) if s.get("token_step") and s.get("arrival_step") is not None \
        else None
    return out


def _round_ttfts(requests: list[dict], r: int) -> list[float]:
    return [g["first_byte"] - g["sent"] for g in requests if g["id"].rsplit("-", 2)[-2] == f"r{r}"]


def summarize(name: str, c: int, requests: list[dict]) -> dict:
    row: dict[str, Any] = {"variant": name, "c": c, "n": len(requests)}
    per = [stages_of(r) for r in requests]
    for key in ("ttft", *STAGES, "steps"):
        values = [p[key] for p in per if p[key] is not None]
        row[key if key != "ttft" else "ttft_p50"] = round(statistics.median(values), 2) if values else None
    rows = [r.get("rows") for r in requests if r.get("rows")]
    row["rows"] = statistics.median(rows) if rows else None
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = parser(__doc__, out="")
    p.add_argument("--variants", nargs="+", default=["now=."],
                   help="NAME=TREE: serve the jserve of checkout TREE (its PYTHONPATH); '.' is this one")
    p.add_argument("--serve-args", default="", help="flags for jserve serve (every variant)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=8, help="measured rounds per variant and concurrency")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pause", type=float, default=0.3, help="seconds idle between rounds")
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    servers, logs = {}, {}
    import shlex
    import tempfile

    try:
        for spec in args.variants:
            name, _, tree = spec.partition("=")
            logs[name] = tempfile.mkstemp(prefix=f"ttft-{name}-", suffix=".jsonl")[1]
            path = os.pathsep.join(dict.fromkeys([os.path.abspath(tree or "."), here]))
            command = [sys.executable, "-P", "-m", "benchmarks.serving.ttft_breakdown", "--child", logs[name],
                       "--port", "{port}", *shlex.split(args.serve_args)]
            servers[name] = ServerProcess(command=command, env={"PYTHONPATH": path}, wait_warm=900).start()
        clients: dict[tuple[str, int], list[dict]] = {}
        for r in range(-1, args.rounds):  # round -1 warms each server's path up, unmeasured
            for c in args.concurrency:
                for name, server in servers.items():
                    got = asyncio.run(_round(server.url, f"{name}-c{c}-r{r}", c, args.max_tokens))
                    if r >= 0:
                        clients.setdefault((name, c), []).extend(got)
                    time.sleep(args.pause)
    finally:
        for server in servers.values():
            server.stop()
    rows, requests = [], {}
    for (name, c), got in clients.items():
        stamps = _read_stamps(logs[name])
        merged = [{**stamps.get(g["id"], {}), **g} for g in got]
        requests[f"{name} c={c}"] = merged
        rows.append(summarize(name, c, merged))
    rows.sort(key=lambda row: (row["c"], list(servers).index(row["variant"])))
    first = list(servers)[0]
    for row in rows:  # each round's TTFT p50 over the first variant's in the same round: the median ratio
        ratios = [statistics.median(_round_ttfts(requests[f"{row['variant']} c={row['c']}"], r)) /
                  statistics.median(_round_ttfts(requests[f"{first} c={row['c']}"], r)) for r in range(args.rounds)]
        row[f"vs_{first}"] = round(statistics.median(ratios), 3)
    report(rows, args.out, title=f"TTFT breakdown, ms (medians over {args.rounds} rounds; load "
           f"{os.getloadavg()[0]:.1f})", serve_args=args.serve_args, variants=args.variants,
           max_tokens=args.max_tokens, prompt=PROMPT, load_average=os.getloadavg(), requests=requests, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
