"""One decode step of the default model's shapes (random weights, native backend) with LoRA slots
against the same step without: where multi-LoRA decode spends its time, without prefill or the
engine around it. Variants, alternated for --rounds rounds of --steps steps each: the base model
fused; LoRA slots (4 of rank 16 on all seven linears, random) with every row on slot 0, with the
rows spread over the 4 slots (fused: the deltas inside the native layers, only the used slots
read), and the same mixed rows unfused (the model's layers with `lora.apply`'s XLA delta over all
resident slots: what decode ran before the fused call took the deltas). Median ms per step and
each one's ratio to the base step, at --batch rows and at 1 row (with one adapter); the bytes of
weights each variant reads per step, and the base bytes over them (the floor of a step bound by
memory bandwidth).

    python -m benchmarks.engine.lora_decode_step [--rounds 5] [--steps 20] [--batch 16] [--context 96]
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import parser, report
from jserve.model import lora, model_graphdef
from jserve.model.checkpoint import read_model_config
from jserve.model.llama import LlamaModel
from jserve.runtime.backends import NativeCpuBackend
from jserve.runtime.kv_cache import init_kv_pages
from jserve.runtime.paged_attention import PagedMeta

SPEC = lora.LoraSpec(max_loras=4, max_rank=16)
PAGE = 64


def _step(graphdef, ops, ids):
    def step(params, cache, tokens, positions, meta):
        o = ops if ids is None else dataclasses.replace(ops, lora_ids=ids[:, None])
        model = nnx.merge(graphdef, params)
        return model(tokens, positions, cache, meta, o, logits_index=jnp.zeros((tokens.shape[0], 1), jnp.int32))
    return jax.jit(step, donate_argnums=(1,))


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=96, help="tokens cached per row")
    args = p.parse_args(argv)
    config, _ = read_model_config(None)
    backend = NativeCpuBackend()
    base = nnx.to_pure_dict(nnx.state(LlamaModel(config, rngs=nnx.Rngs(0)), nnx.Param))
    slots = lora.add_slots(base, config, SPEC, jnp.float32)
    rng = np.random.default_rng(0)
    slots = {**slots, "layers": {i: {k: (jnp.asarray(rng.normal(0, 0.02, v.shape), jnp.float32)
                                        if k.startswith("lora_") else v) for k, v in layer.items()}
                                 for i, layer in slots["layers"].items()}}
    base, slots = backend.prepare_params(config, base), backend.prepare_params(config, slots)
    ops = backend.ops(config)
    # Weights read per step: every layer's and the head's (the tied embedding), and per slot used
    # its A and B of every layer (the unfused delta reads all the slots).
    base_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(base))
    slot_bytes = config.num_layers * sum(int(np.prod(shape)) // SPEC.max_loras * 4
                                         for shape in lora.slot_shapes(config, SPEC).values())
    assert ops.fused, "the default model's decode should run the fused native layers"
    per_page = -(-(args.context + 1) // PAGE)
    rows = []
    for batch in (args.batch, 1):
        mixed = jnp.asarray(np.arange(batch) % 4 + 1, jnp.int32)
        variants = {
            "base model (fused)": (model_graphdef(config), base, ops, None),
            "LoRA, slot 0 (fused)": (model_graphdef(config, lora=SPEC), slots, ops, mixed * 0),
            "LoRA, mixed slots (fused)": (model_graphdef(config, lora=SPEC), slots, ops, mixed),
            "LoRA, mixed slots (unfused, XLA delta)": (model_graphdef(config, lora=SPEC), slots,
                                                       dataclasses.replace(ops, fused=False), mixed),
        }
        num_pages = 1 + batch * per_page
        table_ = np.arange(1, num_pages, dtype=np.int32).reshape(batch, per_page)
        starts = np.full(batch, args.context, np.int32)
        meta = PagedMeta(jnp.asarray(table_[:, args.context // PAGE] * PAGE + args.context % PAGE),
                         jnp.asarray(starts), jnp.ones(batch, jnp.int32), jnp.asarray(table_))
        tokens, positions = jnp.ones((batch, 1), jnp.int32), jnp.asarray(starts[:, None])
        runs = {}
        for name, (graphdef, params, o, ids) in variants.items():
            cache = init_kv_pages(config, num_pages, PAGE, jnp.float32)
            fn = _step(graphdef, o, ids)
            _, cache = jax.block_until_ready(fn(params, cache, tokens, positions, meta))
            runs[name] = [fn, params, cache]
        times = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                fn, params, cache = runs[name]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    _, cache = fn(params, cache, tokens, positions, meta)
                jax.block_until_ready(cache)
                runs[name][2] = cache
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        base_ms = statistics.median(times["base model (fused)"])
        slots_read = {"base model (fused)": 0, "LoRA, slot 0 (fused)": 0,
                      "LoRA, mixed slots (fused)": min(batch, SPEC.max_loras),
                      "LoRA, mixed slots (unfused, XLA delta)": SPEC.max_loras}
        for name, ts in times.items():
            read = base_bytes + slots_read[name] * slot_bytes
            rows.append({"rows": batch, "variant": name, "ms_per_step": round(statistics.median(ts), 2),
                         "vs_base_time": round(base_ms / statistics.median(ts), 3),
                         "weights_MB_read": round(read / 1e6, 1), "bytes_floor": round(base_bytes / read, 3)})
    report(rows, args.out, title=f"one decode step, LoRA vs base ({args.rounds} rounds of {args.steps} steps "
                                 f"alternated; context {args.context})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
