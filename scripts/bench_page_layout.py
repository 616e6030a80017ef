"""Decode step time for KV page sizes, with and without huge pages, side by side in one process.

Each variant is its own engine over the real model (default SmolLM2-135M) with `page_size` tokens
per page and huge pages on or off (`jserve.runtime.huge_pages`); every row has `context` cached tokens on
pages drawn at random from a pool twice the size the rows need (the engine's free list scatters
a long-running server's pages the same way). Variants take turns call by call, so a busy machine
slows them alike. Prints median (min) per variant and writes JSON with --out.

    python scripts/bench_page_layout.py [--page-size 16 64] [--context 365 1000] [--batch 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jserve.llm import enable_compilation_cache  # noqa: E402
from jserve.model.checkpoint import load_checkpoint, resolve_model  # noqa: E402
from jserve.runtime.runner import Runner  # noqa: E402
from jserve.runtime.steps import StepRow  # noqa: E402


def build(config, params, page_size: int, huge: bool, batch: int, max_len: int) -> Runner:
    runner = Runner(config, params, num_pages=2 * batch * max_len // page_size + 1, page_size=page_size,
                    max_model_len=max_len, kv_dtype=params["embed"].dtype, batch_buckets=(batch,),
                    huge_pages=huge)
    runner.huge_pages.wait()
    return runner


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--page-size", type=int, nargs="*", default=[16, 64])
    p.add_argument("--huge-pages", nargs="*", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--context", type=int, nargs="*", default=[365, 1000])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    enable_compilation_cache()
    config, params, _ = load_checkpoint(resolve_model(args.model))
    max_len = 2048 if max(args.context) < 2048 else max(args.context) + 1
    rng = np.random.default_rng(args.seed)
    variants = list(itertools.product(args.page_size, [h == "on" for h in args.huge_pages]))
    runners = {v: build(config, params, *v, args.batch, max_len) for v in variants}
    name = {v: f"page {v[0]}, huge {'on' if v[1] else 'off'}" for v in variants}
    print(f"jax {jax.__version__}; batch {args.batch}; median (min) of {args.runs} decode steps, "
          f"variants interleaved; pages scattered over a pool twice the rows' need")
    print(f"{'context':>8}  " + "".join(f"{name[v]:>24}" for v in variants))
    results = []
    for context in args.context:
        calls = {}
        for v, runner in runners.items():
            pool = runner.num_pages - 1
            pages = math.ceil((context + 1) / v[0])
            ids = rng.permutation(np.arange(1, pool + 1))[:args.batch * pages].reshape(args.batch, pages)
            rows = [StepRow(context, [1], [int(x) for x in ids[j]]) for j in range(args.batch)]
            runner.execute(rows)  # compiles this shape
            calls[v] = (runner, rows)
        times = {v: [] for v in variants}
        for i in range(args.runs):
            for v in (variants if i % 2 else variants[::-1]):
                runner, rows = calls[v]
                runner.execute(rows)
                times[v].append(runner.records[-1].seconds)
        print(f"{context:>8}  " + "".join(
            f"{1e3 * statistics.median(times[v]):>15.1f} ({1e3 * min(times[v]):5.1f})" for v in variants),
            flush=True)
        results += [dict(page_size=v[0], huge_pages=v[1], context=context, batch=args.batch,
                         median_ms=1e3 * statistics.median(times[v]), min_ms=1e3 * min(times[v]))
                    for v in variants]
    if args.out:
        args.out.write_text(json.dumps(dict(jax=jax.__version__, runs=args.runs, results=results), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
