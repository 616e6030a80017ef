"""jserve against llama.cpp's server on the same GGUF at F32, Q8_0 and Q4_1: one stream and 16, right
after ready and at steady state (issue #43's table).

    python -m benchmarks.serving.versus_llamacpp --rounds 2 --out versus.json
    python -m benchmarks.serving.versus_llamacpp --precisions Q4_1 --rounds 1 --single-requests 2 --num-requests 16

The default model's GGUF (SmolLM2-135M-Instruct, Q4_1 as shipped) and llama.cpp's own F32 and Q8_0
copies of it (`llama-quantize`; llama.cpp built once from the llama-cpp-python sdist:
benchmarks.serving.compare). At each precision both servers read the same file:
`llama-server -m FILE -np 16 -c 16384 -t 2 -tb 2 --cont-batching`, and `jserve serve --model FILE`
(F32: converted to float32; Q8_0 and Q4_1 with `--quantization gguf --quality-gate warn`: the
file's codes kept, Q8_0 as int8 g32, Q4_1 as uint4 g32, served whether or not a quality report was
stored; their quality is benchmarks.quality's subject), `--max-num-seqs 16`.

Each round runs every precision's two servers, one after the other (which one first alternates by
round and precision), and on each: c1, `--single-requests` requests one at a time, then c16,
`--num-requests` at concurrency 16, all ~16-token prompts with 128 output tokens (eos ignored),
started the moment /health answers 200 ("ready": jserve's lazy buckets may still be compiling);
then, for jserve, once /health no longer says "warming", the same two loads again ("steady").
llama.cpp compiles nothing: its ready figures are its steady ones. Prints the runs and a summary
(medians over the rounds, jserve / llama.cpp at steady state, jserve ready / steady) and writes
JSON with each run's `jserve bench` metrics and the load average around it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from benchmarks.harness import ServerProcess, bench, parser, report, table
from benchmarks.serving import compare
from jserve.bench.server import wait_warm

PRECISIONS = ("F32", "Q8_0", "Q4_1")
ALIAS = "smollm2"
# ~16-token prompts, 128 output tokens (compare.SINGLE: the reference load)
LOAD = ("--workload", compare.SINGLE["workload"], "--scale", str(compare.SINGLE["scale"]),
        "--extra-body", '{"ignore_eos": true}', "--model", ALIAS, "--no-wait-warm")


def gguf_file(precision: str, cache: Path) -> Path:
    source = compare.default_gguf()
    if precision == "Q4_1":
        return source
    bindir = compare.ensure_llama_cpp(cache)
    return (compare.ensure_f32_gguf if precision == "F32" else compare.ensure_q8_gguf)(cache, bindir, source)


def server_command(server: str, precision: str, args: argparse.Namespace) -> list[str]:
    """The command line of `server` ("jserve" or "llama.cpp") on `precision`'s file; "{port}" for the port."""
    gguf = str(gguf_file(precision, args.cache_dir))
    if server == "jserve":
        return [compare.jserve_exe(), "serve", "--port", "{port}", "--model", gguf, "--max-num-seqs",
                str(args.concurrency), "--served-model-name", ALIAS,
                *(["--quantization", "gguf", "--quality-gate", "warn"] if precision != "F32" else []),
                *args.jserve_arg]
    return [str(compare.llama_bin(args.cache_dir) / "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port",
            "{port}", "-np", str(args.concurrency), "-c", str(args.llama_ctx), "-t", str(args.threads), "-tb",
            str(args.threads), "--cont-batching", "-a", ALIAS]


def loads(url: str, args: argparse.Namespace) -> dict:
    """c1 then c16 on the server at `url`: each one's `jserve bench` metrics."""
    return {"c1": bench(url, *LOAD, "--num-requests", str(args.single_requests), "--concurrency", "1"),
            "c16": bench(url, *LOAD, "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency))}


def run(server: str, precision: str, round_: int, args: argparse.Namespace) -> list[dict]:
    """One server's runs (rows: ready, and for jserve steady), with the load average around them."""
    command = server_command(server, precision, args)
    log = args.out_dir / f"{server}-{precision}-{round_}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    base = {"round": round_, "precision": precision, "server": server}
    rows = []
    load_before = os.getloadavg()[0]
    with ServerProcess(command=command, log=log, timeout=args.startup_timeout, wait_warm=None) as proc:
        rows.append({**base, "phase": "ready", "startup_s": proc.startup_s, "metrics": loads(proc.url, args)})
        if server == "jserve":
            waited, warm = wait_warm(proc.url, args.warm_timeout)
            rows.append({**base, "phase": "steady", "waited_for_warm_s": waited, "warm": warm,
                         "metrics": loads(proc.url, args)})
    for row in rows:
        row["load_avg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        for c in ("c1", "c16"):
            row[f"{c}_tok_s"] = round(row["metrics"][c]["output_throughput"], 1)
        row["c1_ttft_ms"] = round(row["metrics"]["c1"]["ttft_ms"]["median"], 1)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per precision: medians over the rounds of jserve ready, jserve steady and llama.cpp, and the ratios."""
    def med(precision, server, phase, key):
        v = [r[key] for r in rows if (r["precision"], r["server"], r["phase"]) == (precision, server, phase)]
        return statistics.median(v) if v else None

    def ratio(a, b):
        return round(a / b, 2) if a is not None and b else None

    out = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        row = {"precision": precision}
        for c in ("c1", "c16"):
            llama = med(precision, "llama.cpp", "ready", f"{c}_tok_s")
            ready, steady = (med(precision, "jserve", phase, f"{c}_tok_s") for phase in ("ready", "steady"))
            row.update({f"{c} jserve ready": ready, f"{c} jserve steady": steady, f"{c} llama.cpp": llama,
                        f"{c} steady/llama": ratio(steady, llama), f"{c} ready/steady": ratio(ready, steady)})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--single-requests", type=int, default=4, help="c1: requests one at a time")
    p.add_argument("--num-requests", type=int, default=64, help="c16: requests at --concurrency")
    p.add_argument("--concurrency", type=int, default=16, help="also llama.cpp's -np and jserve's --max-num-seqs")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp -t/-tb")
    p.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (split among the -np slots)")
    p.add_argument("--jserve-arg", action="append", default=[], help="extra `jserve serve` argument (repeatable)")
    p.add_argument("--cache-dir", type=Path, default=compare.default_cache_dir(),
                   help="llama.cpp's build and the GGUF copies (benchmarks.serving.compare's)")
    p.add_argument("--out-dir", type=Path, default=Path("versus_out"), help="the servers' logs")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--warm-timeout", type=float, default=900.0, help="seconds to wait for jserve's warm-up")
    args = p.parse_args(argv)
    rows = []
    for round_ in range(args.rounds):
        for i, precision in enumerate(args.precisions):
            order = ("llama.cpp", "jserve") if (round_ + i) % 2 == 0 else ("jserve", "llama.cpp")
            for server in order:
                rows.extend(run(server, precision, round_, args))
    columns = ["round", "precision", "server", "phase", "c1_tok_s", "c16_tok_s", "c1_ttft_ms", "load_avg"]
    print(table(rows, columns, "runs (output tok/s; c1 TTFT p50 ms; 1-min load average before, after)"))
    result = report(summary(rows), args.out, title="medians over the rounds", runs=rows, argv=sys.argv,
                    nproc=os.cpu_count())
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
