"""The native CPU matmul over packed quantized weights (int8, int4) against numpy: x @ the weight
`jserve.model.quant.dequantize` makes of the codes, within float32 rounding of the |x| @ |w| sums;
the packed layout, the quantized embedding's lookup and head, and the backend's dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.model import quant
from pallas_kernels.native import matmul as native

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU matmul (no compiler)")

# (scheme, group size (0: per channel), symmetric)
FORMATS = [("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 32, False), ("int4", 64, True),
           ("int4", 64, False), ("int4", 128, True), ("int4", 128, False)]
ROWS = (1, 3, 8, 16, 64, 300)


def _format_id(f):
    return f"{f[0]}-{'g' + str(f[1]) if f[1] else 'channel'}-{'sym' if f[2] else 'asym'}"


def _weight(rng, k, n, scheme, group, symmetric, scale_dtype=np.float16) -> quant.QuantizedWeight:
    """A quantized weight; with float32 scales, ones float16 cannot hold (so that a kernel reading
    them as float16 would fail)."""
    w = quant.quantize(rng.standard_normal((k, n)).astype(np.float32), scheme, group, symmetric)
    if scale_dtype == np.float32:
        jitter = lambda a: (a.astype(np.float32) * (1 + 1e-3 * rng.standard_normal(a.shape))).astype(np.float32)  # noqa: E731
        w = quant.QuantizedWeight(w.values, jitter(w.scales), None if w.offsets is None else jitter(w.offsets),
                                  w.scheme, w.group_size)
    return w


def _assert_matches(out, x, w: quant.QuantizedWeight):
    """out == x @ dequantize(w) within 1e-5 of the sums of |x| |w| (float32 rounding)."""
    wd = quant.dequantize(w).astype(np.float64)
    x = np.asarray(x, np.float64).reshape(-1, wd.shape[0])
    want = x @ wd
    bound = np.abs(x) @ np.abs(wd)
    out = np.asarray(out, np.float64).reshape(want.shape)
    assert np.all(np.abs(out - want) <= 1e-5 * bound + 1e-30), np.max(np.abs(out - want) / (bound + 1e-30))
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32], ids=["f16-scales", "f32-scales"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_format_id)
def test_quantized_matches_the_dequantized_weight(fmt, scale_dtype):
    # K across several 128-row blocks and a group longer than a block (per channel, K = 384);
    # N not a multiple of the 24 / 48-column panels; rows around the 4 / 8-row micro-kernel.
    scheme, group, symmetric = fmt
    rng = np.random.default_rng(len(_format_id(fmt)) + (scale_dtype == np.float32))
    shapes = [(256, 49), (384, 100)] + ([(7, 5)] if scheme == "int8" and group == 0 else [(group or 32, 1)])
    for k, n in shapes:
        w = _weight(rng, k, n, scheme, group, symmetric, scale_dtype)
        packed = native.pack_quantized(w)
        assert packed.scales.dtype == scale_dtype
        for m in ROWS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = native.matmul_packed(x, packed)
            assert out.shape == (m, n) and out.dtype == jnp.float32
            _assert_matches(out, x, w)


def test_int4_codes_span_their_range_and_share_a_call_with_floats():
    # Every nibble value (extreme codes: -8 and 7, 0 and 15), weights of every kind read one x in
    # one call (q/k/v), leading batch dimensions, under jit.
    rng = np.random.default_rng(3)
    k = 128
    scales = rng.uniform(0.01, 0.1, (k // 32, 70)).astype(np.float16)
    signed = quant.QuantizedWeight(quant.pack_int4(rng.integers(-8, 8, (k, 70))), scales, None, "int4", 32)
    ws = [signed, _weight(rng, k, 24, "int4", 64, False), _weight(rng, k, 48, "int8", 0, True, np.float32)]
    codes = [np.asarray(quant.codes(w)) for w in ws]
    assert codes[0].min() == -8 and codes[0].max() == 7 and codes[1].min() == 0 and codes[1].max() == 15
    fw = jnp.asarray(rng.standard_normal((k, 30)), jnp.bfloat16)
    packed = (*(native.pack_quantized(w) for w in ws), native.pack(fw))
    x = rng.standard_normal((2, 5, k)).astype(np.float32)
    outs = jax.jit(native.matmul_packed_many, static_argnums=2)(x, packed, (70, 24, 48, 30))
    assert [o.shape for o in outs] == [(2, 5, 70), (2, 5, 24), (2, 5, 48), (2, 5, 30)]
    for out, w in zip(outs, ws):
        _assert_matches(out, x, w)
    np.testing.assert_allclose(np.asarray(outs[3]), x @ np.asarray(fw, np.float32), rtol=1e-5, atol=1e-4)


def test_groups_across_blocks_and_int8_offsets():
    # Groups that do not divide the kernel's 128-row blocks (96: blocks of whole groups; 192: a
    # group split over two blocks, its partial sums carried), and int8 codes with offsets (not a
    # form `quantize` makes, but one the format holds).
    rng = np.random.default_rng(8)
    k = 576
    for group in (96, 192):
        w = _weight(rng, k, 60, "int8", group, True)
        for m in (1, 9, 20, 513):  # 513: a prefill chunk's rows
            x = rng.standard_normal((m, k)).astype(np.float32)
            _assert_matches(native.matmul_packed(x, native.pack_quantized(w)), x, w)
    offsets = rng.standard_normal((k // 64, 60)).astype(np.float16)
    w = quant.QuantizedWeight(w.values, rng.uniform(0.01, 0.1, (k // 64, 60)).astype(np.float16), offsets, "int8", 64)
    x = rng.standard_normal((5, k)).astype(np.float32)
    assert native.pack_quantized(w).scales.shape[2] == 2
    _assert_matches(native.matmul_packed(x, native.pack_quantized(w)), x, w)


@pytest.mark.parametrize("fmt", [("int8", 0, True), ("int4", 32, True), ("int4", 64, False)], ids=_format_id)
def test_packed_layout(fmt):
    scheme, group, symmetric = fmt
    rng = np.random.default_rng(4)
    w = _weight(rng, 128, 50, scheme, group, symmetric)
    p = native.pack_quantized(w)
    width, panels = native.panel(), -(-50 // native.panel())
    rows = 64 if scheme == "int4" else 128
    assert p.codes.shape == (panels, rows, width) and p.codes.dtype == (jnp.uint8 if scheme == "int4" else jnp.int8)
    assert p.scales.shape == (panels, 128 // (group or 128), 1 if symmetric else 2, width)
    assert p.shape == (128, 50) and p.n == 50 and p.group_size == (group or 128) and p.symmetric == symmetric
    np.testing.assert_array_equal(np.asarray(native.quantized_codes(p)), np.asarray(quant.codes(w)))
    scales = np.asarray(p.scales).transpose(1, 2, 0, 3).reshape(p.scales.shape[1], p.scales.shape[2], -1)
    np.testing.assert_array_equal(scales[:, 0, :50], w.scales)
    if not symmetric:
        np.testing.assert_array_equal(scales[:, 1, :50], w.offsets)
    assert not scales[:, :, 50:].any()  # padded columns: zero scales and offsets
    assert p.nbytes == p.codes.size + p.scales.size * 2
    assert p[...] is p  # how the model reads a weight
    leaves = jax.tree.leaves(p)
    rebuilt = jax.tree.unflatten(jax.tree.structure(p), leaves)  # arrays the leaves, the rest static
    assert len(leaves) == 2 and rebuilt.codes is p.codes and (rebuilt.scheme, rebuilt.group_size, rebuilt.n) == (
        p.scheme, p.group_size, p.n)


def test_embedding_rows_and_head_from_the_packed_transpose():
    # A tied embedding E [vocab, hidden] held quantized as E^T [hidden, vocab], packed once: the
    # lookup dequantizes columns of it (to the activations' dtype), the head is x @ E^T.
    from jserve.model.config import ModelConfig
    from jserve.runtime.backends.native_cpu import NativeCpuOps

    rng = np.random.default_rng(5)
    vocab, hidden = 100, 64
    config = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    tokens = jnp.array([[0, 23, 24, 47], [48, 49, 95, 99]], jnp.int32)  # across 24- and 48-lane panels
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    for scheme, group, symmetric in [("int8", 0, True), ("int8", 32, True), ("int4", 32, False), ("int4", 64, True)]:
        table = _weight(rng, hidden, vocab, scheme, group, symmetric)  # E^T
        packed = native.pack_quantized(table)
        rows = np.asarray(quant.dequantize(table)).T[np.asarray(tokens)]
        ops = NativeCpuOps(None, config=config)
        for t in (packed, table):  # packed, and as loaded (the XLA lookup); the model casts the float32 rows
            got = ops.embed(t, tokens)
            assert got.dtype == jnp.float32 and got.shape == (2, 4, hidden)
            np.testing.assert_array_equal(np.asarray(got), rows)
        logits = ops.head(jnp.asarray(x), packed, True)
        assert logits.shape == (3, vocab) and logits.dtype == jnp.float32
        _assert_matches(logits, x, table)


def test_backend_packs_quantized_weights_and_falls_back_for_fp8():
    from jserve.model.llama import LAYER_MATMULS
    from jserve.runtime.backends import NativeCpuBackend
    from jserve.runtime.backends.native_cpu import native_linear
    from test_decoder_layer import QTINY, quantized_params

    backend = NativeCpuBackend()
    params = backend.prepare_params(QTINY, quantized_params(QTINY, jnp.float32, "int4", 32, False))
    layer = params["layers"][0]
    assert all(isinstance(layer[name], native.PackedQuantized) for name in LAYER_MATMULS)
    assert isinstance(params["embed"], native.PackedQuantized) and backend.native_head
    assert backend.native_matmuls and backend.ops(QTINY).fused

    backend = NativeCpuBackend()
    params = backend.prepare_params(QTINY, quantized_params(QTINY, jnp.float32, "fp8", 0, True))
    assert quant.is_quantized(params["layers"][0]["wq"]) and not backend.native_matmuls
    assert not backend.ops(QTINY).fused and not native.can_pack_quantized(params["layers"][0]["wq"])
    rng = np.random.default_rng(6)
    w8 = quant.quantize(rng.standard_normal((40, 30)).astype(np.float32), "fp8")
    w4 = _weight(rng, 40, 20, "int4", 0, True)  # one group per column
    x = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
    outs = native_linear(x, (w8, native.pack_quantized(w4)), (30, 20))  # a mix: one by one
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(quant.xla_quantized_linear(x, w8)), rtol=1e-6)
    _assert_matches(outs[1], x, w4)
    _assert_matches(native_linear(x, native.pack_quantized(w4), 20), x, w4)
    # An fp8 embedding (held as E^T) stays as loaded: the XLA lookup and head.
    ops = backend.ops(QTINY)
    table = params["embed"]
    assert quant.is_quantized(table) and not backend.native_head
    h = jnp.asarray(rng.standard_normal((3, QTINY.hidden_size)), jnp.float32)
    logits = ops.head(h, table, True)
    assert logits.dtype == jnp.float32 and logits.shape == (3, QTINY.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(quant.xla_quantized_linear(h, table, jnp.float32)),
                               rtol=1e-6)
    rows = ops.embed(table, jnp.array([0, 95]))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(quant.dequantize(table)).T[[0, 95]])


def test_bad_quantized_weights_are_refused():
    rng = np.random.default_rng(7)
    w = native.pack_quantized(_weight(rng, 64, 30, "int4", 32, True))
    with pytest.raises(ValueError, match="quantized weight packed"):
        native.matmul_packed(jnp.ones((2, 32)), w)
    with pytest.raises(ValueError, match="n=49"):
        native.matmul_packed(jnp.ones((2, 64)), w, 49)
    with pytest.raises(ValueError, match="2-D int8 or int4"):
        native.pack_quantized(quant.quantize(np.ones((4, 8, 6), np.float32), "int8"))
    with pytest.raises(ValueError, match="2-D int8 or int4"):
        native.pack_quantized(quant.quantize(np.ones((8, 6), np.float32), "fp8"))
    # Past the Python checks, the kernel's own (its build with the quantized kernels): scales of
    # the wrong shape for the codes.
    out = jax.ShapeDtypeStruct((2, w.codes.shape[0] * native.panel()), jnp.float32)
    bad = jax.ffi.ffi_call(native._LIBRARY.target(native.TARGET_MANY, quantized=True), out)
    attrs = dict(int8_rows=np.int32(0), quads=np.int32(0))
    with pytest.raises(Exception, match="quantized packed weight"):
        jax.block_until_ready(bad(jnp.ones((2, 64)), w.codes, w.scales[:, :1, :, :-1], **attrs))
    with pytest.raises(Exception, match="as many results as weights"):
        jax.block_until_ready(bad(jnp.ones((2, 64)), w.codes, w.scales, w.codes, w.scales, **attrs))
