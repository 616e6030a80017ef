#!/usr/bin/env python
"""Online serving benchmark for any OpenAI-compatible server (jserve, vLLM, SGLang, ...).

Drives ``/v1/completions`` or ``/v1/chat/completions`` with streaming requests (raw SSE over
aiohttp), at a fixed concurrency or with Poisson arrivals at a request rate, and reports
throughput, TTFT, TPOT, inter-token latency, end-to-end latency, goodput under SLOs and, when the
server's usage block carries them (jserve does), the split of latency into queue / prefill / decode.

Examples::

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --workload mix --num-requests 64 --concurrency 8
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --workload shared-prefix --endpoint chat --sweep-rate 1,2,4 --output-dir out/
    python scripts/bench_serving.py ... --workload requests.jsonl   # {"prompt", "max_tokens"} or
                                                                     # {"input_len", "output_len"}

Prompts are random words from a fixed vocabulary (seeded by ``--seed``), so input lengths are
approximate (one word is roughly one token); the server's ``usage.prompt_tokens`` gives the exact
count. Output lengths are exact on servers that honour ``ignore_eos`` (jserve, vLLM). The client
only talks to ``--base-url``; it ignores proxy environment variables. Every request has a timeout.

``--output-dir`` writes ``results.json`` (config, per-run metrics and per-request records) and,
when matplotlib is installed, ``cdf_<run>.png`` latency CDFs and ``sweep.png`` for sweeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

# Short, common English words: each is (almost always) one token with a leading space in BPE vocabularies.
_WORDS = (
    "the of and to in is for on that with as it was at by be this are from or an have not they "
    "which one you were all we her she there can has more if will would about out up what so their "
    "time some them into only other new could its then two these may first any like now my over "
    "such our man me even most made after also did many off before must well back through years "
    "much where your way down should because long each just those people how too little state good "
    "very make world still own see men work here take both between life being under never day same "
    "another know while last might us great old year come since against go came right used three "
    "small house part place case point group number home water room mother area money story fact "
    "month lot study book eye job word business issue side kind head far black long both city car "
    "game line end road tree open sea plan stone fire red blue green light night tea sun cat dog"
).split()

# (input_len, output_len) before --scale.
SHORT_IN, LONG_IN, SHORT_OUT, LONG_OUT = 32, 512, 32, 256
WORKLOADS = {
    "short-short": (SHORT_IN, SHORT_OUT),
    "short-long": (SHORT_IN, LONG_OUT),
    "long-short": (LONG_IN, SHORT_OUT),
    "long-long": (LONG_IN, LONG_OUT),
}
NAMED_WORKLOADS = (*WORKLOADS, "mix", "shared-prefix")


@dataclass
class RequestSpec:
    """One request to send: a prompt (completions) or a message list (chat), and its output length."""

    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    input_len: int  # approximate (words), the server's usage.prompt_tokens is exact
    kind: str = ""


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds, relative to the start of its run."""

    index: int
    kind: str
    max_tokens: int
    input_len_est: int
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


# --------------------------------------------------------------------------------------------- workloads


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _spec(endpoint: str, prompt: str, max_tokens: int, input_len: int, kind: str,
          system: str | None = None) -> RequestSpec:
    if endpoint == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return RequestSpec(None, messages, max_tokens, input_len, kind)
    full = f"{system}\n\n{prompt}" if system else prompt
    return RequestSpec(full, None, max_tokens, input_len, kind)


def build_workload(workload: str, num_requests: int | None, endpoint: str, scale: float,
                   seed: int) -> list[RequestSpec]:
    """The requests of a named workload or a JSONL file, deterministic in ``seed``."""
    rng = random.Random(seed)
    if workload in WORKLOADS or workload == "mix":
        n = num_requests or 64
        kinds = list(WORKLOADS) if workload == "mix" else [workload]
        order = [kinds[i % len(kinds)] for i in range(n)]
        rng.shuffle(order)
        specs = []
        for kind in order:
            in_len, out_len = (_scaled(x, scale) for x in WORKLOADS[kind])
            specs.append(_spec(endpoint, _words(rng, in_len), out_len, in_len, kind))
        return specs
    if workload == "shared-prefix":
        n = num_requests or 64
        sys_len, q_len, out_len = _scaled(LONG_IN, scale), _scaled(SHORT_IN, scale), _scaled(SHORT_OUT, scale)
        system = "You are a helpful assistant. " + _words(rng, sys_len)
        return [_spec(endpoint, _words(rng, q_len), out_len, sys_len + q_len, "shared-prefix", system=system)
                for _ in range(n)]
    path = Path(workload)
    if not path.is_file():
        raise SystemExit(f"--workload: {workload!r} is neither one of {', '.join(NAMED_WORKLOADS)} nor a file")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"--workload: {path} has no records")
    n = num_requests or len(records)
    specs = []
    for i in range(n):  # cycle through the file when more requests are asked for than it holds
        rec = records[i % len(records)]
        if "prompt" in rec or "messages" in rec:
            max_tokens = int(rec.get("max_tokens", rec.get("output_len", SHORT_OUT)))
            if "messages" in rec:
                msgs = rec["messages"]
                specs.append(RequestSpec(None if endpoint == "chat" else "\n".join(m["content"] for m in msgs),
                                         msgs if endpoint == "chat" else None, max_tokens,
                                         sum(len(m["content"].split()) for m in msgs), "file"))
            else:
                specs.append(_spec(endpoint, rec["prompt"], max_tokens, len(rec["prompt"].split()), "file"))
        elif "input_len" in rec:
            in_len, out_len = int(rec["input_len"]), int(rec.get("output_len", rec.get("max_tokens", SHORT_OUT)))
            specs.append(_spec(endpoint, _words(rng, in_len), out_len, in_len, "file"))
        else:
            raise SystemExit(f"{path}:{i % len(records) + 1}: need 'prompt' (+ 'max_tokens') or 'input_len' (+ 'output_len')")
    return specs


# --------------------------------------------------------------------------------------------- client


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


async def send_request(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord,
                       t0: float, timeout: float, headers: dict) -> RequestRecord:
    start = time.perf_counter()
    rec.start = start - t0
    last = None
    usage = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:500]
                rec.error = f"HTTP {resp.status}: {text}"
                return rec
            async for data in _sse_events(resp):
                if data.strip() == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    rec.error = f"bad SSE data: {data[:200]}"
                    return rec
                if obj.get("error"):
                    err = obj["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return rec
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
        end = time.perf_counter()
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout:g}s"
        return rec
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: an over-long SSE line
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.e2e = end - start
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
        raise SystemExit(f"{url} lists no models; pass --model")
    return data[0]["id"]


async def run_load(specs: list[RequestSpec], args: argparse.Namespace, concurrency: int | None,
                   rate: float | None) -> tuple[list[RequestRecord], float]:
    """Send all ``specs`` at ``concurrency`` (max in flight) and/or Poisson ``rate`` (req/s)."""
    url = endpoint_url(args.base_url, args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = json.loads(args.extra_body) if args.extra_body else None
    records = [RequestRecord(i, s.kind, s.max_tokens, s.input_len) for i, s in enumerate(specs)]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in specs:
        arrivals.append(t)
        if rate and math.isfinite(rate):
            t += rng.expovariate(rate)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(specs[i], args.model, extra)
            if sem is None:
                await send_request(session, url, body, records[i], t0, args.request_timeout, headers)
            else:
                async with sem:
                    await send_request(session, url, body, records[i], t0, args.request_timeout, headers)

        await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = time.perf_counter() - t0
    return records, duration


# --------------------------------------------------------------------------------------------- metrics


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean/median/p90/p99 (+min/max) of seconds, reported in ms (``scale``)."""
    if not values:
        return {k: None for k in ("mean", "median", "p90", "p99", "min", "max")}
    v = [x * scale for x in values]
    return {"mean": sum(v) / len(v), "median": percentile(v, 50), "p90": percentile(v, 90),
            "p99": percentile(v, 99), "min": min(v), "max": max(v)}


def compute_metrics(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None,
                    slo_tpot_ms: float | None, slo_e2e_ms: float | None = None) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len_est for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "input_tokens_exact": all(r.prompt_tokens is not None for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize([g for r in ok for g in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok]),
    }
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "?")[:120]
            errors[key] = errors.get(key, 0) + 1
    m["errors"] = errors
    slos = {"ttft": slo_ttft_ms, "tpot": slo_tpot_ms, "e2e": slo_e2e_ms}
    if any(v is not None for v in slos.values()):
        def good(r: RequestRecord) -> bool:
            return ((slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
                    and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)
                    and (slo_e2e_ms is None or r.e2e * 1000 <= slo_e2e_ms))
        n_good = sum(good(r) for r in ok)
        m["slo"] = {k: v for k, v in slos.items() if v is not None}
        m["good_requests"] = n_good
        m["goodput"] = n_good / duration if duration > 0 else 0.0
        m["slo_attainment"] = n_good / len(records) if records else 0.0
    else:
        m["good_requests"] = m["goodput"] = m["slo_attainment"] = None
    server = {}
    for key in ("queue_ms", "prefill_ms", "decode_ms"):
        vals = [getattr(r, key) for r in ok if getattr(r, key) is not None]
        if vals:
            server[key] = summarize(vals, scale=1.0)
    m["server_timing_ms"] = server or None
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    m["total_cached_tokens"] = sum(cached) if cached else None
    return m


# --------------------------------------------------------------------------------------------- output


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(label: str, m: dict) -> str:
    lines = [f"============ {label} ============"]
    row = lambda k, v: lines.append(f"{k:<44}{v:>12}")  # noqa: E731
    row("Completed requests:", _fmt(m["completed"]))
    row("Failed requests:", _fmt(m["failed"]))
    row("Duration (s):", _fmt(m["duration_s"]))
    row("Total input tokens:" + ("" if m["input_tokens_exact"] else " (est)"), _fmt(m["total_input_tokens"]))
    row("Total output tokens:", _fmt(m["total_output_tokens"]))
    if m.get("total_cached_tokens") is not None:
        row("Cached prompt tokens:", _fmt(m["total_cached_tokens"]))
    row("Request throughput (req/s):", _fmt(m["request_throughput"]))
    row("Output throughput (tok/s):", _fmt(m["output_throughput"]))
    row("Total token throughput (tok/s):", _fmt(m["total_token_throughput"]))
    if m.get("goodput") is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in m["slo"].items())
        row(f"Goodput (req/s, {slo}):", _fmt(m["goodput"]))
        row("SLO attainment:", f"{100 * m['slo_attainment']:.1f}%")
    lines.append(f"{'(ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        s = m[key]
        lines.append(f"{name:<12}" + "".join(f"{_fmt(s[k]):>10}" for k in ("mean", "median", "p90", "p99")))
    if m.get("server_timing_ms"):
        lines.append("server-side (usage):")
        for key, s in m["server_timing_ms"].items():
            lines.append(f"  {key:<10}" + "".join(f"{_fmt(s[k]):>10}" for k in ("mean", "median", "p90", "p99")))
    for err, n in (m.get("errors") or {}).items():
        lines.append(f"  error x{n}: {err}")
    return "\n".join(lines)


def write_plots(out_dir: Path, runs: list[dict], sweep_key: str | None) -> list[str]:
    """PNG latency CDFs per run, and throughput / p99 TTFT against the swept variable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    for run in runs:
        ok = [r for r in run["requests"] if r["ok"]]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for ax, (name, key) in zip(axes, (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E latency", "e2e"))):
            xs = sorted(r[key] * 1000 for r in ok if r[key] is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("CDF")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        fig.suptitle(run["label"])
        fig.tight_layout()
        path = out_dir / f"cdf_{run['label'].replace('=', '').replace(' ', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    if sweep_key and len(runs) > 1:
        values = [r["load"][sweep_key] for r in runs]
        xs = list(range(len(runs)))  # evenly spaced categories: sweeps are often geometric, and may end in 'inf'
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        a1.plot(xs, [r["metrics"]["output_throughput"] for r in runs], "o-", label="output tok/s")
        a1.set_ylabel("output tokens/s")
        a1b = a1.twinx()
        a1b.plot(xs, [r["metrics"]["request_throughput"] for r in runs], "s--", color="tab:orange", label="req/s")
        if runs[0]["metrics"].get("goodput") is not None:
            a1b.plot(xs, [r["metrics"]["goodput"] for r in runs], "^:", color="tab:green", label="goodput req/s")
        a1b.set_ylabel("requests/s")
        handles = a1.get_legend_handles_labels()[0] + a1b.get_legend_handles_labels()[0]
        a1b.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=8)
        a2.plot(xs, [r["metrics"]["ttft_ms"]["p99"] or float("nan") for r in runs], "o-", color="tab:red")
        a2.set_ylabel("p99 TTFT (ms)")
        for ax in (a1, a2):
            ax.set_xlabel("concurrency" if sweep_key == "concurrency" else "request rate (req/s)")
            ax.set_xticks(xs, [f"{v:g}" for v in values])
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "sweep.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    return written


# --------------------------------------------------------------------------------------------- main


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None,
                   help="model name sent in each request (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--workload", default="mix",
                   help=f"one of {', '.join(NAMED_WORKLOADS)}, or a JSONL file of "
                        '{"prompt", "max_tokens"} or {"input_len", "output_len"} records')
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default 64, or the file's record count; a file is cycled)")
    p.add_argument("--scale", type=float, default=1.0,
                   help=f"multiply the named workloads' lengths (in {SHORT_IN}/{LONG_IN}, out {SHORT_OUT}/{LONG_OUT})")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the Poisson arrivals")
    load = p.add_argument_group("load (default: --concurrency 1)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="max requests in flight (with --request-rate: a cap on top of the rate)")
    load.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals at this many requests/s ('inf': all at once)")
    load.add_argument("--sweep-concurrency", type=_ints, default=None, metavar="N,N,...")
    load.add_argument("--sweep-rate", type=_floats, default=None, metavar="R,R,...")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (total)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--output-dir", default=None, help="write results.json and PNG plots here")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="don't print the tables")
    args = p.parse_args(argv)
    if args.sweep_concurrency and args.sweep_rate:
        p.error("--sweep-concurrency and --sweep-rate are exclusive")
    if args.request_timeout <= 0:
        p.error("--request-timeout must be positive")
    return args


def plan_runs(args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """The runs' loads, and the swept key (None for a single run)."""
    if args.sweep_concurrency:
        return [{"concurrency": c, "request_rate": args.request_rate} for c in args.sweep_concurrency], "concurrency"
    if args.sweep_rate:
        return [{"concurrency": args.concurrency, "request_rate": r} for r in args.sweep_rate], "request_rate"
    conc = args.concurrency if args.concurrency or args.request_rate else 1
    return [{"concurrency": conc, "request_rate": args.request_rate}], None


def _label(load: dict) -> str:
    parts = []
    if load["request_rate"] is not None:
        parts.append(f"rate={load['request_rate']:g}")
    if load["concurrency"] is not None:
        parts.append(f"concurrency={load['concurrency']}")
    return " ".join(parts)


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run every planned load and return (and write, with --output-dir) the results."""
    specs = build_workload(args.workload, args.num_requests, args.endpoint, args.scale, args.seed)
    if args.model is None:
        args.model = await fetch_model(args)
    loads, sweep_key = plan_runs(args)
    runs = []
    for load in loads:
        records, duration = await run_load(specs, args, load["concurrency"], load["request_rate"])
        metrics = compute_metrics(records, duration, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        label = _label(load)
        if not args.quiet:
            print(format_table(label, metrics), flush=True)
        runs.append({"label": label, "load": load, "metrics": metrics, "requests": [asdict(r) for r in records]})
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    result = {"config": config, "sweep": sweep_key, "runs": runs}
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(_finite(result), indent=1, allow_nan=False))
        result["plots"] = [] if args.no_plots else write_plots(out, runs, sweep_key)
        if not args.quiet:
            print(f"wrote {out / 'results.json'}" + "".join(f", {p}" for p in result["plots"]))
    return result


def _finite(x: Any) -> Any:
    """Strict JSON: non-finite floats (``--request-rate inf``) become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    return 1 if all(r["metrics"]["completed"] == 0 for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
