"""One `jserve serve` and `jserve bench` over request shapes x concurrencies (the device check's
serving part): per (input, output, concurrency), 2 x concurrency requests of exactly those lengths
(eos ignored); output tok/s, TTFT and TPOT medians, failures; the server's idle-step and
compilation gauges at the end. Exit 1 when a request failed.

    python -m benchmarks.serving.sweep --shapes 1024x128,128x1024 --concurrency 1 16 64 256 \\
        --serve-args "--load-format dummy --max-model-len 2048" --out serving.json
    python -m benchmarks.serving.sweep --shapes 64x8,16x32 --concurrency 1 2 --serve-args "--max-model-len 512"
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ServerProcess, bench, parser, report


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--shapes", default="1024x128,128x1024", help="INPUTxOUTPUT token lengths, comma-separated")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--serve-args", default="", help="`jserve serve` flags (one string)")
    args = p.parse_args(argv)
    rows, failed = [], False
    with ServerProcess(args.serve_args) as server, tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            n_in, n_out = (int(x) for x in shape.split("x"))
            workload = Path(tmp) / f"{shape}.jsonl"
            workload.write_text(json.dumps({"input_len": n_in, "output_len": n_out}) + "\n")
            for c in args.concurrency:
                try:
                    m = bench(server.url, "--workload", str(workload), "--num-requests", str(2 * c),
                              "--concurrency", str(c), "--extra-body", '{"ignore_eos": true}')
                except RuntimeError as e:
                    print(f"{shape} c={c}: {e}", file=sys.stderr)
                    failed = True
                    continue
                rows.append({"input": n_in, "output": n_out, "concurrency": c, "output_tok_s": m["output_throughput"],
                             "ttft_ms_p50": m["ttft_ms"]["median"], "tpot_ms_p50": m["tpot_ms"]["median"],
                             "failed": m["failed"]})
        gauges = {k: v for k, v in server.metrics().items()
                  if k.startswith(("jserve_step_idle", "jserve_compilations"))}
    report(rows, args.out, title=f"jserve serve {args.serve_args}", server_gauges=gauges,
           waited_for_warmup_s=server.warmup_s)
    print(gauges)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
