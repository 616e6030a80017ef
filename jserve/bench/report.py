"""Figures of a benchmark run from its request records (throughput, latency percentiles, goodput,
the server's queue / prefill / decode split) and the terminal table."""

from __future__ import annotations

import math
from typing import Any

from jserve.bench.client import RequestRecord


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


def table(rows: list[dict], columns: list[str] | None = None, title: str = "", digits: int = 2) -> str:
    """Rows of dicts as an aligned text table (columns: the first row's keys unless given; None: -)."""
    columns = columns or list(rows[0]) if rows else columns or []
    cells = [[_fmt(r.get(c), digits) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def finite_json(x: Any) -> Any:
    """Strict JSON: non-finite floats (``--request-rate inf``) become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x

