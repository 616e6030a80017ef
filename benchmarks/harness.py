"""What the benchmarks share: a free port and `ServerProcess` (a `jserve serve` started, waited for
on /health, its /metrics scraped, stopped; from jserve.bench), `bench` (one `jserve bench` load in
this process), a median timer, and the table + JSON output."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from jserve.bench import ServerProcess, free_port, parse_args, run_benchmark, table
from jserve.bench.report import finite_json

__all__ = ["ServerProcess", "bench", "free_port", "median_ms", "parser", "records_since", "report", "table", "timings",
           "write_json"]


def parser(doc: str | None, out: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with the module's docstring as its help, and --out (JSON) when `out` is
    given (its default; "" for none)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        p.add_argument("--out", default=out or None, help="write the results to this JSON file")
    return p


def timings(fn: Callable[[], Any], reps: int, warmup: int = 1, sync: Callable[[Any], Any] | None = None) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` untimed ones; `sync` (e.g.
    jax.block_until_ready) waits for each call's result."""
    sync = sync or (lambda x: x)
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return times


def median_ms(fn: Callable[[], Any], reps: int, warmup: int = 1, sync: Callable[[Any], Any] | None = None) -> float:
    return 1000 * statistics.median(timings(fn, reps, warmup, sync))


def records_since(records, last) -> list:
    """The runner's `records` (a deque of recent StepRecords) appended after the record `last`
    (taken before, None when it was empty; all of them when the deque has since dropped it)."""
    new = []
    for record in reversed(records):
        if record is last:
            break
        new.append(record)
    return new[::-1]


def bench(url: str, *flags: str) -> dict:
    """One `jserve bench` load against `url` in this process (quiet): its metrics; raises when a
    request failed."""
    args = parse_args(["--base-url", url, "--quiet", "--no-plots", *flags])
    result = asyncio.run(run_benchmark(args))
    metrics = {**result["runs"][0]["metrics"], "waited_for_warmup_s": result["waited_for_warmup_s"]}
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} requests failed: {metrics.get('errors')}")
    return metrics


def alternated_rates(variants: dict[str, Callable[[int], Any]], counts: tuple[int, ...], rounds: int,
                     tokens: int, baseline: str, key: str) -> list[dict]:
    """Output tokens/s of each variant (`fn(n)` generates `tokens` tokens for each of n requests)
    at each request count, the variants run in turn each round; rows of medians over the rounds
    with each one's ratio to `baseline`'s at the same count (under `key`)."""
    import statistics
    import time

    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for n in counts:
            for name, fn in variants.items():
                start = time.perf_counter()
                fn(n)
                rates.setdefault((name, n), []).append(n * tokens / (time.perf_counter() - start))
    return [{"requests": n, "variant": name, "output_tok_s": round(statistics.median(v), 1),
             key: round(statistics.median(v) / statistics.median(rates[(baseline, n)]), 3)}
            for (name, n), v in rates.items()]


def write_json(path: str | Path | None, result: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(finite_json(result), indent=1, default=str))
        print(f"wrote {path}")


def report(rows: list[dict], out: str | Path | None = None, columns: list[str] | None = None, title: str = "",
           **extra: Any) -> dict:
    """Print `rows` as a table and write {**extra, "rows": rows} to `out`; returns that dict."""
    print(table(rows, columns, title))
    result = {**extra, "rows": rows}
    write_json(out, result)
    return result
