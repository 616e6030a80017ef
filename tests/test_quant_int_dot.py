"""The quantized matmul's integer path (pallas_kernels/native/quant_dot.h): x quantized to int8 per
block of 32 (or the group, if smaller), integer dot products against the weight's codes. Checked
against a numpy reference of exactly that math (tightly), against the float path within the
activations' rounding, at every code type, odd shapes and row tails; the row threshold
(`int8_rows`), the fused decoder layers, the backend option and an AVX2 build's kernel."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.model import quant
from pallas_kernels.native import matmul as native

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU matmul (no compiler)")
needs_int_dot = pytest.mark.skipif(not native.int_dot_available(),
                                   reason="no integer dot products in this build (AVX2, or AVX512-VNNI and VBMI)")

# (scheme, group size (0: per channel), symmetric): int8 (its codes + 128 unsigned), symmetric int4
# (codes + 8), int4 with offsets (unsigned codes); groups below, at and above the 32-column block.
FORMATS = [("int8", 0, True), ("int8", 32, True), ("int8", 8, True), ("int4", 32, True), ("int4", 32, False),
           ("int4", 16, True), ("int4", 64, False), ("int4", 128, True)]
ROWS = (1, 3, 4, 5, 16, 17, 33)


def _format_id(f):
    return f"{f[0]}-{'g' + str(f[1]) if f[1] else 'channel'}-{'sym' if f[2] else 'asym'}"


def quantize_rows(x: np.ndarray, block: int):
    """numpy reference of the kernel's activation quantization: q [M, K] int, scale [M, K / block]."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    return q.reshape(m, k), (amax / np.float32(127)).astype(np.float32)


def reference(x: np.ndarray, w: quant.QuantizedWeight):
    """(out, bound, xq, cs): the integer path's math in float64, sum over blocks b of x_scale[b] * (q_b
    @ the scaled codes) plus offset * the float sum of x, unsigned int4 codes centred (code - 8, the
    offset + 8 scale); bound: float32 rounding of its terms; xq = q * x_scale; cs: the scaled
    (centred) codes that xq multiplies."""
    k = x.shape[1]
    group = k // w.scales.shape[0]
    block = min(group, 32)
    q, sx = quantize_rows(x, block)
    xq = (q * np.repeat(sx, block, axis=1)).astype(np.float64)  # q * x_scale: what the codes multiply
    c = quant.codes(w).astype(np.float64)
    s = np.repeat(w.scales.astype(np.float64), group, axis=0)
    if w.offsets is not None:
        c = c - 8
    out = xq @ (c * s)
    mag = np.abs(xq) @ np.abs(c * s)
    if w.offsets is not None:
        o = np.repeat(w.offsets.astype(np.float64), group, axis=0) + 8 * s
        out += x.astype(np.float64) @ o
        mag += np.abs(x.astype(np.float64)) @ np.abs(o)
    return out, 1e-5 * mag + 1e-6, xq, np.abs(c * s)


def _weight(rng, k, n, scheme, group, symmetric):
    return quant.quantize(rng.standard_normal((k, n)).astype(np.float32), scheme, group, symmetric)


def _x(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, : k // 2] *= 40.0  # blocks of very different scales
    if m > 2:
        x[2, :] = 0.0  # an all-zero row: scale 0, codes 0 (offsets still count its zero sum)
        x[1, 5] = 1e4  # an outlier: its block's other values round to few levels
    return x


@needs_int_dot
@pytest.mark.parametrize("fmt", FORMATS, ids=_format_id)
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_integer_path_matches_its_numpy_reference_and_the_float_path(fmt, scale_dtype):
    rng = np.random.default_rng(0)
    k, n = (384 if fmt[1] != 8 else 200), 100  # N not a multiple of the panel; K = 200 not of 16 (g8)
    w = _weight(rng, k, n, *fmt)
    if scale_dtype == np.float32:
        w = quant.QuantizedWeight(w.values, w.scales.astype(np.float32),
                                  None if w.offsets is None else w.offsets.astype(np.float32), w.scheme, w.group_size)
    packed = native.pack_quantized(w)
    wd = quant.dequantize(w).astype(np.float64)
    for m in ROWS:
        x = _x(rng, m, k)
        got = np.asarray(native.matmul_packed(jnp.asarray(x), packed.with_int8_rows(1)))
        want, bound, xq, cs = reference(x, w)
        assert np.all(np.abs(got - want) <= bound), (m, np.abs(got - want).max())
        # Against the float path: within the activations' rounding, |x - q * scale| @ |scaled codes|
        # (<= half a step per element; the codes centred: about |w|), plus float32 rounding.
        flt = np.asarray(native.matmul_packed(jnp.asarray(x), packed))
        err = np.abs(x.astype(np.float64) - xq) @ cs
        assert np.all(cs <= np.abs(wd) + 8.01 * np.repeat(np.abs(w.scales), k // w.scales.shape[0], axis=0))
        assert np.all(np.abs(got - flt) <= err * (1 + 1e-4) + 2 * bound + 1e-4 * np.abs(flt)), m
        assert np.abs(got - flt).max() > 0  # the integer path ran (the rounding shows)


@needs_int_dot
def test_int8_rows_picks_the_path_and_a_row_does_not_depend_on_its_batch():
    rng = np.random.default_rng(1)
    w = native.pack_quantized(_weight(rng, 576, 200, "int4", 32, False))
    x = _x(rng, 16, 576)
    at4 = w.with_int8_rows(4)
    flt = np.asarray(native.matmul_packed(jnp.asarray(x), w))
    # Below the threshold: the float path, exactly.
    for m in (1, 3):
        np.testing.assert_array_equal(np.asarray(native.matmul_packed(jnp.asarray(x[:m]), at4)),
                                      np.asarray(native.matmul_packed(jnp.asarray(x[:m]), w)))
    # From it on: the integer path, each row the same whatever the batch (per-row scales, exact sums).
    full = np.asarray(native.matmul_packed(jnp.asarray(x), at4))
    assert not np.array_equal(full, flt)
    for m in (4, 5, 9):
        np.testing.assert_array_equal(np.asarray(native.matmul_packed(jnp.asarray(x[:m]), at4)), full[:m])
    # Several weights in one call (q/k/v): each as it would be alone.
    other = native.pack_quantized(_weight(rng, 576, 64, "int8", 0, True)).with_int8_rows(4)
    a, b = native.matmul_packed_many(jnp.asarray(x), (at4, other))
    np.testing.assert_array_equal(np.asarray(a), full)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(native.matmul_packed(jnp.asarray(x), other)))
    with pytest.raises(ValueError, match="int8_rows"):
        w.with_int8_rows(-1)


def test_the_backend_sets_int8_rows_from_its_option():
    from jserve.runtime.backends import NativeCpuBackend, create

    rng = np.random.default_rng(2)
    # int8 (per channel, or in groups of 32 as Q8_0): from one row, its codes stored as quads, where
    # AVX-512 VNNI reads them; else the float path below 8 rows.
    vnni = native.int_dot_isa() == "avx512-vnni"
    want8 = (1, True) if vnni else (native.DEFAULT_INT8_ROWS, False)
    assert native.default_int8_rows("int8") == want8[0]
    w = _weight(rng, 64, 96, "int8", 0, True)
    for group in (0, 32):
        packed = NativeCpuBackend()._pack_quantized(_weight(rng, 64, 96, "int8", group, True))
        assert (packed.int8_rows, packed.quads) == want8, group
    w4 = _weight(rng, 64, 96, "int4", 32, False)
    want = 1 if native.int_dot_available() else native.DEFAULT_INT8_ROWS
    assert native.default_int8_rows("int4") == want == NativeCpuBackend()._pack_quantized(w4).int8_rows
    assert NativeCpuBackend(int8_activations=False)._pack_quantized(w).int8_rows == 0
    assert NativeCpuBackend(batch_invariant=True)._pack_quantized(w).int8_rows == 0  # rows may not depend on M
    with pytest.raises(ValueError, match="int8_activations"):
        create("xla", int8_activations=False)


@needs_int_dot
@pytest.mark.parametrize("quantized", [("int8", 0, True), ("int4", 32, False), ("int4", 64, True)],
                         ids=["int8", "int4-g32-asym", "int4-g64-sym"])
def test_fused_layers_take_the_integer_path_as_the_model_does(quantized, monkeypatch):
    """The fused decoder layers with int8 activations against the model's own layers on the same
    packed weights and against the float model they stand for: within the activations' rounding
    (the fused layers' norms round differently from XLA's, and a code can flip with them)."""
    import test_decoder_layer as t

    monkeypatch.setattr(t, "INT8_ACTIVATIONS", True)
    contexts = [5, 30, None, 0, 17, 3, 9, 12, 1]
    assert len(contexts) >= native.DEFAULT_INT8_ROWS
    out, lens = t._run(t.QTINY, jnp.float32, contexts, quantized=quantized)
    live = lens > 0
    logits, pages = out["fused"]
    for ref in ("model", "float"):
        want = out[ref][0][live]
        err = np.abs(logits[live] - want).max() / np.abs(want).max()
        assert err < 0.1, (ref, err)  # random tiny weights: a loose check (quality: docs/performance.md)
        for got, w in zip(pages, out[ref][1]):
            assert np.abs(got[:, 1:] - w[:, 1:]).max() <= 0.1 * np.abs(w[:, 1:]).max() + 1e-6
    assert np.abs(logits[live] - out["float"][0][live]).max() > 0  # the integer path ran
    # int8_activations off: the float path, as before (the existing tests' tolerance).
    monkeypatch.setattr(t, "INT8_ACTIVATIONS", False)
    out, _ = t._run(t.QTINY, jnp.float32, contexts, quantized=quantized)
    np.testing.assert_allclose(out["fused"][0][live], out["float"][0][live], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="needs an x86 CPU")
def test_the_avx2_build_takes_the_integer_path():
    """An x86-64-v3 build (AVX2, no AVX-512: the VPMADDUBSW kernel, whatever this machine's own build
    is) against the numpy reference, exactly as the native build's test: int8 (an int8 code of -128
    included, which VPSIGNB alone would get wrong), symmetric and unsigned int4, row tails."""
    from conftest import run_python

    run_python(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import jax.numpy as jnp, numpy as np
from jserve.model import quant
from pallas_kernels.native import matmul as native
from test_quant_int_dot import _weight, _x, reference
assert native.int_dot_available() and native.panel() == 24
rng = np.random.default_rng(4)
for fmt in [("int8", 32, True), ("int8", 0, True), ("int4", 32, True), ("int4", 32, False), ("int4", 16, True)]:
    w = _weight(rng, 192, 50, *fmt)
    if fmt[0] == "int8":
        values = np.asarray(w.values).copy()
        values[3, :] = -128
        w = quant.QuantizedWeight(values, w.scales, w.offsets, w.scheme, w.group_size)
    packed = native.pack_quantized(w).with_int8_rows(1)
    for m in (1, 5, 16):
        x = _x(rng, m, 192)
        got = np.asarray(native.matmul_packed(jnp.asarray(x), packed))
        want, bound, _, _ = reference(x, w)
        assert np.all(np.abs(got - want) <= bound), (fmt, m, np.abs(got - want).max())
""", os.environ["JSERVE_KERNEL_CACHE"], JSERVE_NATIVE_ARCH="x86-64-v3")


@pytest.mark.skipif(not native.int_dot_available(), reason="codes are stored as quads on integer-path builds")
@pytest.mark.parametrize("scheme, group, symmetric", [("int4", 32, True), ("int4", 32, False), ("int8", 0, True),
                                                      ("int8", 32, True)], ids=["int4-sym", "int4-asym", "int8",
                                                                                 "int8-g32"])
def test_codes_stored_as_quads_read_back_as_before(scheme, group, symmetric):
    """From one row on int4 codes (and int8 ones on AVX-512 VNNI) are stored as quads: the codes,
    a tied table's embedding rows and the way back are those of the plain layout, the products
    those of the integer path on it, and a call that would take the float path for them is
    refused, not misread."""
    if scheme == "int8" and native.int_dot_isa() != "avx512-vnni":
        pytest.skip("int8 codes are stored as quads on AVX-512 VNNI builds only")
    rng = np.random.default_rng(5)
    w = native.pack_quantized(_weight(rng, 96, 70, scheme, group, symmetric))
    q = w.with_int8_rows(1)
    assert q.quads and not w.quads and not q.with_int8_rows(8).quads
    assert not np.array_equal(np.asarray(q.codes), np.asarray(w.codes))
    np.testing.assert_array_equal(np.asarray(q.with_int8_rows(0).codes), np.asarray(w.codes))
    np.testing.assert_array_equal(np.asarray(native.quantized_codes(q)), np.asarray(native.quantized_codes(w)))
    ids = jnp.asarray([[0, 7, 8, 15, 16, 23], [24, 31, 47, 48, 50, 69]], jnp.int32)  # vectors of 8 and 16, 2 panels
    np.testing.assert_array_equal(np.asarray(native.quantized_rows(q, ids, jnp.float32)),
                                  np.asarray(native.quantized_rows(w, ids, jnp.float32)))
    x = jnp.asarray(_x(rng, 3, 96))
    np.testing.assert_array_equal(np.asarray(native.matmul_packed(x, q)),
                                  np.asarray(native.matmul_packed(x, dataclasses.replace(w, int8_rows=1))))
    with pytest.raises(Exception, match="quads need the integer path"):
        jnp.asarray(native.matmul_packed(x, dataclasses.replace(q, int8_rows=4))).block_until_ready()


@pytest.mark.skipif(not native.int_dot_available(), reason="codes are stored as quads on integer-path builds")
def test_a_call_mixing_int4_quads_and_int8_rows_reads_each_as_stored():
    """One call of a GGUF layer's q/k/v may mix int4 codes stored as quads and int8 codes stored as
    rows (int8 keeps 8 rows by default): each weight is read in its own layout."""
    rng = np.random.default_rng(6)
    q4 = native.pack_quantized(_weight(rng, 96, 70, "int4", 32, False)).with_int8_rows(1)
    w8 = native.pack_quantized(_weight(rng, 96, 40, "int8", 32, True)).with_int8_rows(native.DEFAULT_INT8_ROWS)
    assert q4.quads and not w8.quads
    x = jnp.asarray(_x(rng, 3, 96))
    a, b = native.matmul_packed_many(x, (q4, w8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(native.matmul_packed(x, q4)))
    alone = native.matmul_packed(x, dataclasses.replace(w8, int8_rows=1))  # the call's rows: its fewest
    np.testing.assert_array_equal(np.asarray(b), np.asarray(alone))


def test_dataclass_field_is_static():
    w = native.pack_quantized(_weight(np.random.default_rng(3), 64, 8, "int8", 0, True))
    assert dataclasses.replace(w, int8_rows=3).int8_rows == 3
    import jax

    assert jax.tree.structure(w) != jax.tree.structure(w.with_int8_rows(3))  # a static field: part of the treedef
