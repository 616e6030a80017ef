"""Multi-LoRA served: `jserve bench` against a plain `jserve serve` and one with LoRA slots
(`--enable-lora --max-loras 4 --max-lora-rank 16`, four random rank-16 adapters on all seven
linears, `lora_adapters.write_random_adapter`), both up at once, three variants alternated (their
order rotated each round) for --rounds rounds after one unmeasured: the plain server, the LoRA server's base model, and
the LoRA server with every request naming one of the 4 adapters in turn (`jserve bench
--lora-modules a b c d --lora-assignment round-robin`). Medians of output tok/s, TTFT and TPOT
p50, each against the plain server's (of the medians, and the median of each round's ratio);
`uptime` before and after.

    python -m benchmarks.serving.lora [--rounds 2] [--num-requests 32] [--max-tokens 64] --out lora_serving.json
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import ServerProcess, parser, table, write_json
from jserve.bench import parse_args, run_benchmark
from jserve.bench.ab import FIGURES, figures

ADAPTERS = ("a", "b", "c", "d")


def _adapters(model: str | None, folder: str) -> list[str]:
    """`--lora-modules` values name=path of four random rank-16 adapters written into `folder`."""
    from jserve.model.checkpoint import read_model_config
    from jserve.model.lora_adapters import write_random_adapter

    config, _ = read_model_config(model)
    return [f"{name}={write_random_adapter(f'{folder}/{name}', config, 16, seed=i)}" for i, name in enumerate(ADAPTERS)]


def _load(url: str, args, extra: list[str]) -> dict:
    load = parse_args(["--base-url", url, "--quiet", "--no-plots", "--workload", args.workload,
                       "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
                       "--scale", str(args.scale), "--warmup-requests", str(args.warmup_requests), *extra])
    run = asyncio.run(run_benchmark(load))["runs"][0]
    if run["metrics"]["failed"]:
        raise RuntimeError(f"{run['metrics']['failed']} requests failed: {run['metrics'].get('errors')}")
    return {**figures(run["metrics"]), "models": run["models"],
            "compilations_after_warmup": (run["metrics"]["server_metrics"] or {}).get("compilations_after_warmup")}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workload", default="short-short", help="a `jserve bench --workload`")
    p.add_argument("--scale", type=float, default=2.0, help="`jserve bench --scale` (short-short: 64 in, 64 out)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup-requests", type=int, default=0, help="per run, unmeasured")
    p.add_argument("--serve-args", default="--max-model-len 1024", help="flags for both servers")
    args = p.parse_args(argv)
    base = [*(["--model", args.model] if args.model else []), *args.serve_args.split()]
    folder = tempfile.mkdtemp(prefix="jserve-lora-serving-")
    lora_flags = [*base, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                  "--lora-modules", *_adapters(args.model, folder)]
    started, before = time.strftime("%Y-%m-%d %H:%M"), _uptime()
    rows = []
    with ServerProcess(base) as plain, ServerProcess(lora_flags) as lora:
        variants = {"plain server": (plain, []), "LoRA server, base model": (lora, []),
                    "LoRA server, 4 adapters in turn": (lora, ["--lora-modules", *ADAPTERS,
                                                               "--lora-assignment", "round-robin"])}
        names = list(variants)
        for name in names:  # a round unmeasured: the lazily compiled shapes, the adapters into their slots
            _load(variants[name][0].url, args, variants[name][1])
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                server, extra = variants[name]
                rows.append({"round": r, "variant": name, **_load(server.url, args, extra)})
                print(f"round {r} {name}: {rows[-1]['output_tok_s']:.1f} output tok/s", flush=True)
    after = _uptime()
    medians = [{"variant": name, **{k: statistics.median(row[k] for row in rows if row["variant"] == name)
                                    for k in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")}} for name in names]
    plain_by_round = {row["round"]: row["output_tok_s"] for row in rows if row["variant"] == names[0]}
    for m in medians:
        m["vs_plain"] = m["output_tok_s"] / medians[0]["output_tok_s"]
        # Within each round too: a load that drifts over the run moves the medians, less these.
        m["vs_plain_in_round"] = statistics.median(row["output_tok_s"] / plain_by_round[row["round"]]
                                                   for row in rows if row["variant"] == m["variant"])
    print(table(medians, title=f"medians of {args.rounds} rounds, c={args.concurrency}"))
    print(f"uptime before: {before}\nuptime after:  {after}")
    write_json(args.out, {"config": vars(args), "started": started, "uptime_before": before, "uptime_after": after,
                          "figures": list(FIGURES), "rows": rows, "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
