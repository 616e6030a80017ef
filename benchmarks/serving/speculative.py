"""What speculative decoding buys: the verify step's cost against a decode step per batch size
(where the turn-down default comes from), and `jserve bench` throughput of the same model served
with and without n-gram speculation, side by side in one run.

Parts:
- `step`: the default model's runner, in process: the median time of a decode step and of a
  verify step (k drafts per row) at each batch size, and their ratio: the tokens a verified row
  must gain per step (1 + accepted drafts) to break even.
- `server`: two `jserve serve` processes, plain (A) and speculative (B, `--speculative-config`), up
  at once, each load run on both in alternation (`jserve bench ab`'s run_ab): the `copy` workload
  at concurrency 1 (the output repeats the prompt) and `mix` at concurrency 16; the speculative
  server's acceptance numbers from /metrics.

    python -m benchmarks.serving.speculative --parts step,server --out bench_speculative.json
"""

from __future__ import annotations

import contextlib
import json
import sys

from benchmarks.harness import ServerProcess, median_ms, parser, table, write_json


def step_part(args) -> list[dict]:
    from jserve import LLM
    from jserve.runtime.steps import StepRow

    llm = LLM(args.model, max_model_len=2048, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                                                      "disable_by_batch_size": 1024})
    runner = llm.runner
    pages = list(range(1, 1 + 512 // runner.page_size))
    rows = []
    for B in runner.verify_buckets:  # every decode bucket: the cap above is past them all
        decode = [StepRow(400, [7], pages)] * B
        verify = [StepRow(400, [7], pages, draft_ids=[7] * args.k)] * B
        d = median_ms(lambda: runner.execute(decode), args.reps)
        v = median_ms(lambda: runner.execute_verify(verify), args.reps)
        rows.append({"batch": B, "decode_ms": d, f"verify_ms_k{args.k}": v, "ratio": v / d})
    print(table(rows))
    return rows


def server_part(args) -> dict:
    from jserve.bench.ab import parse_ab_args, run_ab

    base = [*(["--model", args.model] if args.model else []), *args.serve_args.split()]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    flags = {"plain": " ".join(base), "ngram": " ".join([*base, "--speculative-config", f"'{spec}'"])}
    loads = {"copy c=1": ["--workload", "copy", "--num-requests", str(args.copy_requests), "--concurrency", "1"],
             "mix c=16": ["--workload", "mix", "--num-requests", str(args.mix_requests), "--concurrency", "16",
                          "--scale", str(args.mix_scale)]}
    result = {}
    with ServerProcess(flags["plain"]) as plain, ServerProcess(flags["ngram"]) as ngram:
        up = {flags["plain"]: plain, flags["ngram"]: ngram}
        for name, load in loads.items():
            ab = parse_ab_args(["--a", flags["plain"], "--b", flags["ngram"], "--rounds", str(args.rounds),
                                "--warmup-requests", "2", "--extra-body", '{"temperature": 0, "ignore_eos": true}',
                                "--quiet", *load])
            out = run_ab(ab, serve=lambda f, timeout: contextlib.nullcontext(up[f]))
            rows = [{"load": name, "round": r["round"], "server": "ngram" if r["server"] == "B" else "plain",
                     "output_tok_s": r["output_tok_s"], "tpot_p50_ms": r["tpot_p50_ms"],
                     **{k: (r["metrics"]["server_metrics"] or {}).get(f"spec_{k}") for k in
                        ("acceptance_rate", "mean_accepted_length", "verify_steps", "turned_down_steps")}}
                    for r in out["rows"]]
            print(table(rows))
            print(f"{name}: median output tok/s plain {out['median']['A']['output_tok_s']:.1f}, "
                  f"ngram {out['median']['B']['output_tok_s']:.1f}; ratio {out['b_over_a']['output_tok_s']:.2f}")
            result[name] = {"rows": rows, "median": out["median"], "ngram_over_plain": out["b_over_a"]}
    return result


def main(argv=None) -> int:
    p = parser(__doc__, out="bench_speculative.json")
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--parts", default="step,server", help="step, server or both (comma-separated)")
    p.add_argument("--reps", type=int, default=20, help="calls per variant in the step part")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every load on both servers")
    p.add_argument("--copy-requests", type=int, default=6)
    p.add_argument("--mix-requests", type=int, default=48)
    p.add_argument("--mix-scale", type=float, default=0.5, help="--scale of the mix workload")
    p.add_argument("--serve-args", default="--max-model-len 2048", help="flags for both servers")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"config": vars(args)}
    if "step" in parts:
        result["step"] = step_part(args)
    if "server" in parts:
        result["server"] = server_part(args)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
