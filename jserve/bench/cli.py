"""`jserve bench`: the command line over `jserve.bench.runs` (one load or a sweep against a running
server); `jserve bench ab` (jserve.bench.ab) runs one load against two servers in alternation."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from jserve.bench.ab import add_ab_parser
from jserve.bench.runs import add_arguments, check_args, plan_runs, run_benchmark

__all__ = ["add_bench_parser", "main", "parse_args", "plan_runs", "run_benchmark"]

DESCRIPTION = "Online serving benchmark for any OpenAI-compatible server (jserve, llama.cpp, vLLM, ...)."
EPILOG = """\
examples:
  jserve bench --base-url http://127.0.0.1:8000 --workload mix --num-requests 64 --concurrency 16
  jserve bench --workload shared-prefix --endpoint chat --sweep-rate 1,2,4 --output-dir out/
  jserve bench --lora-modules a b c d --lora-assignment round-robin --concurrency 16   # adapters in turn
  jserve bench --workload requests.jsonl   # {"prompt", "max_tokens"} or {"input_len", "output_len"} per line
  jserve bench ab --a "--max-num-seqs 8" --b "--max-num-seqs 16" --rounds 3 --workload mix --concurrency 16

--output-dir writes results.json (config, per-run metrics and per-request records) and, with
matplotlib installed, cdf_<run>.png latency CDFs and sweep.png for sweeps. Against jserve the
figures are set beside the server's own /metrics deltas (TTFT, token counts, compilations).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `jserve`'s subparsers."""
    p = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=lambda args: bench_command(p, args))
    add_ab_parser(p.add_subparsers(dest="bench_mode", metavar="{ab}"))
    return p


def bench_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_args(p, args)
    result = asyncio.run(run_benchmark(args))
    return 1 if all(r["metrics"]["completed"] == 0 for r in result["runs"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return bench_command(p, args)
    except ValueError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
