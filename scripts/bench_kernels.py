"""Benchmark the paged-attention kernels against the jnp reference (a gather of pages).

For each available backend and shape: median wall time over several runs (backends interleaved
run by run, so a busy machine slows them alike), the bytes the kernel must read (K and V of the
live pages, plus q), achieved GB/s, that as a fraction of the machine's memory bandwidth (DESIGN
§6: ~27 GB/s on the 2-core development machine), and the time over the reference's.

The page table is `--table-width` slots wide, as the engine passes it (max_model_len /
page_size; padding slots -> the null page); `--table-width 0` gives every row a table of exactly
its live pages, the best case for the reference's gather.

On an NVIDIA GPU use `scripts/bench_gpu_attention.py` instead: it checks the Mosaic GPU kernel
and times it with CUPTI (kernel time, not host dispatch), against the datasheet's bandwidth.

    python scripts/bench_kernels.py [--out bench.json] [--runs 10] [--dtype float32]
    python scripts/bench_kernels.py --heads smollm2 --batch 1 4 16 --context 256 1024 --table-width 0
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
# jax platform -> its kernel backends ("cpu": the native decode kernel; "cpu_pallas": interpret mode)
KERNEL_BACKENDS = {"cpu": ["cpu", "cpu_pallas"], "tpu": ["tpu"], "gpu": ["gpu"]}


def make_inputs(batch, context, num_q_heads, num_kv_heads, dtype, tokens, seed=0, width=0):
    """A pool holding exactly the live pages, randomly permuted, every row at `context` keys.

    The table has `width` slots per row (0: exactly the live pages); the rest point at page 0.
    """
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1
    pool = (num_kv_heads, num_pages, PAGE_SIZE, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(pool), dtype)
    v_pages = jnp.asarray(rng.standard_normal(pool), dtype)
    table = np.zeros((batch, max(width, pages_per_seq)), np.int32)
    table[:, :pages_per_seq] = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_seq)
    q_shape = (batch, num_q_heads, HEAD_DIM) if tokens is None else (batch, tokens, num_q_heads,
                                                                      HEAD_DIM)
    q = jnp.asarray(rng.standard_normal(q_shape), dtype)
    return q, k_pages, v_pages, jnp.asarray(table)


def time_calls(fns, args, runs):
    """Per function: (first call's seconds, i.e. mostly compile; median seconds of `runs` later
    calls). The functions take turns run by run, so load from other processes hits them alike."""
    first = []
    for fn in fns:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first.append(time.perf_counter() - start)
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - start)
    return [(f, statistics.median(t)) for f, t in zip(first, times)]


def bench_case(backends, kind, batch, heads, context, dtype, runs, bandwidth, width, tokens):
    num_q_heads, num_kv_heads = HEADS[heads]
    tokens = None if kind == "decode" else tokens
    q, k_pages, v_pages, table = make_inputs(batch, context, num_q_heads, num_kv_heads, dtype,
                                             tokens, width=width)
    fns = []
    for backend in backends:
        kw = dict(backend=backend, sm_scale=HEAD_DIM ** -0.5)
        if kind == "decode":
            lengths = jnp.full((batch,), context, jnp.int32)
            fns.append(lambda q, k, v, t, kw=kw: paged_attention(q, k, v, lengths, t, **kw))
        else:  # the last chunk of a prompt of `context` tokens
            q_start = jnp.full((batch,), context - tokens, jnp.int32)
            q_lens = jnp.full((batch,), tokens, jnp.int32)
            fns.append(lambda q, k, v, t, kw=kw: paged_prefill_attention(q, k, v, q_start, q_lens,
                                                                         t, **kw))
    live_pages = batch * (-(-context // PAGE_SIZE))
    nbytes = 2 * live_pages * num_kv_heads * PAGE_SIZE * HEAD_DIM * k_pages.dtype.itemsize
    nbytes += q.size * q.dtype.itemsize
    results = []
    for backend, (first, seconds) in zip(backends, time_calls(fns, (q, k_pages, v_pages, table),
                                                              runs)):
        gbps = nbytes / seconds / 1e9
        results.append(dict(
            backend=backend, kind=kind, batch=batch, heads=heads, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, page_size=PAGE_SIZE, context=context,
            tokens=tokens or 1, table_width=table.shape[1], dtype=jnp.dtype(dtype).name,
            ms=seconds * 1e3, first_call_s=first, bytes=nbytes, gbps=gbps,
            of_bandwidth=gbps / bandwidth))
    ref = next((r["ms"] for r in results if r["backend"] == "reference"), None)
    for r in results:
        r["vs_reference"] = r["ms"] / ref if ref else None
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bandwidth", type=float, default=27.0,
                        help="the machine's memory bandwidth in GB/s (DESIGN §6: 27 on the dev box)")
    parser.add_argument("--backends", nargs="*",
                        help="default: this platform's kernel backends and 'reference'")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--context", type=int, nargs="*", default=[256, 1024, 2048])
    parser.add_argument("--table-width", type=int, default=128,
                        help="page-table slots per row, as the engine passes them (max_model_len / "
                             "page_size: 2048 / 16 = 128); 0: exactly the live pages")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[128, 512],
                        help="chunk sizes of the prefill rows (batch 2, the prompt's last chunk)")
    parser.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill-chunk rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    backends = args.backends or [*KERNEL_BACKENDS[jax.default_backend()], "reference"]
    dtype = jnp.dtype(args.dtype)
    cases = [("decode", b, h, c) for h, b, c in itertools.product(args.heads, args.batch,
                                                                  args.context)]
    if not args.no_prefill:
        cases += [("prefill", 2, h, c, t) for h in args.heads for c in args.context
                  for t in args.prefill_tokens if c > t]
    cases = [case if len(case) == 5 else (*case, 1) for case in cases]
    header = (f"{'backend':<11}{'kind':<8}{'batch':>6}{'heads q/kv':>11}{'context':>8}{'tokens':>7}"
              f"{'ms':>9}{'MB read':>9}{'GB/s':>7}{'of bw':>7}{'vs ref':>7}{'1st call s':>11}")
    print(f"jax {jax.__version__}, platform {jax.default_backend()}, dtype {dtype.name}, "
          f"page {PAGE_SIZE}, head_dim {HEAD_DIM}, table width "
          f"{args.table_width or 'live pages'}, median of {args.runs}")
    print(header)
    results = []
    for kind, batch, heads, context, tokens in cases:
        for r in bench_case(backends, kind, batch, heads, context, dtype, args.runs,
                            args.bandwidth, args.table_width, tokens):
            results.append(r)
            vs = f"{r['vs_reference']:>7.2f}" if r["vs_reference"] else f"{'-':>7}"
            print(f"{r['backend']:<11}{kind:<8}{batch:>6}"
                  f"{f'{r['num_q_heads']}/{r['num_kv_heads']}':>11}{context:>8}{r['tokens']:>7}"
                  f"{r['ms']:>9.2f}{r['bytes'] / 1e6:>9.1f}{r['gbps']:>7.2f}"
                  f"{r['of_bandwidth']:>7.1%}{vs}{r['first_call_s']:>11.2f}", flush=True)
    if args.out:
        meta = dict(jax=jax.__version__, platform=jax.default_backend(), dtype=dtype.name,
                    runs=args.runs, bandwidth_gbps=args.bandwidth, table_width=args.table_width)
        args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
