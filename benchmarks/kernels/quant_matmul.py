"""The native CPU matmul per weight format, at decode shapes: float32, bfloat16, int8 and int4 panels.

Part 1, matmuls: x [M, K] @ w [K, N] on `pallas_kernels.native.matmul` for SmolLM2-135M's shapes
(q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576, the tied head 576x49152) at M rows
(1: single-stream decode; 16: a decode batch), each weight as float32 and bfloat16 panels, int8
per channel (`pack_quantized`, float16 scales) and int4 in groups of 32 symmetric and asymmetric
(llama.cpp's Q4_0 and Q4_1 forms). Each timed call reads a different copy of the weight, from a
working set larger than the last-level cache (`--working-set` MB per format), as a decode step
reads its weights from memory; the calls run `--calls` to one jitted program, each depending on
the one before (no overlap), and the time per call is the median over `--runs` programs, the
formats taking turns (a busy machine slows them alike). Effective GB/s: the packed weight's bytes
(codes and scales) over the time. Each call also wakes XLA's pool threads (ParallelFor): at the
small shapes that is much of the time, which the fused decode layers (one wake-up a step) do not pay.

Part 2 (`--decode`): one SmolLM2-135M decode step (batch rows at `--context` cached tokens, the
fused native decoder layers and the native head, no sampling) per format: the layer matmuls as
above (the tied embedding int8 per channel for the quantized ones), on random weights of the
real shapes, or the checkpoint's (`--model`) when it is at hand.

    python -m benchmarks.kernels.quant_matmul [--rows 1 16] [--out quant_matmul.json]
    python -m benchmarks.kernels.quant_matmul --decode --batch 1 [--context 256]
    python -m benchmarks.kernels.quant_matmul --rows 512 --shapes gate/up down --working-set 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model import quant
from pallas_kernels.native import matmul as native

SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576),
          "head": (576, 49152)}
# name: (scheme or a float dtype, group size, symmetric)
FORMATS = {"float32": ("float32", 0, True), "bfloat16": ("bfloat16", 0, True), "int8": ("int8", 0, True),
           "int8-g32": ("int8", 32, True), "int4-g32-sym": ("int4", 32, True), "int4-g32-asym": ("int4", 32, False)}
# The quantized formats with int8 activations (quant_dot.h: integer dot products at every row count
# here; the engine's default takes them from `native.default_int8_rows(scheme)` rows on); on AVX2
# builds int4's "-a8" codes are stored as quads (`PackedQuantized.quads`), "-a8-pairs" as nibble
# pairs rearranged by each call (the layout before quads).
FORMATS.update({f"{name}-a8": spec for name, spec in list(FORMATS.items()) if spec[0] in ("int8", "int4")})
FORMATS.update({f"{name}-a8-pairs": spec for name, spec in list(FORMATS.items()) if spec[0] == "int4"
                and not name.endswith("-a8")})


def packed_weight(w: np.ndarray, fmt: str):
    scheme, group, symmetric = FORMATS[fmt]
    if scheme in ("float32", "bfloat16"):
        return native.pack(jnp.asarray(w, scheme))
    packed = native.pack_quantized(quant.quantize(w, scheme, group, symmetric))
    if fmt.endswith("-a8-pairs"):
        return dataclasses.replace(packed, int8_rows=1)
    return packed.with_int8_rows(1 if fmt.endswith("-a8") else 0)


def nbytes(p) -> int:
    return p.nbytes if isinstance(p, native.PackedQuantized) else p.size * p.dtype.itemsize


def chained(n: int, calls: int):
    """One program of `calls` matmuls, each on its own copy of the weight and each waiting for the
    one before (its x depends on the previous product)."""
    def run(x, ws):
        acc = jnp.zeros((x.shape[0], 1), jnp.float32)
        for w in ws:
            y = native.matmul_packed(x + acc * 1e-30, w, n)
            acc = acc + y[:, :1]
        return acc
    return jax.jit(run)


def bench_matmuls(args) -> list[dict]:
    rng = np.random.default_rng(0)
    results = []
    for name, (k, n) in SHAPES.items():
        if name not in args.shapes:
            continue
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        sets = {}
        for fmt in args.formats:
            one = packed_weight(w, fmt)
            copies = max(1, min(args.calls, int(args.working_set * 2**20 // nbytes(one))))
            # Copies of the same packed arrays (new buffers: x + 0 is not folded for integers).
            copy = jax.jit(lambda t: jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), t))
            sets[fmt] = (one, [one] + [copy(one) for _ in range(copies - 1)])
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            runs = {}
            for fmt, (one, ws) in sets.items():
                calls = max(len(ws), min(args.calls, 8))
                program = chained(n, calls)
                tree = tuple(ws[i % len(ws)] for i in range(calls))
                jax.block_until_ready(program(x, tree))
                runs[fmt] = (program, tree, calls, [])
            for _ in range(args.runs):
                for fmt, (program, tree, calls, times) in runs.items():
                    t = time.perf_counter()
                    jax.block_until_ready(program(x, tree))
                    times.append((time.perf_counter() - t) / calls)
            for fmt, (program, tree, calls, times) in runs.items():
                sec = statistics.median(times)
                b = nbytes(sets[fmt][0])
                results.append(dict(shape=name, k=k, n=n, rows=m, format=fmt, us=sec * 1e6, bytes=b,
                                    gb_s=b / sec / 1e9, copies=len(sets[fmt][1]), calls=calls))
    return results


def print_matmuls(results, formats):
    print(f"{'shape':>8} {'K x N':>11} {'M':>3} | " + " | ".join(f"{f:>20}" for f in formats))
    keys = sorted({(r["shape"], r["k"], r["n"], r["rows"]) for r in results},
                  key=lambda t: (list(SHAPES).index(t[0]), t[3]))
    for shape, k, n, m in keys:
        cells = []
        for f in formats:
            r = next(r for r in results if (r["shape"], r["rows"], r["format"]) == (shape, m, f))
            cells.append(f"{r['us']:8.1f} us {r['gb_s']:5.1f} GB/s")
        print(f"{shape:>8} {f'{k}x{n}':>11} {m:>3} | " + " | ".join(f"{c:>20}" for c in cells))


def decode_weights(args):
    """(config, float weights, where they came from): the checkpoint, or random weights of
    SmolLM2-135M's shapes when none is at hand."""
    from flax import nnx

    from jserve.model.config import ModelConfig
    from jserve.model.llama import LlamaModel

    try:
        from jserve.model.checkpoint import load_checkpoint, resolve_model

        config, loaded, _ = load_checkpoint(resolve_model(args.model))
        return config, loaded, str(args.model or "smollm2-135m-instruct")
    except Exception as e:  # no checkpoint at hand: random weights of SmolLM2-135M's shapes
        print(f"(no checkpoint: {type(e).__name__}: {e}; random weights)")
        config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                             max_position_embeddings=8192, tie_word_embeddings=True)
        model = LlamaModel(config, rngs=nnx.Rngs(0))
        return config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), "random"


def format_params(floats: dict, fmt: str) -> dict:
    """The float32 weights in `fmt`: cast, or the layer matmuls quantized and the tied embedding
    int8 per channel."""
    from jserve.model.llama import LAYER_MATMULS

    scheme, group, symmetric = FORMATS[fmt]
    if scheme in ("float32", "bfloat16"):
        return jax.tree.map(lambda a: a.astype(scheme), floats)
    layers = {i: {name: quant.quantize(np.asarray(w), scheme, group, symmetric) if name in LAYER_MATMULS
                  else w for name, w in layer.items()} for i, layer in floats["layers"].items()}
    return {**floats, "layers": layers, "embed": quant.quantize(np.asarray(floats["embed"]).T, "int8")}


def decode_step(config, params: dict, fmt: str, B: int, ctx: int, page: int) -> list:
    """One format's compiled decode step, run once: [fn, its params, the cache, times, weight bytes]."""
    from flax import nnx

    from jserve.model import model_graphdef
    from jserve.runtime.backends import NativeCpuBackend
    from jserve.runtime.paged_attention import PagedMeta

    pages_per_row = -(-(ctx + 1) // page)
    num_pages = 1 + B * pages_per_row
    table = np.arange(1, num_pages, dtype=np.int32).reshape(B, pages_per_row)
    slots = table[:, ctx // page] * page + ctx % page
    meta = PagedMeta(jnp.asarray(slots, jnp.int32), jnp.full((B,), ctx, jnp.int32), jnp.ones((B,), jnp.int32),
                     jnp.asarray(table))
    tokens = jnp.ones((B, 1), jnp.int32)
    positions = jnp.full((B, 1), ctx, jnp.int32)
    backend = NativeCpuBackend(int8_activations=fmt.endswith("-a8"))
    params = backend.prepare_params(config, params)
    ops = backend.ops(config)
    assert ops.fused, f"{fmt}: the decode step would not run fused"
    dtype = jnp.float32 if FORMATS[fmt][0] != "bfloat16" else jnp.bfloat16
    cache = tuple((jnp.zeros((3, num_pages, page, 64), dtype), jnp.zeros((3, num_pages, page, 64), dtype))
                  for _ in range(config.num_layers))
    graphdef = model_graphdef(config)

    def step(p, c):
        m = nnx.merge(graphdef, p)
        return m(tokens, positions, c, meta, ops, logits_index=jnp.zeros((B, 1), jnp.int32))

    fn = jax.jit(step, donate_argnums=(1,))
    logits, cache = fn(params, cache)
    jax.block_until_ready(logits)
    weight_bytes = sum(nbytes(w) if isinstance(w, native.PackedQuantized) else w.size * w.dtype.itemsize
                       for w in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, native.PackedQuantized)))
    return [fn, params, cache, [], weight_bytes]


def bench_decode(args) -> list[dict]:
    """SmolLM2-135M decode steps per format, taking turns."""
    from jserve.runtime.backends import NativeCpuBackend

    if any(f.endswith("-a8-pairs") for f in args.formats):
        raise SystemExit("--decode: the engine stores int4 codes as its build reads them; no -a8-pairs formats")
    config, loaded, source = decode_weights(args)
    floats = NativeCpuBackend(native_matmuls=False).prepare_params(config, loaded)
    floats = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), floats)
    del loaded
    B, ctx = args.batch, args.context
    steps = {fmt: decode_step(config, format_params(floats, fmt), fmt, B, ctx, page=64) for fmt in args.formats}
    del floats
    for _ in range(args.runs):
        for fmt, s in steps.items():
            t = time.perf_counter()
            logits, s[2] = s[0](s[1], s[2])
            jax.block_until_ready(logits)
            s[3].append(time.perf_counter() - t)
    results = []
    for fmt, (_, _, _, times, b) in steps.items():
        sec = statistics.median(times)
        results.append(dict(format=fmt, model=source, batch=B, context=ctx, ms=sec * 1e3, tok_s=B / sec, weight_bytes=b,
                            gb_s=b / sec / 1e9))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=[f for f in FORMATS if "-a8" not in f],
                        choices=list(FORMATS))
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--calls", type=int, default=64, help="matmuls per timed program (at most)")
    parser.add_argument("--working-set", type=float, default=96.0,
                        help="MB of weight copies per format and shape the calls rotate through")
    parser.add_argument("--decode", action="store_true", help="also time SmolLM2-135M decode steps")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--model", default=None, help="--decode's checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not native.available():
        raise SystemExit(f"native matmul unavailable: {native.unavailable_reason()}")
    meta = dict(machine=platform.processor() or platform.machine(), panel=native.panel(),
                devices=str(jax.devices()), args={k: str(v) for k, v in vars(args).items()})
    results = bench_matmuls(args)
    print_matmuls(results, args.formats)
    decode = []
    if args.decode:
        decode = bench_decode(args)
        print(f"\n{decode[0]['model']} decode step, batch {args.batch}, context {args.context}")
        for r in decode:
            print(f"{r['format']:>14}: {r['ms']:7.2f} ms  {r['tok_s']:6.1f} tok/s  "
                  f"weights {r['weight_bytes'] / 1e6:6.1f} MB  {r['gb_s']:5.1f} GB/s")
    if args.out:
        args.out.write_text(json.dumps(dict(meta=meta, matmuls=results, decode=decode), indent=1))


if __name__ == "__main__":
    main()
