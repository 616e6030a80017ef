"""One `jserve bench` load, planned and run: the load's flags (`add_arguments`, shared by `jserve bench`
and `jserve bench ab`), the planned runs (one load, or a sweep of concurrencies or rates) and
`run_benchmark`, which runs them and writes results.json and plots."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path

from jserve.bench import server, server_metrics
from jserve.bench.client import fetch_model, run_load
from jserve.bench.plots import write_plots
from jserve.bench.report import compute_metrics, finite_json, format_table
from jserve.bench.workloads import COPY_OUT, LONG_IN, LONG_OUT, NAMED_WORKLOADS, SHORT_IN, SHORT_OUT, build_workload


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by `jserve bench` and `jserve bench ab`)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None,
                   help="model name sent in each request (default: the first of GET /v1/models)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="adapter names the server serves (vLLM's benchmark_serving option): each request's model "
                        "is one of them, picked by --lora-assignment, instead of --model")
    p.add_argument("--lora-assignment", choices=("random", "round-robin"), default="random",
                   help="how each request's adapter is picked: at random with --seed (vLLM's way; default), or "
                        "in turn by request index")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--workload", default="mix",
                   help=f"one of {', '.join(NAMED_WORKLOADS)} (copy: repeat or fix the typos of a given passage, "
                        f"{COPY_OUT} output tokens, so the output repeats the prompt), or a JSONL file of "
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
    load.add_argument("--warmup-requests", type=int, default=0,
                      help="send this many unmeasured requests (same workload, other prompts) before the runs")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (total)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--no-server-metrics", action="store_true",
                   help="don't scrape the server's /metrics before and after each run")
    p.add_argument("--output-dir", default=None, help="write results.json and PNG plots here")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="don't print the tables")
    p.add_argument("--no-wait-warm", action="store_true",
                   help="measure at once, even while the server warms up (jserve's /health says \"warming\" "
                        "while its smaller buckets compile, at less than full speed); results.json says so")
    p.add_argument("--wait-warm-timeout", type=float, default=600.0,
                   help="seconds to wait for the server to be warm before measuring (then measure anyway)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.sweep_concurrency and args.sweep_rate:
        p.error("--sweep-concurrency and --sweep-rate are exclusive")
    if args.request_timeout <= 0:
        p.error("--request-timeout must be positive")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.wait_warm_timeout < 0:
        p.error("--wait-warm-timeout must be >= 0")



def plan_runs(args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """The runs' loads, and the swept key (None for a single run)."""
    if args.sweep_concurrency:
        return [{"concurrency": c, "request_rate": args.request_rate} for c in args.sweep_concurrency], "concurrency"
    if args.sweep_rate:
        return [{"concurrency": args.concurrency, "request_rate": r} for r in args.sweep_rate], "request_rate"
    conc = args.concurrency if args.concurrency or args.request_rate else 1
    return [{"concurrency": conc, "request_rate": args.request_rate}], None


def model_counts(records: list) -> dict[str, dict[str, int]]:
    """Each model the run's requests named: its requests and how many of them failed."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        entry = out.setdefault(r.model, {"requests": 0, "failed": 0})
        entry["requests"] += 1
        entry["failed"] += not r.ok
    return out


def _label(load: dict) -> str:
    parts = []
    if load["request_rate"] is not None:
        parts.append(f"rate={load['request_rate']:g}")
    if load["concurrency"] is not None:
        parts.append(f"concurrency={load['concurrency']}")
    return " ".join(parts)


def wait_for_warm(args: argparse.Namespace) -> dict:
    """Wait until the server is warm (unless --no-wait-warm): {"waited_for_warmup_s": seconds, or
    None when it did not wait; "warm_at_start": whether the server was warm when measuring began}."""
    root = args.base_url.rstrip("/").removesuffix("/v1")
    if getattr(args, "no_wait_warm", False):
        waited, warm = None, not server.is_warming(root)
    else:
        waited, warm = server.wait_warm(root, getattr(args, "wait_warm_timeout", 600.0))
    if not args.quiet and (not warm or (waited or 0) >= 1):
        print(f"waited {waited:.1f} s for the server to warm up" if waited is not None else "did not wait for "
              "warm-up", "" if warm else "(measuring while it still warms up: slower than at steady state)",
              flush=True)
    return {"waited_for_warmup_s": waited, "warm_at_start": warm}


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run every planned load and return (and write, with --output-dir) the results."""
    specs = build_workload(args.workload, args.num_requests, args.endpoint, args.scale, args.seed)
    warm = await asyncio.to_thread(wait_for_warm, args)
    if args.model is None and not args.lora_modules:
        args.model = await fetch_model(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    scrape = not getattr(args, "no_server_metrics", False)
    warmup = None
    if getattr(args, "warmup_requests", 0):
        # Other prompts than the measured ones (another seed): a prefix cache must not profit.
        n = args.warmup_requests
        others = build_workload(args.workload, n if args.num_requests else None, args.endpoint, args.scale,
                                args.seed + 1_000_003)
        records, duration = await run_load([others[i % len(others)] for i in range(n)], args, min(n, 16), None)
        warmup = {"requests": n, "completed": sum(r.ok for r in records), "duration_s": duration}
    loads, sweep_key = plan_runs(args)
    runs = []
    for load in loads:
        before = await server_metrics.scrape(args.base_url, headers) if scrape else None
        records, duration = await run_load(specs, args, load["concurrency"], load["request_rate"])
        after = await server_metrics.scrape(args.base_url, headers) if before is not None else None
        metrics = compute_metrics(records, duration, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        metrics["server_metrics"] = server_metrics.compare(before, after, metrics)
        label = _label(load)
        if not args.quiet:
            print(format_table(label, metrics), flush=True)
            if metrics["server_metrics"]:
                print(server_metrics.format_agreement(metrics["server_metrics"]), flush=True)
            if getattr(args, "lora_modules", None):
                print("requests per model: " + ", ".join(f"{name} {c['requests']}" for name, c in
                                                         model_counts(records).items()), flush=True)
        runs.append({"label": label, "load": load, "metrics": metrics, "models": model_counts(records),
                     "requests": [asdict(r) for r in records]})
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    result = {"config": config, "sweep": sweep_key, "warmup": warmup, **warm, "runs": runs}
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(finite_json(result), indent=1, allow_nan=False))
        result["plots"] = [] if args.no_plots else write_plots(out, runs, sweep_key)
        if not args.quiet:
            print(f"wrote {out / 'results.json'}" + "".join(f", {p}" for p in result["plots"]))
    return result

