"""LoRA deltas in the native kernels (`pallas_kernels/native/lora_delta.h`), inside the fused decode
layers and per slot over any rows (`pallas_kernels.native.lora`, prefill and mixed steps), against
the XLA delta over every slot (`jserve.model.lora.dense_delta`, the reference) on the same packed
weights, slots and pages: several mixes of slots, rows without an adapter (slot 0) and padded rows
among them; no compilation when the mix changes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jserve.model import lora, model_graphdef
from jserve.runtime.backends import NativeCpuBackend
from jserve.runtime.backends.native_cpu import fused_lora_slots
from pallas_kernels.native import decoder_layer as native
from pallas_kernels.native import lora as native_lora
from test_decoder_layer import PAGE, QTINY, TINY, _pages, _params, decode_rows, quantized_params

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU decoder layer (no compiler)")

SPEC = lora.LoraSpec(max_loras=3, max_rank=8)  # rank 8: the deltas' loop for ranks that are not multiples of 16
SPEC16 = lora.LoraSpec(max_loras=3, max_rank=16)  # ... and the register-blocked one (`XaBlock`)


def _with_slots(config, params, dtype, seed=0, spec=SPEC):
    """`params` with random slots: every slot's A and B filled (the full rank in slots 1 and 3, rank
    4 padded with zeros in slot 2), large enough to move the logits; smaller in bfloat16, where the
    model rounds x @ A and the delta to bfloat16 and the fused call does not."""
    scale = 0.5 if dtype == jnp.float32 else 0.25
    params = lora.add_slots(params, config, spec, dtype)
    rng = np.random.default_rng(seed)
    layers = {}
    for i, layer in params["layers"].items():
        new = dict(layer)
        for name, stack in layer.items():
            if name.startswith("lora_"):
                values = rng.normal(0, scale, stack.shape).astype(np.float32)
                if name.startswith("lora_a_"):
                    values[..., 1, 4:] = 0  # [in, G, S, r]: slot 2 of rank 4
                else:
                    values[1, 4:] = 0  # [S, r, out]
                new[name] = jnp.asarray(values, dtype)
        layers[i] = new
    return {**params, "layers": layers}


def _setup(config, dtype, quantized=None, spec=SPEC):
    # The float path: with int8 activations the fused and per-matmul layers' norms round differently
    # and a flipped activation code shows past 1e-4 (test_quant_int_dot checks that path).
    backend = NativeCpuBackend(int8_activations=False)
    params = _params(config, dtype) if quantized is None else quantized_params(config, dtype, *quantized)
    packed = backend.prepare_params(config, _with_slots(config, params, dtype, spec=spec))
    ops = backend.ops(config)
    assert ops.fused
    return packed, ops


def _stepper(config, ops, spec=SPEC):
    graphdef = model_graphdef(config, lora=spec)

    def step(params, cache, tokens, positions, meta, ids):
        model = nnx.merge(graphdef, params)
        o = dataclasses.replace(ops, lora_ids=ids[:, None])
        return model(tokens, positions, cache, meta, o, logits_index=jnp.zeros((tokens.shape[0], 1), jnp.int32))

    return jax.jit(step, donate_argnums=(1,))


CONTEXTS = [5, 30, None, 0, 17, 9, 3]  # one padded row
MIXES = {
    "all slots and slot 0": [1, 2, 0, 3, 0, 1, 2],
    "slot 0 only": [0] * 7,
    "one slot": [2] * 7,
    "one row with an adapter": [0, 0, 0, 0, 3, 0, 0],
    "two slots, none": [3, 3, 0, 1, 1, 0, 3],
}


@pytest.mark.parametrize("spec", [SPEC, SPEC16], ids=["rank 8", "rank 16"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_lora_matches_the_xla_delta_for_every_mix_without_compiling(dtype, spec):
    config = TINY
    packed, fused = _setup(config, dtype, spec=spec)
    steps = {"fused": _stepper(config, fused, spec),
             "xla": _stepper(config, dataclasses.replace(fused, fused=False, native_lora=False), spec)}
    num_pages = 1 + sum(-(-(c + 1) // PAGE) for c in CONTEXTS if c is not None) + 2
    tokens, positions, meta, lens = decode_rows(CONTEXTS, num_pages, 0, TINY.vocab_size)
    live = lens > 0
    ids0 = jnp.zeros(len(CONTEXTS), jnp.int32)
    hlo = steps["fused"].lower(packed, _pages(config, num_pages, dtype, 0), tokens, positions, meta, ids0).as_text()
    assert native.TARGET_LORA in hlo  # the step runs the fused call with the deltas
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else dict(rtol=0.05, atol=0.15)
    base = None
    for name, mix in MIXES.items():
        ids = jnp.asarray(mix, jnp.int32)
        out = {}
        for kind, step in steps.items():
            logits, cache = step(packed, _pages(config, num_pages, dtype, 0), tokens, positions, meta, ids)
            out[kind] = (np.asarray(logits, np.float32), [np.asarray(p, np.float32) for kv in cache for p in kv])
        (got, got_pages), (want, want_pages) = out["fused"], out["xla"]
        np.testing.assert_allclose(got[live], want[live], **tol, err_msg=name)
        for g, w in zip(got_pages, want_pages):  # the new K/V (page 0: padded rows' writes)
            np.testing.assert_allclose(g[:, 1:], w[:, 1:], **tol, err_msg=name)
        if name == "slot 0 only":
            base = got
    for name, mix in MIXES.items():  # the adapters change their rows' logits, slot 0 rows stay the base's
        logits, _ = steps["fused"](packed, _pages(config, num_pages, dtype, 0), tokens, positions, meta,
                                   jnp.asarray(mix, jnp.int32))
        logits = np.asarray(logits, np.float32)
        for row, slot in enumerate(mix):
            if live[row]:
                assert (np.abs(logits[row] - base[row]).max() > 0.1) == (slot > 0), (name, row)
    assert steps["fused"]._cache_size() == 1 and steps["xla"]._cache_size() == 1  # one program for every mix


def test_fused_lora_beside_quantized_weights():
    packed, fused = _setup(QTINY, jnp.float32, quantized=("int4", 32, False))
    contexts = [4, 11, 2]
    num_pages = 1 + sum(-(-(c + 1) // PAGE) for c in contexts) + 2
    tokens, positions, meta, _ = decode_rows(contexts, num_pages, 1, TINY.vocab_size)
    ids = jnp.asarray([2, 0, 1], jnp.int32)
    got, want = (np.asarray(_stepper(QTINY, ops)(packed, _pages(QTINY, num_pages, jnp.float32, 1), tokens, positions,
                                                 meta, ids)[0])
                 for ops in (fused, dataclasses.replace(fused, fused=False, native_lora=False)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_slots_on_some_targets_only_run_unfused():
    config = TINY
    params = lora.add_slots(_params(config, jnp.float32), config, lora.LoraSpec(2, 4, ("wq", "wk", "wv", "wo")),
                            jnp.float32)
    model = nnx.merge(model_graphdef(config, lora=lora.LoraSpec(2, 4, ("wq", "wk", "wv", "wo"))), params)
    assert not fused_lora_slots(list(model.layers))
    full = nnx.merge(model_graphdef(config, lora=SPEC), lora.add_slots(_params(config, jnp.float32), config, SPEC,
                                                                        jnp.float32))
    assert fused_lora_slots(list(full.layers))


def test_bad_lora_ids_are_refused():
    config = TINY
    packed, fused = _setup(config, jnp.float32)
    tokens, positions, meta, _ = decode_rows([3, 5], 6, 2, TINY.vocab_size)
    step = _stepper(config, fused)
    with pytest.raises(Exception, match="lora_ids must be in 0 .. 3, got 4"):
        jax.block_until_ready(step(packed, _pages(config, 6, jnp.float32, 2), tokens, positions, meta,
                                   jnp.asarray([4, 0], jnp.int32)))


@pytest.mark.parametrize("r", [8, 16, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("targets, n_in", [(3, 40), (1, 24)], ids=["group of 3", "one target"])
def test_the_per_slot_delta_matches_the_dense_one_over_any_rows(dtype, targets, n_in, r):
    """Over a prefill-like x [2, 37, in]: every mix of slots, runs of one slot longer than a task
    (16 rows) and of every length mod the 4 rows `XaBlock` holds, rows with id 0 unchanged to the
    bit, the outputs' dtype kept; ranks that are multiples of 16 (register-blocked) and not."""
    rng = np.random.default_rng(1)
    S, widths = 3, (48, 16, 16)[:targets]
    a = jnp.asarray(rng.normal(0, 0.5, (n_in, targets, S, r)), dtype)
    bs = tuple(jnp.asarray(rng.normal(0, 0.5, (S, r, n)), dtype) for n in widths)
    x = jnp.asarray(rng.normal(0, 1, (2, 37, n_in)), jnp.float32)
    outs = tuple(jnp.asarray(rng.normal(0, 1, (2, 37, n)), jnp.float32) for n in widths)
    for ids in (rng.integers(0, S + 1, (2, 37)), np.full((2, 37), 2), np.zeros((2, 37), int),
                np.repeat([[0, 1, 3]], [5, 40, 29], axis=None).reshape(2, 37)):
        ids = jnp.asarray(ids, jnp.int32)
        got = jax.jit(native_lora.lora_delta)(x, ids, a, bs, outs)
        want = lora.dense_delta(x, ids, a.astype(jnp.float32), tuple(b.astype(jnp.float32) for b in bs), outs)
        for g, w, o in zip(got, want, outs):
            assert g.dtype == o.dtype and g.shape == o.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-4)
            base = np.asarray(ids) == 0
            np.testing.assert_array_equal(np.asarray(g)[base], np.asarray(o)[base])


def test_the_per_slot_delta_refuses_a_bad_id():
    a, b = jnp.zeros((8, 1, 2, 4)), jnp.zeros((2, 4, 8))
    with pytest.raises(Exception, match="ids must be in 0 .. 2, got 3"):
        jax.block_until_ready(native_lora.lora_delta(jnp.zeros((3, 8)), jnp.asarray([0, 3, 1]), a, (b,),
                                                     (jnp.zeros((3, 8)),)))
