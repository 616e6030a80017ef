"""Check and time the Mosaic GPU paged-attention kernel on an NVIDIA GPU (Hopper).

1. The machine's ceiling: a large bfloat16 `x + 1` (bytes read + written over its time).
2. Correctness: the kernel against the jnp reference (float32 arithmetic) on a grid of shapes
   (head_dim 64/128, query heads per KV head 1/3/4/8, page sizes 16/32, lengths 0, 1, a page,
   a page plus one, full; sliding window, soft cap, prefill chunks, float16), random page
   permutations, fresh random inputs per case.
3. Timings (CUPTI kernel time via `jax.experimental.mosaic.gpu.profiler.measure`, median of
   `--iters`; wall clock per call when CUPTI is unavailable): decode at the given batch and
   context for a few pipeline variants, the public `paged_attention(backend="gpu")` (what the
   engine runs: kernel plus the small packing ops), the XLA reference (gather + dense softmax)
   and JAX's own Pallas Triton paged-attention kernel; one prefill chunk.

Prints a table (bytes the call must read, achieved GB/s, fraction of the measured copy
bandwidth and of the datasheet's 4.8 TB/s) and writes JSON.

    python -m benchmarks.kernels.gpu_attention --out gpu.json
    python -m benchmarks.kernels.gpu_attention --interpret --checks-only   # on CPU: GPU interpreter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import gpu, paged_attention, paged_prefill_attention
from pallas_kernels.paged_attention.common import pack_rows, unpack_rows
from pallas_kernels.paged_attention.reference import paged_prefill_attention_reference

DATASHEET_BW = 4.8e12  # H200 HBM3e, bytes/s
SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # q heads, KV heads, head_dim


def make_pool(rng, num_kv_heads, num_pages, page_size, head_dim, dtype):
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))


def make_table(rng, batch, width, kv_lens, page_size, num_pages):
    """Random distinct pages per row for its live slots; the rest point at the null page 0."""
    table = np.zeros((batch, width), np.int32)
    pages = rng.permutation(np.arange(1, num_pages))
    used = 0
    for b, n in enumerate(kv_lens):
        live = -(-int(n) // page_size)
        table[b, :live] = pages[used:used + live]
        used += live
    return jnp.asarray(table)


def kernel_call(q, k_pages, v_pages, q_start, q_lens, table, *, groups, interpret, **kw):
    """q [batch, tokens, heads, head_dim] through gpu.paged_attention_rows (no ops.py)."""
    out = gpu.paged_attention_rows(pack_rows(q, k_pages.shape[0]), k_pages, v_pages, q_start,
                                   q_lens, table, groups=groups, interpret=interpret, **kw)
    return unpack_rows(out, q.shape[1])


# name: head_dim, groups, page_size, dtype, tokens, q_start (None: decode), window, soft cap,
# pages_per_block, stages, splits
CHECKS = [
    ("decode hd64 g3 ps16", 64, 3, 16, jnp.bfloat16, 1, None, None, None, 4, 3, 1),
    ("decode hd128 g1 ps16", 128, 1, 16, jnp.bfloat16, 1, None, None, None, 4, 2, 1),
    ("decode hd128 g4 ps32", 128, 4, 32, jnp.bfloat16, 1, None, None, None, 2, 3, 1),
    ("decode hd128 g8 ps16 ppb8", 128, 8, 16, jnp.bfloat16, 1, None, None, None, 8, 3, 1),
    ("decode hd64 g8 ps32 f16", 64, 8, 32, jnp.float16, 1, None, None, None, 4, 2, 1),
    ("decode window 20 cap 30", 64, 4, 16, jnp.bfloat16, 1, None, 20, 30.0, 4, 3, 1),
    ("decode window 100", 128, 3, 16, jnp.bfloat16, 1, None, 100, None, 4, 2, 1),
    ("decode 3 splits", 128, 4, 16, jnp.bfloat16, 1, None, None, None, 4, 2, 3),
    ("decode 4 splits window 40", 64, 3, 16, jnp.bfloat16, 1, None, 40, None, 4, 2, 4),
    ("prefill 40 tok hd128 g4", 128, 4, 16, jnp.bfloat16, 40, [0, 13, 100, 0], None, None, 4, 3, 1),
    ("prefill 24 tok hd64 g3 window", 64, 3, 32, jnp.bfloat16, 24, [5, 0, 64, 200], 30, None, 2, 2, 1),
    ("prefill 40 tok 2 splits", 128, 4, 16, jnp.bfloat16, 40, [0, 13, 100, 0], None, None, 4, 2, 2),
]


def run_checks(interpret: bool, only=None):
    results = []
    for (name, head_dim, groups, page_size, dtype, tokens, starts, window, cap, ppb, stages,
         splits) in CHECKS:
        if only and only not in name:
            continue
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        num_kv_heads, max_pages = 2, 16
        full = max_pages * page_size
        if starts is None:  # decode: every interesting length in one batch
            lengths = np.array([0, 1, page_size, page_size + 1, full, rng.integers(2, full)],
                               np.int32)
            q_start, q_lens = np.maximum(lengths - 1, 0), np.minimum(lengths, 1)
        else:
            q_start = np.array(starts, np.int32)
            q_lens = np.array([tokens, tokens - 3, 1, 0], np.int32)
        q_start = np.minimum(q_start, full - tokens).astype(np.int32)
        batch = len(q_start)
        num_pages = batch * max_pages + 1
        k_pages, v_pages = make_pool(rng, num_kv_heads, num_pages, page_size, head_dim, dtype)
        table = make_table(rng, batch, max_pages, q_start + q_lens, page_size, num_pages)
        q = jnp.asarray(rng.standard_normal((batch, tokens, num_kv_heads * groups, head_dim)),
                        dtype)
        kw = dict(sm_scale=head_dim ** -0.5, soft_cap=cap, sliding_window=window)
        args = (q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens), table)
        row = dict(name=name)
        try:
            want = np.asarray(paged_prefill_attention_reference(
                q.astype(jnp.float32), k_pages.astype(jnp.float32), v_pages.astype(jnp.float32),
                *args[3:], **kw))
            out = kernel_call(*args, groups=groups, interpret=interpret, pages_per_block=ppb,
                              stages=stages, splits=splits, **kw)
            got = np.asarray(jnp.asarray(out).astype(jnp.float32))
            err = np.abs(got - want)
            row.update(max_abs_err=float(err.max()),
                       rel_err=float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                       padded_rows_zero=bool(not got[q_lens == 0].any()),
                       ok=bool(np.allclose(got, want, atol=2e-2, rtol=2e-2)
                               and not got[q_lens == 0].any() and np.isfinite(got).all()))
        except Exception as e:  # report and go on: one failure should not hide the others
            failed(row, e)
        print(f"check {name:34s} {'ok' if row['ok'] else 'FAIL'} "
              f"{row.get('max_abs_err', '')} {row.get('rel_err', '')} {row.get('error', '')}",
              flush=True)
        results.append(row)
    return results


def failed(row: dict, error: Exception) -> None:
    """Record an error in a result row (and print its traceback) so the run goes on."""
    row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:800]}")
    traceback.print_exc()


def timer():
    """-> f(fn, args, iters) giving the median seconds per call, and the method's name."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        def cupti(fn, args, iters):
            _, times = profiler.measure(fn, iterations=iters)(*args)
            return statistics.median(times) / 1e3
        x = jnp.ones((1024,), jnp.float32)
        cupti(jax.jit(lambda x: x + 1), (x,), 2)
        return cupti, "cupti"
    except Exception as e:  # noqa: BLE001
        print(f"CUPTI timing unavailable ({type(e).__name__}: {e}); wall clock instead", flush=True)

    def wall(fn, args, iters):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / iters)
        return statistics.median(times)
    return wall, "wall"


def copy_bandwidth(measure, iters):
    x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)  # 2 GiB, made on device
    fn = jax.jit(lambda x: x + 1)
    jax.block_until_ready(fn(x))
    seconds = measure(fn, (x,), iters)
    return 2 * x.size * x.dtype.itemsize / seconds


def decode_inputs(shape, batch, context, page_size, dtype):
    """A decode batch at `context` tokens per row: the kernels' arguments (q, k_pages, v_pages,
    q_start, q_lens, table) and the bytes a call must read."""
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(1)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    k_pages, v_pages = make_pool(rng, num_kv_heads, num_pages, page_size, head_dim, dtype)
    lengths = np.full(batch, context, np.int32)
    table = make_table(rng, batch, pages_per_seq, lengths, page_size, num_pages)
    q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim)), dtype)
    lengths = jnp.asarray(lengths)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * batch * num_kv_heads * context * head_dim * itemsize
    min_bytes = kv_bytes + 2 * q.size * itemsize + table.size * 4
    q_start, q_lens = jnp.maximum(lengths - 1, 0), jnp.ones_like(lengths)
    return (q, k_pages, v_pages, q_start, q_lens, table), min_bytes


def decode_impls(shape, page_size, variants, compare=True) -> dict:
    """The decode implementations to time, by name: the kernel's pipeline variants, the public
    entry point, the XLA reference and (with `compare`) JAX's Triton kernel."""
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    groups = num_q_heads // num_kv_heads
    sm_scale = head_dim ** -0.5
    fns = {}
    for ppb, stages, splits in variants:
        ppb = max(1, ppb * 16 // page_size)  # variants count 16-token pages: keep their keys
        fns[f"kernel ppb={ppb} stages={stages} splits={splits or 'auto'}"] = jax.jit(
            lambda q, k, v, s, n, t, ppb=ppb, stages=stages, splits=splits: kernel_call(
                q[:, None], k, v, s, n, t, groups=groups, interpret=False, sm_scale=sm_scale,
                soft_cap=None, sliding_window=None, pages_per_block=ppb, stages=stages,
                splits=splits or None)[:, 0])
    fns["paged_attention(backend=gpu)"] = jax.jit(
        lambda q, k, v, s, n, t: paged_attention(q, k, v, s + n, t, backend="gpu",
                                                 sm_scale=sm_scale))
    fns["XLA reference (gather)"] = jax.jit(
        lambda q, k, v, s, n, t: paged_attention(q, k, v, s + n, t, backend="reference",
                                                 sm_scale=sm_scale))
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as triton_pa
        fns["JAX Pallas Triton paged_attention"] = jax.jit(
            lambda q, k, v, s, n, t: triton_pa.paged_attention(
                q * sm_scale, k, v, t, s + n, pages_per_compute_block=max(1, 64 // page_size)))
    except Exception as e:  # noqa: BLE001
        print(f"JAX's Triton paged attention unavailable: {e}")
    if not compare:  # not JAX's Triton kernel (the reference still checks the outputs)
        fns.pop("JAX Pallas Triton paged_attention", None)
    return fns


def bench_decode(measure, iters, shape, batch, context, page_size, dtype, variants, copy_bw,
                 compare=True):
    args, min_bytes = decode_inputs(shape, batch, context, page_size, dtype)
    fns = decode_impls(shape, page_size, variants, compare)
    rows = []
    want = None
    for name, fn in fns.items():
        row = dict(shape=shape, batch=batch, context=context, page_size=page_size,
                   dtype=jnp.dtype(dtype).name, impl=name, min_bytes=min_bytes)
        try:
            out = jax.block_until_ready(fn(*args))
            if want is None:
                want = np.asarray(fns["XLA reference (gather)"](*args).astype(jnp.float32))
            row["max_abs_err_vs_reference"] = float(
                np.abs(np.asarray(out.astype(jnp.float32)) - want).max())
            seconds = measure(fn, args, iters)
            row.update(us=seconds * 1e6, gbps=min_bytes / seconds / 1e9,
                       frac_copy_bw=min_bytes / seconds / copy_bw,
                       frac_datasheet=min_bytes / seconds / DATASHEET_BW)
        except Exception as e:  # noqa: BLE001
            failed(row, e)
        rows.append(row)
        print_row(row)
    return rows


def bench_prefill(measure, iters, shape, batch, tokens, context, page_size, dtype, copy_bw):
    """One chunk of `tokens` new tokens per row after `context - tokens` cached ones."""
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(2)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    k_pages, v_pages = make_pool(rng, num_kv_heads, num_pages, page_size, head_dim, dtype)
    table = make_table(rng, batch, pages_per_seq, np.full(batch, context), page_size, num_pages)
    q = jnp.asarray(rng.standard_normal((batch, tokens, num_q_heads, head_dim)), dtype)
    q_start = jnp.full((batch,), context - tokens, jnp.int32)
    q_lens = jnp.full((batch,), tokens, jnp.int32)
    sm_scale = head_dim ** -0.5
    # Causal FLOPs: QK and PV, each 2 * head_dim per (query head, attended key).
    attended = sum(context - tokens + t + 1 for t in range(tokens))
    flops = 4 * batch * num_q_heads * head_dim * attended
    rows = []
    for backend in ("gpu", "reference"):
        fn = jax.jit(lambda q, k, v, s, n, t, backend=backend: paged_prefill_attention(
            q, k, v, s, n, t, backend=backend, sm_scale=sm_scale))
        row = dict(shape=shape, batch=batch, context=context, tokens=tokens, page_size=page_size,
                   impl=f"prefill {backend}", dtype=jnp.dtype(dtype).name, flops=flops)
        try:
            jax.block_until_ready(fn(q, k_pages, v_pages, q_start, q_lens, table))
            seconds = measure(fn, (q, k_pages, v_pages, q_start, q_lens, table), iters)
            row.update(us=seconds * 1e6, tflops=flops / seconds / 1e12)
        except Exception as e:  # noqa: BLE001
            failed(row, e)
        rows.append(row)
        print_row(row)
    return rows


def print_row(row):
    head = (f"{row['shape']:8s} b={row['batch']:<3d} ctx={row['context']:<5d} "
            f"ps={row.get('page_size', 16):<3d}{row['impl']:36s}")
    if "error" in row:
        print(f"{head} ERROR {row['error'][:200]}", flush=True)
    elif "tflops" in row:
        print(f"{head} {row['us']:9.1f} us {row['tflops']:7.1f} TFLOP/s", flush=True)
    else:
        print(f"{head} {row['us']:9.1f} us {row['gbps']:8.0f} GB/s {row['frac_copy_bw']:6.1%} of copy "
              f"{row['frac_datasheet']:6.1%} of 4.8 TB/s  err {row['max_abs_err_vs_reference']:.3g}",
              flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--interpret", action="store_true",
                        help="run the checks in the Mosaic GPU interpreter (on CPU)")
    parser.add_argument("--checks-only", action="store_true")
    parser.add_argument("--only", help="run the checks whose name contains this")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="*", default=[64])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--variants", default="4x2x1,4x3x1,8x2x1,4x2x2,4x2x0",
                        help="pages_per_block x stages x splits (0: auto), comma-separated")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--page-sizes", type=int, nargs="*", default=[16])
    parser.add_argument("--no-compare", action="store_true",
                        help="do not time JAX's Triton kernel")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-checks", action="store_true")
    args = parser.parse_args(argv)
    if not args.interpret:
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    report = dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind))
    print(report, flush=True)
    report["checks"] = [] if args.no_checks else run_checks(args.interpret, args.only)
    if not args.checks_only:
        measure, method = timer()
        report["timing"] = method
        copy_bw = copy_bandwidth(measure, args.iters)
        report["copy_bandwidth"] = copy_bw
        print(f"copy bandwidth (x + 1, bf16, 4 GiB moved): {copy_bw / 1e12:.2f} TB/s ({method})",
              flush=True)
        variants = [tuple(map(int, v.split("x"))) for v in args.variants.split(",") if v]
        rows = []
        for shape in args.shapes:
            for page_size in args.page_sizes:
                for batch in args.batch:
                    rows += bench_decode(measure, args.iters, shape, batch, args.context,
                                         page_size, jnp.bfloat16, variants, copy_bw,
                                         not args.no_compare)
        if not args.no_prefill:
            rows += bench_prefill(measure, args.iters, "llama8b", 4, 512, 2048, 16,
                                  jnp.bfloat16, copy_bw)
        report["rows"] = rows
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    bad = [c["name"] for c in report["checks"] if not c["ok"]]
    print(f"checks: {len(report['checks']) - len(bad)} ok, {len(bad)} failed {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
