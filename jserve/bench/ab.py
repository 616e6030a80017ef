"""`jserve bench ab --a FLAGS --b FLAGS --rounds N`: one `jserve bench` load against two servers
that differ in their `jserve serve` flags, alternating A, B, B, A, ... for N rounds so that a noisy
machine slows both alike; prints each turn, the medians and B/A, and writes ab.json (--output-dir).
Each server is started for its turn and stopped after it (one at a time: a device's memory holds
one), or with --both-up started once and kept up for the whole run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
from pathlib import Path
from typing import Any, Callable

from jserve.bench.report import finite_json, table
from jserve.bench.runs import add_arguments, check_args, run_benchmark
from jserve.bench.server import ServerProcess

# The figures compared: name -> the path into `compute_metrics`' dict.
FIGURES = {"output_tok_s": ("output_throughput",), "total_tok_s": ("total_token_throughput",),
           "ttft_p50_ms": ("ttft_ms", "median"), "tpot_p50_ms": ("tpot_ms", "median"),
           "e2e_p50_ms": ("e2e_ms", "median"), "prefill_computed": ("server_metrics", "prefill_tokens_computed")}


def figures(metrics: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in FIGURES.items():
        value: Any = metrics
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out[name] = value
    return {**out, "completed": metrics["completed"], "failed": metrics["failed"]}


def add_ab_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ab", help="the same load against two servers started with other flags, alternated",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, metavar="FLAGS", help="`jserve serve` flags of server A (one string)")
    p.add_argument("--b", required=True, metavar="FLAGS", help="`jserve serve` flags of server B (one string)")
    p.add_argument("--rounds", type=int, default=3, help="turns per server (default 3)")
    p.add_argument("--both-up", action="store_true", help="start both servers once and keep them up")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    add_arguments(p)  # the load (--base-url is not used: each server's own URL is)

    def command(args: argparse.Namespace) -> int:
        check_args(p, args)
        if args.sweep_concurrency or args.sweep_rate or args.rounds < 1:
            p.error("ab runs one load (no sweeps) for --rounds >= 1")
        result = run_ab(args)
        return 1 if any(row["completed"] == 0 for row in result["rows"]) else 0

    p.set_defaults(func=command)
    return p


def run_ab(args: argparse.Namespace, serve: Callable[..., Any] = ServerProcess) -> dict:
    """The alternating runs; `serve(flags, timeout=...)` makes a context manager that yields a
    server (with `.url`): ServerProcess, or a stand-in (tests, servers already up)."""
    flags = {"A": args.a, "B": args.b}
    rows = []
    serve = functools.partial(serve, timeout=args.startup_timeout,
                              **({"wait_warm": None} if getattr(args, "no_wait_warm", False) else {}))
    with contextlib.ExitStack() as stack:
        up = {s: stack.enter_context(serve(f)) for s, f in flags.items()} if args.both_up else {}
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                turn = contextlib.nullcontext(up[side]) if side in up else serve(flags[side])
                with turn as server:
                    load = argparse.Namespace(**{**vars(args), "base_url": server.url, "output_dir": None,
                                                 "quiet": True, "func": None})
                    done = asyncio.run(run_benchmark(load))
                    run, metrics = done["runs"][0], done["runs"][0]["metrics"]
                rows.append({"round": r, "server": side, **figures(metrics), "models": run["models"],
                             "metrics": metrics, "server_warmup_s": getattr(server, "warmup_s", None),
                             "waited_for_warmup_s": done["waited_for_warmup_s"]})
                if not args.quiet:
                    print(f"round {r} {side}: {metrics['output_throughput']:.1f} output tok/s", flush=True)
    median = {s: {k: statistics.median(v) if (v := [row[k] for row in rows if row["server"] == s
                                                    and row[k] is not None]) else None for k in FIGURES}
              for s in flags}
    ratio = {k: median["B"][k] / median["A"][k] if median["A"][k] and median["B"][k] is not None else None
             for k in FIGURES}
    result = {"a": args.a, "b": args.b, "rounds": args.rounds, "workload": args.workload, "rows": rows,
              "median": median, "b_over_a": ratio}
    if not args.quiet:
        shown = [{k: v for k, v in row.items() if k not in ("metrics", "models")} for row in rows]
        shown += [{"round": "median", "server": s, **median[s]} for s in flags]
        shown.append({"round": "B/A", "server": "", **ratio})
        print(table(shown, ["round", "server", *FIGURES, "failed"], title=f"A: {args.a!r}  B: {args.b!r}"))
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.json").write_text(json.dumps(finite_json(result), indent=1, allow_nan=False))
        if not args.quiet:
            print(f"wrote {out / 'ab.json'}")
    return result


def parse_ab_args(argv: list[str]) -> argparse.Namespace:
    """`jserve bench ab`'s arguments from a list (for run_ab called from code)."""
    root = argparse.ArgumentParser(prog="jserve bench")
    add_ab_parser(root.add_subparsers())
    return root.parse_args(["ab", *argv])
