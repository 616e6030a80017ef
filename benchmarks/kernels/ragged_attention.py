"""Check and time the ragged paged-attention kernels (`ragged_paged_attention`) on a GPU or TPU.

1. Correctness: the kernel ("gpu": Mosaic GPU, Hopper; "tpu": Mosaic TPU) against the XLA
   reference on a grid: Llama-3.1-8B's and SmolLM2's attention shapes, page sizes 16 and 64,
   bfloat16 and int8 pages, and three batches: decode only, mixed (decode rows plus prefill chunks
   of odd lengths, one continuing a cached prefix, padding rows and tokens) and one long chunk;
   with a sliding window and a soft cap on some. Padding tokens must come out as zeros.
2. Timings (CUPTI kernel time on a GPU when available, else the wall clock per call, median):
   the ragged call on each batch against what the engine runs today for the same rows (a decode
   call plus a prefill call whose rows are padded to the longest chunk), with the live K/V bytes
   each must read and the ragged call's GB/s.

Prints a table and writes JSON (`--out`). On a CPU, `--dry-run` runs the same checks on tiny
shapes through the kernels' interpreters (Mosaic GPU interpreter for `--backend gpu`, Pallas TPU
interpret mode for `--backend tpu`) and times them by the wall clock, so the script is exercised here.

    python -m benchmarks.kernels.ragged_attention --backend gpu --out ragged_gpu.json   # on an H100/H200
    python -m benchmarks.kernels.ragged_attention --backend tpu --out ragged_tpu.json   # on a TPU VM
    JAX_PLATFORMS=cpu python -m benchmarks.kernels.ragged_attention --backend gpu --dry-run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention, ragged, ragged_tpu

SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # q heads, KV heads, head_dim
SM_SCALE = 0.08


def batches(dry_run: bool) -> dict[str, list[tuple[int, int]]]:
    """Named batches as rows of (new tokens, KV length)."""
    if dry_run:
        return {"decode": [(1, n) for n in (5, 40, 17, 64)],
                "mixed": [(1, 30), (1, 64), (13, 13), (1, 9), (9, 40), (0, 4)],
                "prefill": [(48, 48)]}
    return {"decode": [(1, 2048)] * 64,
            "mixed": [(1, 2048)] * 32 + [(511, 511), (333, 1357), (1, 100)],
            "prefill": [(2048, 2048)]}


def make_inputs(rng, rows, shape, page_size, kv_dtype, *, pad_rows=3, pad_tokens=5, seed=0):
    """The ragged call's arguments for `rows` (pool made on the device) and its scales kwargs."""
    num_q_heads, num_kv_heads, head_dim = shape
    max_pages = max(-(-kv // page_size) for _, kv in rows) + 1
    max_rows = len(rows) + pad_rows
    num_pages = sum(-(-kv // page_size) for _, kv in rows) + 1
    table = np.zeros((max_rows, max_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    used = 0
    for r, (_, kv) in enumerate(rows):
        n = -(-kv // page_size)
        table[r, :n] = perm[used:used + n]
        used += n
    q_lens = [q for q, _ in rows]
    total = sum(q_lens)
    cu = np.full(max_rows + 1, total, np.int32)
    cu[:len(rows) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens = np.zeros(max_rows, np.int32)
    kv_lens[:len(rows)] = [kv for _, kv in rows]
    keys = jax.random.split(jax.random.key(seed), 3)
    pshape = (num_kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(keys[0], (total + pad_tokens, num_q_heads, head_dim), jnp.bfloat16)
    kw = {}
    if jnp.dtype(kv_dtype) == jnp.int8:
        pages = [jax.random.randint(k, pshape, -127, 128, jnp.int32).astype(jnp.int8) for k in keys[1:]]
        kw = {name: jax.random.uniform(k, pshape[:3], jnp.float32, 0.002, 0.02)
              for name, k in zip(("k_scales", "v_scales"), jax.random.split(keys[2], 2))}
    else:
        pages = [jax.random.normal(k, pshape, kv_dtype) for k in keys[1:]]
    args = (q, pages[0], pages[1], jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray([len(rows)], jnp.int32))
    return args, kw


def kernel_fn(backend: str, dry_run: bool, opts: dict):
    """The kernel under test: the public entry point on a device; its interpreter in a dry run."""
    if not dry_run:
        return jax.jit(functools.partial(ragged.ragged_paged_attention, backend=backend, **opts))
    if backend == "gpu":
        return jax.jit(functools.partial(ragged.ragged_paged_attention_gpu, interpret=True, **opts))
    return jax.jit(functools.partial(ragged_tpu.ragged_paged_attention_tpu, interpret=True, **opts))


def separate_calls(backend: str, rows, opts: dict):
    """What the engine runs today for `rows`: one decode call for the one-token rows and one
    prefill call for the rest, each chunk padded to the longest. -> (fn(*ragged args), rows)."""
    decode = [i for i, (q, _) in enumerate(rows) if q == 1]
    chunks = [i for i, (q, _) in enumerate(rows) if q > 1]
    width = max([q for q, _ in rows if q > 1], default=1)

    def fn(q, k_pages, v_pages, kv_lens, table, cu, num_rows, **scales):
        outs = []
        if decode:
            idx = jnp.asarray(decode)
            outs.append(paged_attention(q[cu[idx]], k_pages, v_pages, kv_lens[idx], table[idx],
                                        backend=backend, **opts, **scales))
        if chunks:
            idx = jnp.asarray(chunks)
            tok = jnp.minimum(cu[idx][:, None] + jnp.arange(width)[None], q.shape[0] - 1)
            q_lens = cu[idx + 1] - cu[idx]
            outs.append(paged_prefill_attention(q[tok], k_pages, v_pages, kv_lens[idx] - q_lens,
                                                q_lens, table[idx], backend=backend, **opts, **scales))
        return outs
    return jax.jit(fn)


def timer(use_cupti: bool):
    """-> f(fn, args, kwargs, iters): median seconds per call, and the method's name."""
    if use_cupti:
        try:
            from jax.experimental.mosaic.gpu import profiler

            def cupti(fn, args, kw, iters):
                _, times = profiler.measure(lambda *a: fn(*a, **kw), iterations=iters)(*args)
                return statistics.median(times) / 1e3
            cupti(jax.jit(lambda x: x + 1), (jnp.ones((1024,), jnp.float32),), {}, 2)
            return cupti, "cupti"
        except Exception as e:  # noqa: BLE001
            print(f"CUPTI timing unavailable ({type(e).__name__}: {e}); wall clock instead", flush=True)

    def wall(fn, args, kw, iters):
        jax.block_until_ready(fn(*args, **kw))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(iters):
                out = fn(*args, **kw)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / iters)
        return statistics.median(times)
    return wall, "wall"


def live_bytes(rows, shape, page_size, kv_dtype) -> int:
    """K/V bytes of the rows' live pages (what an ideal kernel reads once), scales included."""
    _, num_kv_heads, head_dim = shape
    per_key = head_dim * jnp.dtype(kv_dtype).itemsize + (4 if jnp.dtype(kv_dtype) == jnp.int8 else 0)
    return 2 * num_kv_heads * per_key * sum(-(-kv // page_size) * page_size for _, kv in rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gpu", "tpu"), default="gpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes through the kernels' interpreters (runs on a CPU)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--checks-only", action="store_true", help="no timings")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), help="default: all (dry run: smollm2)")
    parser.add_argument("--page-sizes", nargs="+", type=int, help="default: 16 64 (dry run: 16)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def run_case(args, row: dict, rows, shape, page_size, kv_dtype, rng, seed: int, measure, iters: int) -> dict:
    """Check the kernel on one case against the reference (and time it and the separate calls
    unless --checks-only); `row` filled in, a failure recorded in it."""
    window, cap = row["sliding_window"], row["soft_cap"]
    try:
        opts = dict(sm_scale=SM_SCALE, soft_cap=cap, sliding_window=window)
        call, kw = make_inputs(rng, rows, shape, page_size, kv_dtype, seed=seed)
        fn = kernel_fn(args.backend, args.dry_run, opts)
        out = jax.block_until_ready(fn(*call, **kw))
        want = ragged.ragged_paged_attention(*call, backend="reference", **opts, **kw)
        total = row["tokens"]
        err = float(jnp.max(jnp.abs(out[:total].astype(jnp.float32)
                                    - want[:total].astype(jnp.float32))))
        pad = np.asarray(out[total:].astype(jnp.float32))
        row.update(max_err=err, padding_zero=bool(np.isfinite(pad).all() and not pad.any()))
        row["ok"] = bool(err < 3e-2 and row["padding_zero"] and out.dtype == call[0].dtype)
        row["live_bytes"] = live_bytes(rows, shape, page_size, kv_dtype)
        if not args.checks_only:
            row["ragged_s"] = measure(fn, call, kw, iters)
            row["gbps"] = row["live_bytes"] / row["ragged_s"] / 1e9
            # the existing kernels, called as the engine does (in a dry run
            # the reference, only to run this code)
            sep = separate_calls("reference" if args.dry_run else args.backend, rows, opts)
            row["separate_s"] = measure(sep, call, kw, iters)
    except Exception as e:  # noqa: BLE001
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
        traceback.print_exc()
    return row


def print_row(row: dict) -> None:
    def ms(key):
        return f"{row[key] * 1e3:.3f}" if key in row else "-"
    print(f"{row['case']:<44} {'yes' if row['ok'] else 'NO':>3} {row.get('max_err', float('nan')):>9.2e} "
          f"{row.get('live_bytes', 0) / 1e6:>8.1f} {ms('ragged_s'):>10} {ms('separate_s'):>12} "
          f"{row.get('gbps', float('nan')):>8.1f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    platform = jax.devices()[0].platform
    if not args.dry_run and platform != args.backend:
        print(f"--backend {args.backend} needs a {args.backend.upper()} (this machine has {platform}); "
              "use --dry-run on a CPU", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    iters = 2 if args.dry_run else args.iters
    measure, method = timer(use_cupti=args.backend == "gpu" and not args.dry_run)
    page_sizes = args.page_sizes or ((16,) if args.dry_run else (16, 64))
    names = args.shapes or (["smollm2"] if args.dry_run else list(SHAPES))
    results = []
    header = (f"{'case':<44} {'ok':>3} {'max err':>9} {'live MB':>8} {'ragged ms':>10} "
              f"{'separate ms':>12} {'GB/s':>8}")
    print(f"backend {args.backend}{' (dry run: interpreters on ' + platform + ')' if args.dry_run else ''}; "
          f"timing: {method}\n{header}", flush=True)
    for shape_name, page_size, kv_dtype, (batch_name, rows) in itertools.product(
            dict.fromkeys(names), page_sizes, (jnp.bfloat16, jnp.int8), batches(args.dry_run).items()):
        window = 700 if batch_name == "mixed" and not args.dry_run else (24 if batch_name == "mixed" else None)
        cap = 30.0 if shape_name == "smollm2" else None
        name = (f"{shape_name}/p{page_size}/{jnp.dtype(kv_dtype).name}/{batch_name}"
                f"{'/window' if window else ''}{'/cap' if cap else ''}")
        row = dict(case=name, shape=shape_name, page_size=page_size,
                   kv_dtype=jnp.dtype(kv_dtype).name, batch=batch_name, rows=len(rows),
                   tokens=sum(q for q, _ in rows), sliding_window=window, soft_cap=cap)
        results.append(run_case(args, row, rows, SHAPES[shape_name], page_size, kv_dtype, rng, len(results),
                                measure, iters))
        print_row(row)
    failures = sum(not row["ok"] for row in results)
    report = dict(backend=args.backend, dry_run=args.dry_run, platform=platform,
                  device=str(jax.devices()[0].device_kind), timing=method, cases=results,
                  failures=failures, jax=jax.__version__)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{len(results) - failures}/{len(results)} cases ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
