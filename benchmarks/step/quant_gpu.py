"""Quantized KV pages and weights on an NVIDIA GPU: the paged-attention kernel and the decode step.

Part "kernel": `paged_attention(backend=--kernel)` (the Mosaic GPU kernel on "gpu") over bfloat16,
int8 and fp8 (float8_e4m3fn) K/V pages at `--batch` rows x `--context` cached tokens (Llama-3-8B's
attention: 32 query heads, 8 KV heads, head_dim 128; 16-token pages scattered at random over
the pool; bfloat16 queries). Per dtype: wall-clock time per call (median of `--runs` timings of
`--iters` calls each, after a compile and a warm-up call), the bytes the call must read (the
live K/V codes, scales and queries) over that time, and the largest absolute difference from
`backend="reference"` (float32 arithmetic over the same pages and scales: the kernel's own error)
and from the reference over the bfloat16 pages the codes were quantized from (what quantizing
the cache costs on top).

Part "step": one decode step of the runner (`Runner.execute`, sampling included) with random
weights of Llama-3-8B's shapes (`--layers` of them) at `--step-batch` rows x `--step-context`
cached tokens, for: bfloat16 weights and KV ("bf16"), fp8 weights
(`jserve.model.quant.quantize_params`, fp8 per output channel, the LM head too) with a bfloat16
KV cache ("fp8-weights"), and bfloat16 weights with an fp8 KV cache ("fp8-kv"). Median of
`--runs` steps after a compile and a warm-up step.

Each part runs in try/except: a failure is recorded as the part's (or the row's) "error" in the
JSON and the rest still runs. Prints a table and writes JSON (`--out`).

    python -m benchmarks.step.quant_gpu --out quant.json                          # on a GPU
    python -m benchmarks.step.quant_gpu --parts kernel --out kernel.json
    python -m benchmarks.step.quant_gpu --quick --kernel reference --out /tmp/q.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig
from jserve.runtime.kv_cache import quantize_kv
from pallas_kernels.paged_attention import gpu, paged_attention

KV_DTYPES = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=8192, tie_word_embeddings=False)
# --quick: shapes small enough for a CPU (head_dim 64: the Mosaic kernel's smallest).
QUICK = dict(architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)


def error_row(row: dict, e: BaseException) -> dict:
    row["error"] = f"{type(e).__name__}: {e}"
    row["traceback"] = traceback.format_exc(limit=-8)
    print(f"  {row.get('name', row.get('part'))}: FAILED {row['error'][:300]}", flush=True)
    return row


def time_calls(fn, args, *, iters: int, runs: int) -> tuple[float, float]:
    """(median, min) seconds per call over `runs` timings of `iters` back-to-back calls."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times), min(times)


def attention_inputs(rng, *, batch, context, num_heads, num_kv_heads, head_dim, page_size):
    """bfloat16 q [batch, heads, head_dim], K/V pools, a random page table (every row `context`
    tokens; page 0 is the null page) and the lengths."""
    pages_per_row = -(-context // page_size)
    num_pages = 1 + batch * pages_per_row
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_row).astype(np.int32)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.bfloat16)
    return q, k, v, jnp.asarray(table), jnp.full((batch,), context, jnp.int32)


def bench_kernel(args) -> list[dict]:
    shape = QUICK if args.quick else LLAMA3_8B
    H, K, D = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    batch, context, page_size = args.batch, args.context, args.page_size
    rng = np.random.default_rng(0)
    q, k, v, table, lengths = attention_inputs(rng, batch=batch, context=context, num_heads=H, num_kv_heads=K,
                                               head_dim=D, page_size=page_size)
    kw = dict(sm_scale=D ** -0.5)
    call = jax.jit(lambda *a, **s: paged_attention(*a, backend=args.kernel, **kw, **s))
    # The float reference over the bfloat16 pages: what the quantized caches approximate.
    want_bf16 = np.asarray(paged_attention(q, k, v, lengths, table, backend="reference", **kw).astype(jnp.float32))
    rows = []
    for name in args.kv_dtypes:
        row = dict(part="kernel", name=name, kernel=args.kernel, batch=batch, context=context, page_size=page_size,
                   num_heads=H, num_kv_heads=K, head_dim=D)
        try:
            dtype = jnp.dtype(KV_DTYPES[name])
            if dtype == jnp.bfloat16:
                pages, scales = (k, v), {}
            else:
                (kc, ks), (vc, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
                pages, scales = (kc, vc), dict(k_scales=ks, v_scales=vs)
            args_ = (q, *pages, lengths, table)
            row["mosaic_kernel"] = bool(args.kernel == "gpu" and gpu.supports(dtype, D, page_size))
            lowered = jax.jit(lambda *a: paged_attention(*a, backend=args.kernel, **kw, **scales)).lower(*args_)
            row["mosaic_in_lowering"] = "mosaic_gpu" in lowered.as_text()
            out = np.asarray(call(*args_, **scales).astype(jnp.float32))
            ref = np.asarray(paged_attention(*args_, backend="reference", **kw, **scales).astype(jnp.float32))
            row["max_err_vs_reference"] = float(np.abs(out - ref).max())
            row["max_err_vs_bf16_reference"] = float(np.abs(out - want_bf16).max())
            med, best = time_calls(lambda *a: call(*a, **scales), args_, iters=args.iters, runs=args.runs)
            live = batch * K * context
            kv_bytes = 2 * live * (D * dtype.itemsize + (4 if scales else 0))
            row.update(ms=med * 1e3, min_ms=best * 1e3, bytes=kv_bytes + q.size * 2,
                       gb_s=(kv_bytes + q.size * 2) / med / 1e9)
        except Exception as e:  # noqa: BLE001 (recorded, the other dtypes still run)
            error_row(row, e)
        rows.append(row)
    return rows


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Checkpoint-layout (stacked per layer) bfloat16 weights, normal with std 0.02, norms 1."""
    c, L = config, config.num_layers
    shapes = {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.hidden_size, c.vocab_size),
              "wq": (L, c.hidden_size, c.num_heads * c.head_dim), "wk": (L, c.hidden_size, c.num_kv_heads * c.head_dim),
              "wv": (L, c.hidden_size, c.num_kv_heads * c.head_dim), "wo": (L, c.num_heads * c.head_dim, c.hidden_size),
              "w_gate": (L, c.hidden_size, c.intermediate_size), "w_up": (L, c.hidden_size, c.intermediate_size),
              "w_down": (L, c.intermediate_size, c.hidden_size)}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    params = {name: 0.02 * jax.random.normal(key, shape, jnp.bfloat16)
              for key, (name, shape) in zip(keys, shapes.items())}
    params.update(final_norm=jnp.ones((c.hidden_size,), jnp.bfloat16),
                  attn_norm=jnp.ones((L, c.hidden_size), jnp.bfloat16),
                  mlp_norm=jnp.ones((L, c.hidden_size), jnp.bfloat16))
    return params


def bench_step(args) -> list[dict]:
    from jserve.model import quant
    from jserve.runtime.runner import Runner
    from jserve.runtime.steps import StepRow

    shape = dict(QUICK if args.quick else LLAMA3_8B)
    if args.layers:
        shape["num_layers"] = args.layers
    config = ModelConfig(**shape)
    B, ctx, page = args.step_batch, args.step_context, args.page_size
    pages_per_row = -(-(ctx + 1) // page)
    num_pages = 1 + B * pages_per_row
    rows_in = [StepRow(ctx, [1], list(range(1 + j * pages_per_row, 1 + (j + 1) * pages_per_row))) for j in range(B)]
    t = time.perf_counter()
    floats = random_params(config)
    jax.block_until_ready(floats)
    print(f"  random weights ({config.num_layers} layers): {time.perf_counter() - t:.1f} s", flush=True)
    variants = [("bf16", "bfloat16", None), ("fp8-weights", "bfloat16", "fp8"), ("fp8-kv", "float8_e4m3fn", None)]
    rows = []
    for name, kv_dtype, weights in variants:
        if args.step_variants and name not in args.step_variants:
            continue
        row = dict(part="step", name=name, kernel=args.kernel, weights=weights or "bfloat16", kv_dtype=kv_dtype,
                   batch=B, context=ctx, page_size=page, layers=config.num_layers,
                   shape="quick" if args.quick else "llama3-8b")
        runner = None
        try:
            t = time.perf_counter()
            params = floats
            if weights:
                params = quant.quantize_params(config, floats, quant.QuantSpec(weights, embed_scheme=weights))
            row["quantize_s"] = time.perf_counter() - t
            runner = Runner(config, params, num_pages=num_pages, page_size=page, max_model_len=ctx + 8,
                            kv_dtype=jnp.dtype(kv_dtype), backend=args.kernel, batch_buckets=(B,),
                            token_buckets=(8,), max_num_batched_tokens=max(8, B))
            del params
            row["param_bytes"] = runner.param_bytes
            t = time.perf_counter()
            runner.execute(rows_in)  # compile + first step
            row["compile_s"] = time.perf_counter() - t
            runner.execute(rows_in)
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                runner.execute(rows_in)
                times.append(time.perf_counter() - t)
            row.update(ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3,
                       tok_s=B / statistics.median(times))
        except Exception as e:  # noqa: BLE001 (recorded, the other variants still run)
            error_row(row, e)
        del runner
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['part']:>6} {r['name']:>12}: ERROR {r['error'][:200]}")
        elif r["part"] == "kernel":
            print(f"kernel {r['name']:>12}: {r['ms']:8.3f} ms/call  {r['gb_s']:7.1f} GB/s  "
                  f"mosaic {str(r['mosaic_in_lowering']):5}  err vs reference {r['max_err_vs_reference']:.2e}  "
                  f"vs bf16 pages {r['max_err_vs_bf16_reference']:.2e}")
        else:
            print(f"  step {r['name']:>12}: {r['ms']:8.2f} ms/step (min {r['min_ms']:.2f})  {r['tok_s']:8.1f} tok/s  "
                  f"weights {r['param_bytes'] / 1e6:9.1f} MB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["kernel", "step"], choices=["kernel", "step"])
    p.add_argument("--kernel", default=None, help="attention backend (default: gpu on a GPU, else reference)")
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke test)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=list(KV_DTYPES))
    p.add_argument("--batch", type=int, default=None, help="kernel part's rows (default 64; --quick 4)")
    p.add_argument("--context", type=int, default=None, help="kernel part's cached tokens (default 2048; --quick 128)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=None, help="calls per kernel timing (default 20; --quick 2)")
    p.add_argument("--runs", type=int, default=None, help="timings per row (default 10; --quick 3)")
    p.add_argument("--layers", type=int, default=None, help="step part: layers of the 8B shape (default 32)")
    p.add_argument("--step-batch", type=int, default=None, help="step part's rows (default 64; --quick 4)")
    p.add_argument("--step-context", type=int, default=None,
                   help="step part's cached tokens (default 2048; --quick 64)")
    p.add_argument("--step-variants", nargs="+", default=None, choices=["bf16", "fp8-weights", "fp8-kv"])
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(batch=(64, 4), context=(2048, 128), iters=(20, 2), runs=(10, 3), step_batch=(64, 4),
                    step_context=(2048, 64))
    for k, (full, small) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, small if quick else full)
    platform_name = jax.devices()[0].platform
    if args.kernel is None:
        args.kernel = "gpu" if platform_name == "gpu" else "reference"
    report = dict(meta=dict(devices=[str(d) for d in jax.devices()], platform=platform_name, jax=jax.__version__,
                            host=platform.node(), args={k: (str(v) if isinstance(v, Path) else v)
                                                         for k, v in vars(args).items()}),
                  rows=[], errors=[])
    for part, fn in (("kernel", bench_kernel), ("step", bench_step)):
        if part not in args.parts:
            continue
        print(f"== {part}", flush=True)
        t = time.perf_counter()
        try:
            report["rows"] += fn(args)
        except Exception as e:  # noqa: BLE001
            report["errors"].append(error_row(dict(part=part), e))
        report["meta"][f"{part}_s"] = time.perf_counter() - t
        if args.out:  # after each part: a later part that hangs leaves this one's results
            args.out.write_text(json.dumps(report, indent=1))
    print_rows(report["rows"])
    failed = bool(report["errors"]) or any("error" in r for r in report["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
