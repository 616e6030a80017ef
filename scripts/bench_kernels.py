"""Benchmark the paged-attention kernels against the jnp reference (a gather of pages).

For each available backend and shape: median wall time over several runs, the bytes the kernel
must read (K and V of the live pages, plus q), achieved GB/s, and that as a fraction of the
machine's memory bandwidth (DESIGN §6: ~27 GB/s on the 2-core development machine).

    python scripts/bench_kernels.py [--out bench.json] [--runs 10] [--dtype float32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention  # noqa: E402

logger = logging.getLogger(__name__)

PAGE_SIZE, HEAD_DIM = 16, 64
HEADS = {"kv8": (8, 8), "smollm2": (9, 3)}  # name: (num_q_heads, num_kv_heads)
KERNEL_BACKEND = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu"}  # jax platform -> kernel backend


def make_inputs(batch, context, num_q_heads, num_kv_heads, dtype, tokens, seed=0):
    """A pool holding exactly the live pages, randomly permuted, every row at `context` keys."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1
    pool = (num_kv_heads, num_pages, PAGE_SIZE, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(pool), dtype)
    v_pages = jnp.asarray(rng.standard_normal(pool), dtype)
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_seq).astype(np.int32)
    q_shape = (batch, num_q_heads, HEAD_DIM) if tokens is None else (batch, tokens, num_q_heads,
                                                                      HEAD_DIM)
    q = jnp.asarray(rng.standard_normal(q_shape), dtype)
    return q, k_pages, v_pages, jnp.asarray(table)


def time_call(fn, args, runs):
    """(first call's seconds, i.e. mostly compile; median seconds of `runs` later calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def bench_case(backend, kind, batch, heads, context, dtype, runs, bandwidth):
    num_q_heads, num_kv_heads = HEADS[heads]
    tokens = None if kind == "decode" else 128
    q, k_pages, v_pages, table = make_inputs(batch, context, num_q_heads, num_kv_heads, dtype,
                                             tokens)
    kw = dict(backend=backend, sm_scale=HEAD_DIM ** -0.5)
    if kind == "decode":
        lengths = jnp.full((batch,), context, jnp.int32)
        fn = lambda q, k, v, t: paged_attention(q, k, v, lengths, t, **kw)
    else:  # the last chunk of a prompt of `context` tokens
        q_start = jnp.full((batch,), context - tokens, jnp.int32)
        q_lens = jnp.full((batch,), tokens, jnp.int32)
        fn = lambda q, k, v, t: paged_prefill_attention(q, k, v, q_start, q_lens, t, **kw)
    first, seconds = time_call(fn, (q, k_pages, v_pages, table), runs)
    live_pages = batch * (-(-context // PAGE_SIZE))
    nbytes = 2 * live_pages * num_kv_heads * PAGE_SIZE * HEAD_DIM * k_pages.dtype.itemsize
    nbytes += q.size * q.dtype.itemsize
    gbps = nbytes / seconds / 1e9
    return dict(backend=backend, kind=kind, batch=batch, heads=heads, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                context=context, tokens=tokens or 1, dtype=jnp.dtype(dtype).name,
                ms=seconds * 1e3, first_call_s=first, bytes=nbytes, gbps=gbps, of_bandwidth=gbps / bandwidth)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bandwidth", type=float, default=27.0,
                        help="the machine's memory bandwidth in GB/s (DESIGN §6: 27 on the dev box)")
    parser.add_argument("--backends", nargs="*",
                        help="default: this platform's kernel backend and 'reference'")
    parser.add_argument("--batch", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--context", type=int, nargs="*", default=[256, 1024, 2048])
    parser.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill-chunk rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    backends = args.backends or [KERNEL_BACKEND[jax.default_backend()], "reference"]
    dtype = jnp.dtype(args.dtype)
    cases = [("decode", b, h, c) for h, b, c in itertools.product(args.heads, args.batch,
                                                                  args.context)]
    if not args.no_prefill:
        cases += [("prefill", 2, h, c) for h in args.heads for c in args.context if c > 128]
    header = (f"{'backend':<10}{'kind':<8}{'batch':>6}{'heads q/kv':>11}{'context':>8}"
              f"{'ms':>9}{'MB read':>9}{'GB/s':>7}{'of bw':>7}{'1st call s':>11}")
    print(f"jax {jax.__version__}, platform {jax.default_backend()}, dtype {dtype.name}, "
          f"page {PAGE_SIZE}, head_dim {HEAD_DIM}, median of {args.runs}")
    print(header)
    results = []
    for kind, batch, heads, context in cases:
        for backend in backends:
            r = bench_case(backend, kind, batch, heads, context, dtype, args.runs, args.bandwidth)
            results.append(r)
            print(f"{backend:<10}{kind:<8}{batch:>6}{f'{r['num_q_heads']}/{r['num_kv_heads']}':>11}"
                  f"{context:>8}{r['ms']:>9.2f}{r['bytes'] / 1e6:>9.1f}{r['gbps']:>7.2f}"
                  f"{r['of_bandwidth']:>7.1%}{r['first_call_s']:>11.2f}", flush=True)
    if args.out:
        meta = dict(jax=jax.__version__, platform=jax.default_backend(), dtype=dtype.name,
                    runs=args.runs, bandwidth_gbps=args.bandwidth)
        args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
