"""Decode (and prefill) step time against its floor, per shape, for each kernel/dot-library choice.

One runner over the real model (default SmolLM2-135M, the CPU engine's 64-token pages); every
row of a step has `context` cached tokens on consecutive pages (a best case: a busy engine's
pages are scattered, see bench_page_layout.py) and feeds `tokens` new ones (1: decode; more: a
prefill chunk). Each variant is the same
step compiled with:
  - attention: "cpu" (the native kernel) or "cpu_pallas" (Pallas interpret mode);
  - dots: "ynn" (XLA:CPU's default, YNNPACK) or "eigen" (YNNPACK off, `backends.native_cpu.EIGEN_DOTS`);
  - the layer matmuls and the tied LM head: the native kernel over packed weights on "native"
    (the runner's default on CPU, where no dot library is then left to choose), XLA's dots over
    unpacked weights otherwise ("cpu/..." keep the native attention kernel);
  - decode layers: on "native" all in one native call (`pallas_kernels.native.decoder_layer`, the
    runner's default), on "native/unfused" XLA ops around native matmul and attention calls.
Variants take turns call by call (a busy machine slows them alike). `--breakdown` adds, for the
"native/unfused" variant, the same step with one part replaced by a stand-in that costs next to nothing
but keeps the data flow (attention: K/V still written, the query passed through; layer matmuls:
one input column broadcast to the output width; LM head: the same), so the step's time splits
into attention, layer matmuls, head and the rest (all three replaced). The floor is the runner's
own: max(bytes read / bandwidth, FLOPs / peak), weights once plus the live K/V (DESIGN §6:
27 GB/s, 190 GFLOP/s on the 2-core development machine). The runner picks Eigen dots for the
batches in `backends.native_cpu.EIGEN_DECODE_BATCHES` and `EIGEN_PREFILL_BATCHES`; this script measures them.

    python -m benchmarks.step.decode [--batch 1 2 4 8 16 32] [--context 256 1024] [--out step.json]
    python -m benchmarks.step.decode --batch 1 2 --context 0 --tokens 16 128 512
    python -m benchmarks.step.decode --batch 16 --context 384 --variants native --breakdown
    python -m benchmarks.step.decode --batch 1 4 16 --context 384 --variants native --dtype float32 bfloat16

`--dtype` casts the weights (the KV pages follow them, as `kv_cache_dtype="auto"` does); with
several, each dtype gets its own runner and all take turns call by call, the first dtype's
variants named as usual and the others' suffixed `@dtype`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jserve.core import buckets
from jserve.engine import EngineConfig, build_engine
from jserve.llm import enable_compilation_cache
from jserve.model.checkpoint import load_checkpoint, resolve_model
from jserve.model.llama import LAYER_MATMULS
from jserve.runtime import step_rows
from jserve.runtime.backends import NativeCpuBackend
from jserve.runtime.backends.native_cpu import EIGEN_DOTS, NativeCpuOps
from jserve.runtime.device_steps import forward as device_step
from jserve.runtime.kv_cache import write_kv
from jserve.runtime.paged_attention import PagedAttention
from jserve.runtime.steps import StepRow
from pallas_kernels.native import matmul as native_matmul

# name: (attention backend, XLA options, native matmuls over packed weights, fused decode layers).
VARIANTS = {"native": ("cpu", None, True, True), "native/unfused": ("cpu", None, True, False),
            "native/eigen": ("cpu", EIGEN_DOTS, True, True),
            "cpu/ynn": ("cpu", None, False, False), "cpu/eigen": ("cpu", EIGEN_DOTS, False, False),
            "cpu_pallas/ynn": ("cpu_pallas", None, False, False),
            "cpu_pallas/eigen": ("cpu_pallas", EIGEN_DOTS, False, False)}
BREAKDOWN_BASE = "native/unfused"  # the parts below replace pieces of its step

# --breakdown: the parts a stand-in replaces, per extra variant of BREAKDOWN_BASE.
PARTS = {"-attention": {"attention"}, "-layer matmuls": {"linear"}, "-head": {"head"},
         "-all three": {"attention", "linear", "head"}}


class _NoAttention(PagedAttention):
    """Writes the new K/V as the real backend does, then returns the queries as the output."""

    def _local(self, layer, q, k, v, k_pages, v_pages, meta):
        B, T, K, D = k.shape
        return (q, *write_kv(k_pages, v_pages, k.reshape(B * T, K, D), v.reshape(B * T, K, D), meta.slots))


class _StrippedOps(NativeCpuOps):
    """The native backend's operations with some replaced by stand-ins (--breakdown)."""

    def __init__(self, *args, stripped=frozenset(), **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "stripped", frozenset(stripped))

    def linear(self, x, w, out_features):
        return _no_linear(x, w, out_features) if "linear" in self.stripped else super().linear(x, w, out_features)

    def head(self, x, table, tied):
        if "head" in self.stripped:
            return _no_linear(x, table, self.config.vocab_size)
        return super().head(x, table, tied)


def _no_linear(x, w, out_features):
    if isinstance(w, tuple):
        return tuple(_no_linear(x, wi, n) for wi, n in zip(w, out_features))
    return jnp.broadcast_to(x[..., :1], (*x.shape[:-1], out_features))


class _NoTokenizer:
    def detokenizer(self, *args, **kwargs):
        raise AssertionError("the benchmark never detokenizes")


def natural_params(runner, config):
    """The runner's params with packed layer weights unpacked to [in, out] (for XLA's dots)."""
    if not runner.backend.native_matmuls:
        return runner.params
    c = config
    widths = {"wq": c.num_heads * c.head_dim, "wk": c.num_kv_heads * c.head_dim,
              "wv": c.num_kv_heads * c.head_dim, "wo": c.hidden_size, "w_gate": c.intermediate_size,
              "w_up": c.intermediate_size, "w_down": c.hidden_size}
    embed = runner.params["embed"]
    return {**runner.params, "layers": {
        i: {k: native_matmul.unpack(w, widths[k]) if k in LAYER_MATMULS else w for k, w in layer.items()}
        for i, layer in runner.params["layers"].items()},
        "embed": native_matmul.unpack(embed, c.vocab_size).T if embed.ndim == 3 else embed}


def compile_variant(runner, config, params, backend, options, native_matmuls, fused, rows,
                    stripped=frozenset()):
    """The step for these rows (padded to the runner's buckets), with this attention backend,
    these XLA options, the native matmuls over the runner's packed params or XLA's dots over
    unpacked ones (`params`), the runner's fused decode layers or not; the parts in `stripped`
    replaced by stand-ins (see --breakdown)."""
    attention = (_NoAttention if "attention" in stripped else PagedAttention)(backend, config.sliding_window)
    packed = native_matmuls and runner.backend.native_matmuls
    ops = _StrippedOps(attention, config=config, fused=packed and fused and runner.ops.fused,
                       stripped=frozenset(stripped))
    step = functools.partial(device_step, runner.graphdef, ops)
    new = max(len(r[1]) for r in rows)
    if new == 1:
        batch, width = buckets.pick(runner.batch_buckets, len(rows)), 1
    else:
        batch = buckets.pick((1, 2, 4, 8), len(rows))  # rows padded to `new` tokens each (a padded prefill)
        width = buckets.pick(runner.token_buckets, new)
    rows = [StepRow(*r) for r in rows] + [None] * (batch - len(rows))
    tokens, positions, meta, last = step_rows.pack(rows, batch, width, max_pages=runner.max_pages,
                                                   page_size=runner.page_size, config=runner.config)
    # The runner's call passes the rows' LoRA slots too (None without adapters).
    lowered = jax.jit(step, donate_argnums=(1,)).lower(params, runner.kv, tokens, positions, meta, last, None)
    compiled = lowered.compile(compiler_options=options)
    return lambda _runner_params, *args: compiled(params, *args)


def bench(runners, config, variants, batch, context, new, runs, bandwidth, peak, breakdown=False):
    """`runners`: {dtype: (runner, its params unpacked for XLA's dots)}; the first dtype's variants
    (and the --breakdown parts) keep their names, the others' get an `@dtype` suffix."""
    first = next(iter(runners))
    pages = math.ceil((context + new) / runners[first][0].page_size)
    rows = [(context, [1] * new, list(range(1 + j * pages, 1 + (j + 1) * pages)))
            for j in range(batch)]
    compiled, compile_s, owner = {}, {}, {}
    parts = {BREAKDOWN_BASE + suffix: frozenset(p) for suffix, p in PARTS.items()} if breakdown else {}
    if breakdown and BREAKDOWN_BASE not in variants:
        variants = [*variants, BREAKDOWN_BASE]
    for dtype, (runner, natural) in runners.items():
        for name in [*variants, *(parts if dtype == first else ())]:
            start = time.perf_counter()
            base = VARIANTS[name if name in VARIANTS else BREAKDOWN_BASE]
            packed = base[2] and runner.backend.native_matmuls
            label = name if dtype == first else f"{name}@{dtype}"
            compiled[label] = compile_variant(runner, config, runner.params if packed else natural,
                                              *base, rows, parts.get(name, frozenset()))
            compile_s[label], owner[label] = time.perf_counter() - start, runner
    times: dict[str, list[float]] = {label: [] for label in compiled}
    for i in range(runs + 1):  # the first round is a warm-up call
        for label, step in compiled.items():
            runner = owner[label]
            runner.step_fn = lambda b, t, c=step: c
            runner.execute([StepRow(*r) for r in rows])
            if i:
                times[label].append(runner.records[-1].seconds)
    out = []
    for label, t in times.items():
        record = owner[label].records[-1]
        floor = max(record.bytes_needed / bandwidth, record.flops_needed / peak)
        out.append(dict(variant=label, batch=batch, context=context, tokens=new,
                        median_ms=1e3 * statistics.median(t), min_ms=1e3 * min(t), floor_ms=1e3 * floor,
                        bytes=record.bytes_needed, flops=record.flops_needed,
                        over_floor=statistics.median(t) / floor, tokens_per_s=batch * new / statistics.median(t),
                        compile_s=compile_s[label]))
    return out


def breakdown_of(median_ms: dict[str, float]) -> dict[str, float]:
    """Each part's cost as the full step's median minus the median without it; "rest" is the
    step with all three replaced (norms, rotary, K/V writes, sampler, the host's share)."""
    full = median_ms[BREAKDOWN_BASE]
    part = {suffix: median_ms[BREAKDOWN_BASE + suffix] for suffix in PARTS}
    return {"step": full, "attention": full - part["-attention"],
            "layer matmuls": full - part["-layer matmuls"],
            "head": full - part["-head"], "rest": part["-all three"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, nargs="*", default=[256, 1024])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1],
                        help="new tokens per row: 1 is decode, more a prefill chunk")
    parser.add_argument("--variants", nargs="*", default=["native", "cpu/ynn", "cpu/eigen", "cpu_pallas/ynn"],
                        choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bandwidth", type=float, default=27.0, help="GB/s (DESIGN §6)")
    parser.add_argument("--peak", type=float, default=190.0, help="fp32 GFLOP/s (DESIGN §6)")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="weight dtype(s), the KV pages alike; several take turns")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the native/unfused step without attention / layer matmuls / head")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    enable_compilation_cache()
    config, params, _ = load_checkpoint(resolve_model(args.model))
    max_len = max(args.context) + max(args.tokens)
    page_size = NativeCpuBackend.default_page_size
    runners = {}
    for dtype in dict.fromkeys(args.dtype):
        engine = build_engine(config, {k: v.astype(dtype) for k, v in params.items()}, _NoTokenizer(), [],
                              EngineConfig(max_model_len=2048 if max_len <= 2048 else max_len,
                                           max_num_seqs=max(args.batch),
                                           max_num_batched_tokens=max(512, max(args.tokens)), page_size=page_size,
                                           num_pages=max(args.batch) * math.ceil(max_len / page_size) + 1,
                                           warmup=False))
        runner = engine.runner
        runner.huge_pages.wait()
        runner.batch_buckets = tuple(sorted(set(runner.batch_buckets) | set(args.batch)))
        runners[dtype] = (runner, natural_params(runner, config))
    print(f"jax {jax.__version__}; median (min) of {args.runs} calls, variants interleaved; "
          f"floor = max(bytes / {args.bandwidth:g} GB/s, FLOPs / {args.peak:g} GFLOP/s)")
    print(f"{'batch':>5}{'context':>8}{'tokens':>7}  {'variant':<22}{'median ms':>10}{'min ms':>8}"
          f"{'floor ms':>9}{'x floor':>8}{'tok/s':>7}")
    results = []
    for batch, context, new in itertools.product(args.batch, args.context, args.tokens):
        rows = bench(runners, config, args.variants, batch, context, new, args.runs,
                     args.bandwidth * 1e9, args.peak * 1e9, args.breakdown)
        for r in rows:
            results.append(r)
            print(f"{batch:>5}{context:>8}{new:>7}  {r['variant']:<22}{r['median_ms']:>10.1f}"
                  f"{r['min_ms']:>8.1f}{r['floor_ms']:>9.1f}{r['over_floor']:>8.2f}"
                  f"{r['tokens_per_s']:>7.0f}", flush=True)
        if args.breakdown:
            parts = breakdown_of({r["variant"]: r["median_ms"] for r in rows})
            results.append(dict(batch=batch, context=context, tokens=new, breakdown_ms=parts))
            print(f"    {BREAKDOWN_BASE} step, medians (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    if args.out:
        args.out.write_text(json.dumps(dict(jax=jax.__version__, runs=args.runs, dtypes=args.dtype,
                                            bandwidth_gbps=args.bandwidth, peak_gflops=args.peak,
                                            results=results), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
