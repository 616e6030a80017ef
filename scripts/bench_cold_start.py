"""Cold start and decode step of the paged runner, one variant per fresh process.

Measures what `jserve serve` spends before it is ready, with JAX's persistent compilation cache
off: loading the checkpoint, building the runner and compiling every bucket (`Runner.warmup`),
then the decode step at `--batch` rows x `--context` cached tokens (median of `--runs` calls).

Variants (`--variants`, each run in its own process, in turn, `--rounds` times):
  - "scan":     the XLA backend as it ships (a scanned layer stack over folded KV pages);
  - "unrolled": the XLA backend with the stack unrolled over the same pages (`scan=False`);
  - "native":   the native CPU backend.
A variant "NAME=PATH" runs another checkout's default (e.g. the commit before the redesign, whose
runner only unrolls: "base=/path/to/checkout"), importing that tree's jserve; give
`--tree-python` an interpreter whose site-packages hold the dependencies but no editable install
of jserve (an editable install's finder would hand out this tree's modules).

Prints a table and writes JSON (`--out`):
  python scripts/bench_cold_start.py --kernel reference --variants scan unrolled base=/tmp/base
  python scripts/bench_cold_start.py --kernel gpu --dtype bfloat16 --variants scan unrolled   # on a GPU
  python scripts/bench_cold_start.py --kernel tpu --dtype bfloat16 --variants scan unrolled   # on a TPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict:
    """In this process: build, warm up and time the decode step for one variant."""
    t0 = time.perf_counter()
    import jax  # noqa: F401  (importing it is part of what a server pays)

    from jserve.llm import LLM

    try:  # the step contract since the backend redesign; before it, tuples
        from jserve.runtime.steps import StepRow

        def call(runner, rows):
            runner.execute([StepRow(*r) for r in rows])
    except ImportError:
        from jserve.runner import GREEDY  # the module's name before the redesign (noqa: the old tree)

        def call(runner, rows):
            runner.execute(rows, [GREEDY] * len(rows))

    kwargs = dict(max_num_seqs=args.batch, max_model_len=args.max_model_len, compilation_cache=False,
                  warmup=False)
    backend = args.kernel
    if args.variant in ("scan", "unrolled"):
        from jserve.runtime.backends import XlaBackend

        backend = XlaBackend(args.kernel, scan=args.variant == "scan")
    elif args.variant == "native":
        backend = "cpu"
    llm = LLM(args.model, backend=backend, dtype=args.dtype, **kwargs)
    loaded = time.perf_counter()
    runner = llm.runner
    runner.warmup(progress=False)
    ready = time.perf_counter()
    compiled = runner.num_compilations
    pages = -(-(args.context + 1) // runner.page_size)
    rows = [(args.context, [1], list(range(1 + j * pages, 1 + (j + 1) * pages))) for j in range(args.batch)]
    times = []
    for i in range(args.runs + 1):
        t = time.perf_counter()
        call(runner, rows)
        if i:  # the first call is a warm-up
            times.append(time.perf_counter() - t)
    import jserve

    return dict(variant=args.variant, kernel=args.kernel, tree=str(Path(jserve.__file__).parents[1]),
                load_s=loaded - t0, warmup_s=ready - loaded,
                ready_s=ready - t0, shapes=compiled, per_shape_s=(ready - loaded) / max(compiled, 1),
                decode_ms=1e3 * statistics.median(times), decode_min_ms=1e3 * min(times),
                batch=args.batch, context=args.context, runs=args.runs,
                compilations_after_warmup=runner.num_compilations_after_warmup)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--kernel", default="reference", help="the XLA backend's attention kernel")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weight (and KV) dtype; the Mosaic GPU kernel needs bfloat16")
    p.add_argument("--variants", nargs="+", default=["scan", "unrolled"],
                   help="scan, unrolled, native, or NAME=TREE for another checkout's default")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--tree-python", default=sys.executable, help="the interpreter for NAME=PATH variants")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child's
    args = p.parse_args(argv)
    if args.variant is not None:
        print(json.dumps(measure(args)))
        return 0
    results = []
    for _ in range(args.rounds):
        for spec in args.variants:
            name, _, tree = spec.partition("=")
            tree = Path(tree) if tree else ROOT
            python = args.tree_python if "=" in spec else sys.executable
            child = [python, str(Path(__file__).resolve()), "--variant", "tree" if "=" in spec else name,
                     "--kernel", args.kernel, "--batch", str(args.batch), "--context", str(args.context),
                     "--max-model-len", str(args.max_model_len), "--runs", str(args.runs)]
            if args.dtype:
                child += ["--dtype", args.dtype]
            if args.model:
                child += ["--model", args.model]
            env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
            out = subprocess.run(child, cwd=tree, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["variant"] = name
            results.append(result)
            print(f"{name:>10}  ready {result['ready_s']:7.1f} s  (load {result['load_s']:5.1f}, warm-up "
                  f"{result['warmup_s']:6.1f} s for {result['shapes']} shapes, {result['per_shape_s']:.2f} s each)"
                  f"  decode {result['decode_ms']:7.1f} ms", flush=True)
    print("\n| variant | ready s | warm-up s | shapes | s/shape | decode ms (median) | decode ms (min) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(r["variant"] for r in results):
        rs = [r for r in results if r["variant"] == name]
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        print(f"| {name} | {med('ready_s'):.1f} | {med('warmup_s'):.1f} | {rs[0]['shapes']} | "
              f"{med('per_shape_s'):.2f} | {med('decode_ms'):.1f} | {min(r['decode_min_ms'] for r in rs):.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
