"""The fused native decode layers (`pallas_kernels.native.decoder_layer`) against the model's own path
(XLA ops around the native matmul and attention kernels) on the same packed weights and pages."""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_python
from jserve.model import model_graphdef, quant
from jserve.model.config import ModelConfig
from jserve.model.llama import LAYER_MATMULS, LlamaModel
from jserve.runtime.backends import NativeCpuBackend
from jserve.runtime.backends.native_cpu import fused_layers_supported
from jserve.runtime.kv_cache import init_kv_pages
from jserve.runtime.paged_attention import PagedMeta
from pallas_kernels.native import decoder_layer as native
from pallas_kernels.native.build import _cpu_flags

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU decoder layer (no compiler)")

# Widths that are not multiples of the 24 / 48-column panels, 3 query heads per KV head.
TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=40, intermediate_size=72, num_layers=3,
                   num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                   tie_word_embeddings=True)
PAGE = 8
# For quantized weights: every K (hidden 64, 8 heads of 16, intermediate 128) a multiple of the groups.
QTINY = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, num_heads=8)


def _params(config: ModelConfig, dtype) -> dict:
    model = LlamaModel(config, rngs=nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # Norm weights away from 1, so a norm applied wrongly would show.
    pure = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.3 * jax.random.normal(jax.random.key(len(path)), x.shape)
        if "norm" in str(path[-1]) else x * 8.0, pure)
    return jax.tree.map(lambda x: x.astype(dtype), pure)


def quantized_params(config: ModelConfig, dtype, scheme: str, group: int, symmetric: bool) -> dict:
    """`_params` with every layer matmul quantized (`scheme` in groups of `group` along K) and the
    tied embedding held as its transpose quantized int8 per channel (the model's quantized form)."""
    params = _params(config, dtype)
    layers = {i: {name: quant.quantize(np.asarray(w, np.float32), scheme, group, symmetric)
                  if name in LAYER_MATMULS else w for name, w in layer.items()}
              for i, layer in params["layers"].items()}
    embed = quant.quantize(np.asarray(params["embed"], np.float32).T, "int8" if scheme != "fp8" else "fp8")
    return {**params, "layers": layers, "embed": embed}


def dequantized_params(params: dict, dtype) -> dict:
    """The float model that quantized params stand for (the embedding back to [vocab, hidden])."""
    def floats(w):
        return jnp.asarray(quant.dequantize(w), dtype) if quant.is_quantized(w) else w
    layers = {i: {name: floats(w) for name, w in layer.items()} for i, layer in params["layers"].items()}
    return {**params, "layers": layers, "embed": floats(params["embed"]).T}


def _pages(config: ModelConfig, num_pages: int, dtype, seed: int):
    """Random K/V in every page (the null page too: padded rows must not read it)."""
    keys = jax.random.split(jax.random.key(seed), 2 * config.num_layers)
    shape = (config.num_kv_heads, num_pages, PAGE, config.head_dim)
    return tuple((jax.random.normal(keys[2 * i], shape).astype(dtype),
                  jax.random.normal(keys[2 * i + 1], shape).astype(dtype)) for i in range(config.num_layers))


def _step(config, params, ops, cache, tokens, positions, meta):
    model = nnx.merge(model_graphdef(config), params)
    return model(tokens, positions, cache, meta, ops, logits_index=jnp.zeros((tokens.shape[0], 1), jnp.int32))


# Quantized weights' matmuls on the float path here (x @ the dequantized weight, to float32 rounding);
# tests/test_quant_int_dot.py runs these steps with int8 activations.
INT8_ACTIVATIONS = False


def decode_rows(contexts, num_pages: int, seed: int, vocab_size: int):
    """A decode step's rows with these cached lengths (None: a padded row) over scattered pages:
    (tokens [B, 1], positions [B, 1], PagedMeta, q_lens)."""
    B, max_pages = len(contexts), max(-(-(c + 1) // PAGE) for c in contexts if c is not None)
    rng = np.random.RandomState(seed)
    table = np.zeros((B, max_pages), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))  # scattered pages
    slots, starts, lens = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
    for b, c in enumerate(contexts):
        if c is None:
            continue
        n = -(-(c + 1) // PAGE)
        table[b, :n] = [free.pop() for _ in range(n)]
        slots[b] = table[b, c // PAGE] * PAGE + c % PAGE
        starts[b], lens[b] = c, 1
    tokens = jnp.asarray(rng.randint(0, vocab_size, (B, 1)), jnp.int32)
    meta = PagedMeta(jnp.asarray(slots), jnp.asarray(starts), jnp.asarray(lens), jnp.asarray(table))
    return tokens, jnp.asarray(starts[:, None]), meta, lens


def _run(config, dtype, contexts, *, seed=0, quantized=None):
    """Logits and pages from one decode step of rows with these cached lengths (None: a padded
    row), fused and not; `quantized` (scheme, group, symmetric): the weights quantized, and a
    third run, "float", of the float model they stand for on XLA's dots."""
    num_pages = 1 + sum(-(-(c + 1) // PAGE) for c in contexts if c is not None) + 2
    backend = NativeCpuBackend(int8_activations=INT8_ACTIVATIONS)
    params = _params(config, dtype) if quantized is None else quantized_params(config, dtype, *quantized)
    packed = backend.prepare_params(config, params)
    assert backend.native_matmuls and backend.native_head
    fused = backend.ops(config)
    assert fused.fused
    runs = {"model": (dataclasses.replace(fused, fused=False), packed), "fused": (fused, packed)}
    if quantized is not None:
        plain = NativeCpuBackend(native_matmuls=False)
        floats = plain.prepare_params(config, dequantized_params(params, dtype))
        runs["float"] = (plain.ops(config), floats)
    tokens, positions, meta, lens = decode_rows(contexts, num_pages, seed, config.vocab_size)
    out = {}
    for name, (ops, weights) in runs.items():
        cache = _pages(config, num_pages, dtype, seed)
        step = jax.jit(lambda p, c, t, pos, m, o=ops: _step(config, p, o, c, t, pos, m), donate_argnums=(1,))
        logits, cache = step(weights, cache, tokens, positions, meta)
        out[name] = (np.asarray(logits, np.float32), [np.asarray(p, np.float32) for kv in cache for p in kv])
    return out, lens


def _assert_fused_matches(config, dtype, contexts, *, seed=0, quantized=None):
    out, lens = _run(config, dtype, contexts, seed=seed, quantized=quantized)
    live = lens > 0
    # float32 alike up to summation order; bfloat16: the fused layers keep float32 between the
    # ops where the model rounds to bfloat16 after each.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else dict(rtol=0.05, atol=0.1)
    (logits, pages) = out["fused"]
    for ref in ("model", "float") if quantized else ("model",):
        ref_logits, ref_pages = out[ref]
        np.testing.assert_allclose(logits[live], ref_logits[live], **tol)
        assert np.abs(ref_logits[live]).max() > 1.0  # not a degenerate model
        for got, want in zip(pages, ref_pages):  # the new K/V written where the model writes them
            np.testing.assert_allclose(got[:, 1:], want[:, 1:], **tol)  # page 0: padded rows' writes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("contexts", [[5, 30, None, 0, 17], [3, 9, 64, 1, 22, 40, 7, 12, 50, 33, 2]],
                         ids=["5 rows, one padded", "11 rows"])
def test_fused_layers_match_the_model(dtype, contexts):
    _assert_fused_matches(TINY, dtype, contexts)


@pytest.mark.parametrize("quantized", [("int8", 0, True), ("int8", 32, True), ("int4", 32, False), ("int4", 64, True)],
                         ids=["int8", "int8-g32", "int4-g32-asym", "int4-g64-sym"])
def test_fused_quantized_layers_match_the_model(quantized):
    # Quantized layer matmuls and embedding (packed for the kernel): the fused layers against the
    # model's own layers over the same packed weights, and against the float model they stand for.
    _assert_fused_matches(QTINY, jnp.float32, [5, 30, None, 0, 17], quantized=quantized)
    if quantized == ("int4", 32, False):
        _assert_fused_matches(QTINY, jnp.bfloat16, [3, 9, 64, 1, 22, 40, 7, 12, 50], quantized=quantized)


def test_fused_layers_split_long_rows_and_keep_a_sliding_window():
    """Two rows of long contexts: the attention splits each row's keys over tasks (merged
    after); with a sliding window only the last keys count."""
    for config in (TINY, dataclasses.replace(TINY, sliding_window=40)):
        _assert_fused_matches(config, jnp.float32, [700, 650], seed=1)


@pytest.mark.parametrize("arch,needs", [("x86-64-v3", "avx2"), ("x86-64", None)])
def test_each_simd_build_matches_the_model(arch, needs):
    # The builds this machine does not pick (AVX2 on an AVX-512 machine, plain C++: 24-column
    # panels), in a fresh process: the CI machine may be either kind.
    if platform.machine() not in ("x86_64", "AMD64") or (needs and needs not in _cpu_flags().split()):
        pytest.skip(f"needs an x86 CPU with {needs or 'x86-64'}")
    run_python(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import jax.numpy as jnp
import test_decoder_layer as t
from pallas_kernels.native import matmul as native
assert native.panel() == 24, native.panel()
t._assert_fused_matches(t.TINY, jnp.float32, [5, 30, None, 0, 17])
t._assert_fused_matches(t.TINY, jnp.bfloat16, [300, 2], seed=2)
t._assert_fused_matches(t.QTINY, jnp.float32, [5, 30, None, 0, 17], quantized=("int4", 32, False))
t._assert_fused_matches(t.QTINY, jnp.float32, [4, 1], quantized=("int8", 0, True))
""", os.environ["JSERVE_KERNEL_CACHE"], JSERVE_NATIVE_ARCH=arch)  # the run's cache: builds keyed by arch


def test_unsupported_models_keep_the_model_path():
    assert not fused_layers_supported(dataclasses.replace(TINY, qkv_bias=True))
    assert not fused_layers_supported(dataclasses.replace(TINY, qk_norm=True))
    assert fused_layers_supported(TINY)
    plain = NativeCpuBackend(native_matmuls=False)
    plain.prepare_params(TINY, _params(TINY, jnp.float32))
    assert not plain.ops(TINY).fused  # nothing packed: no fused layers
    backend = NativeCpuBackend()
    backend.prepare_params(TINY, _params(TINY, jnp.float32))
    ops = backend.ops(TINY)
    decode, prefill = jnp.zeros((2, 1, TINY.hidden_size)), jnp.zeros((2, 3, TINY.hidden_size))
    assert ops.takes_fused(decode, init_kv_pages(TINY, 4, PAGE, jnp.float32))
    assert not ops.takes_fused(decode, init_kv_pages(TINY, 4, PAGE, jnp.float16))  # float16 pages
    assert not ops.takes_fused(prefill, init_kv_pages(TINY, 4, PAGE, jnp.float32))
    assert not native.supports(num_heads=6, num_kv_heads=2, head_dim=12)
    assert not native.supports(num_heads=34, num_kv_heads=2, head_dim=16)


def test_bad_shapes_are_refused_with_the_reason():
    config = TINY
    packed = NativeCpuBackend().prepare_params(config, _params(config, jnp.float32))
    w = packed["layers"][0]
    weights = tuple(w[name] for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    k, v = init_kv_pages(config, 4, PAGE, jnp.float32)[0]
    x = jnp.zeros((2, config.hidden_size))
    rot = jnp.zeros((2, config.head_dim))
    ints = jnp.zeros((2,), jnp.int32)
    table = jnp.zeros((2, 3), jnp.int32)
    kw = dict(num_heads=config.num_heads, eps=1e-5, sm_scale=0.25, sliding_window=None)
    layer = native.LayerArgs(w["attn_norm"], w["mlp_norm"], weights, k, v)
    native.decoder_layers(x, rot, rot, [layer], ints, ints, ints, table, **kw)  # well formed
    swapped = layer._replace(weights=(weights[1], weights[0], *weights[2:]))
    with pytest.raises(Exception, match="wq must be"):
        jax.block_until_ready(native.decoder_layers(x, rot, rot, [swapped], ints, ints, ints, table, **kw))
    with pytest.raises(Exception, match="cos and sin"):
        jax.block_until_ready(native.decoder_layers(x, rot[:, :8], rot[:, :8], [layer], ints, ints, ints, table, **kw))
    with pytest.raises(ValueError, match="7 packed weights"):
        native.decoder_layers(x, rot, rot, [layer._replace(weights=weights[:6])], ints, ints, ints, table, **kw)
