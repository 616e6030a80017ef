"""Mixture-of-experts decode step time: does it grow with the active experts or with the total?

Three tiny-width random models of the same shape apart from the MLP (hidden 512, 4 layers, 8/4
heads of 64, vocab 1024, float32), each token running the same MLP width:

  - "moe 64x256 top-2": 64 experts of 256, top-2 (its experts are 64 / 2 = 32x the active ones)
  - "moe 8x256 top-2":  8 experts of 256, top-2
  - "dense 512":        one dense SwiGLU of 512 (= 2 x 256: the MoE's active MLP parameters)

Each runs the engine's decode step (`Runner.step_fn(batch, 1)`, rows with `context` cached
tokens) on a backend (default: this machine's, the native CPU one, whose MoE layers run the
"gather" grouped matmul: only the selected experts' weights are read). `--ragged-dot` adds the
64-expert model with `jax.lax.ragged_dot` instead, which XLA:CPU lowers to a dense dot over
every expert (what the gather path avoids). Variants take turns call by call; the median of
`--iters` calls is reported, with the weight bytes a token's step reads at least.

    python scripts/bench_moe.py [--batch 1 4 16] [--context 64] [--iters 30] [--backend cpu] [--out moe.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jserve.engine import EngineConfig, build_engine  # noqa: E402
from jserve.model.config import ModelConfig  # noqa: E402
from jserve.model.dummy import dummy_params  # noqa: E402
from jserve.runtime import backends, device_steps  # noqa: E402
from jserve.runtime.steps import StepRow  # noqa: E402

BASE = dict(architecture="qwen3_moe", vocab_size=1024, hidden_size=512, num_layers=4, num_heads=8,
            num_kv_heads=4, head_dim=64, max_position_embeddings=4096, qk_norm=True)
MODELS = {
    "moe 64x256 top-2": dict(intermediate_size=512, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=256,
                             norm_topk_prob=True),
    "moe 8x256 top-2": dict(intermediate_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                            norm_topk_prob=True),
    "dense 512": dict(architecture="qwen3", intermediate_size=512),
}


class _NoTokenizer:
    def detokenizer(self, *args, **kwargs):
        raise AssertionError("the benchmark never detokenizes")


def build(name: str, spec: dict, backend: str, batch: int, context: int):
    config = ModelConfig(**{**BASE, **spec})
    params = dummy_params(config, "float32")
    engine = build_engine(config, params, _NoTokenizer(), [],
                          EngineConfig(max_model_len=context + 64, max_num_seqs=max(batch, 1), page_size=16,
                                       max_num_batched_tokens=64, kv_cache_bytes=64 << 20, warmup=False,
                                       backend=backends.create(backend)))
    return config, engine.runner


def step_call(runner, batch: int, context: int, state: dict, ops=None):
    """A compiled decode step over `batch` rows of `context` cached tokens (consecutive pages);
    `state["kv"]` the runner's pages (donated and replaced by each call)."""
    pages = (context + 1 + runner.page_size - 1) // runner.page_size
    rows = [StepRow(context, [1], list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(batch)]
    arrays = runner._place(runner._pack(rows, batch, 1))
    if ops is None:
        fn = runner.step_fn(batch, 1)
    else:
        fn = jax.jit(functools.partial(device_steps.forward, runner.graphdef, ops), donate_argnames=("kv",))

    def call():
        logits, state["kv"] = fn(runner.params, state["kv"], *arrays)
        logits.block_until_ready()

    call()  # compile
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--backend", default=None, help="a backend name (default: the platform's)")
    ap.add_argument("--ragged-dot", action="store_true", help="add the 64-expert model on jax.lax.ragged_dot")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    backend = args.backend or backends.default_name()

    results = []
    for batch in args.batch:
        calls, info = {}, {}
        for name, spec in MODELS.items():
            config, runner = build(name, spec, backend, batch, args.context)
            state = {"kv": runner.kv}
            calls[name] = step_call(runner, batch, args.context, state)
            active = config.active_params() if config.moe else config.num_params()
            info[name] = dict(params=config.num_params(), active_params=active)
            if args.ragged_dot and name.startswith("moe 64"):
                ops = dataclasses.replace(runner.ops, grouped_matmul="ragged_dot")
                calls[name + " (ragged_dot)"] = step_call(runner, batch, args.context, state, ops)
                info[name + " (ragged_dot)"] = info[name]
        times = {name: [] for name in calls}
        for _ in range(args.iters):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            results.append(dict(model=name, batch=batch, context=args.context, backend=backend,
                                median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts), **info[name]))

    print(f"decode step, {args.context} cached tokens per row, backend {backend}, median of {args.iters}")
    print(f"{'model':<30} {'batch':>5} {'params':>10} {'active':>10} {'median ms':>10} {'min ms':>8} {'/ dense':>8}")
    for r in results:
        dense = next(d["median_ms"] for d in results if d["model"] == "dense 512" and d["batch"] == r["batch"])
        print(f"{r['model']:<30} {r['batch']:>5} {r['params'] / 1e6:>9.2f}M {r['active_params'] / 1e6:>9.2f}M "
              f"{r['median_ms']:>10.3f} {r['min_ms']:>8.3f} {r['median_ms'] / dense:>7.2f}x")
    if args.out:
        args.out.write_text(json.dumps(dict(results=results, jax=jax.__version__,
                                            device=str(jax.devices()[0])), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
