"""The native CPU matmul over packed weights against numpy in float64, and the packed
embedding's lookup."""

from __future__ import annotations

import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_python
from pallas_kernels.native import matmul as native


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,k,n", [
    ((1,), 576, 576), ((16,), 576, 1536), ((2, 8), 1536, 576), ((5,), 64, 70), ((130,), 100, 48),
    ((3,), 7, 5), ((4,), 0, 24), ((513,), 40, 30), ((2, 7), 64, 49), ((12,), 200, 97)])
def test_packed_matches_numpy(lead, k, n, dtype):
    # Rows around the micro-kernel's 4 (AVX2) or 8 (AVX-512) rows (tails of 1-7 rows), N around
    # the 24- or 48-column panels (padded with zero columns), K across several 128-row blocks,
    # leading batch dims; a bfloat16 weight is packed as bfloat16 and multiplied as its float32
    # value.
    rng = np.random.default_rng(k * 7 + n)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    packed = native.pack(w)
    assert packed.shape == (-(-n // native.panel()), k, native.panel()) and packed.dtype == dtype
    np.testing.assert_array_equal(np.asarray(native.unpack(packed, n)), np.asarray(w))
    w = np.asarray(w, np.float32)
    out = jax.jit(native.matmul_packed, static_argnums=2)(x, packed, n)
    assert out.shape == (*lead, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5,
                               atol=1e-5 * max(k, 1) ** 0.5)


@pytest.mark.parametrize("lead,k,ns", [((16,), 576, (576, 192, 192)), ((2, 3), 64, (70, 24, 1)),
                                       ((5,), 0, (30, 48)), ((130,), 100, (1536, 1536))])
def test_packed_many_matches_numpy(lead, k, ns):
    # Several weights read one x in one call (q/k/v, gate/up): each product as if alone, the
    # weights' dtypes mixed.
    rng = np.random.default_rng(k + sum(ns))
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    dtypes = [(jnp.float32, jnp.bfloat16)[i % 2] for i in range(len(ns))]
    ws = [np.asarray(jnp.asarray(rng.standard_normal((k, n)), dt), np.float32) for n, dt in zip(ns, dtypes)]
    packed = tuple(native.pack(jnp.asarray(w, dt)) for w, dt in zip(ws, dtypes))
    outs = jax.jit(native.matmul_packed_many, static_argnums=2)(x, packed, ns)
    assert len(outs) == len(ns)
    for out, w, n in zip(outs, ws, ns):
        assert out.shape == (*lead, n) and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5,
                                   atol=1e-5 * max(k, 1) ** 0.5)


def _cpu_flags() -> set[str]:
    from pallas_kernels.native.build import _cpu_flags

    return set(_cpu_flags().split())


def test_the_build_picks_its_panel_width_from_the_machine():
    # -march=native: three AVX-512 vectors where the CPU has them, else three AVX2 ones.
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    assert native.panel() == (48 if "avx512f" in _cpu_flags() else 24)


@pytest.mark.parametrize("arch,width,needs", [("x86-64-v3", 24, "avx2"), ("x86-64", 24, None)])
def test_each_simd_build_matches_numpy(arch, width, needs):
    # The builds this machine does not pick (AVX2 on an AVX-512 machine, plain C++), built with
    # $JSERVE_NATIVE_ARCH in a fresh process: the CI machine may be either kind.
    if platform.machine() not in ("x86_64", "AMD64") or (needs and needs not in _cpu_flags()):
        pytest.skip(f"needs an x86 CPU with {needs or 'x86-64'}")
    run_python(f"""
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.native import matmul as native
assert native.panel() == {width}, native.panel()
rng = np.random.default_rng(0)
for dtype in (jnp.float32, jnp.bfloat16):
    for m, k, ns in ((1, 576, (576,)), (16, 576, (576, 192)), (7, 300, (100,)), (33, 130, (49, 1536))):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ws = [jnp.asarray(rng.standard_normal((k, n)), dtype) for n in ns]
        outs = native.matmul_packed_many(x, tuple(native.pack(w) for w in ws), ns)
        for out, w in zip(outs, ws):
            want = x.astype(np.float64) @ np.asarray(w, np.float64)
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
# Quantized panels (tests/test_quant_matmul.py runs every format on this machine's build).
from jserve.model import quant
for scheme, group, sym, scale_dtype in (("int8", 0, True, np.float16), ("int8", 32, True, np.float32),
                                        ("int4", 32, True, np.float16), ("int4", 64, False, np.float32)):
    for m, k, n in ((1, 256, 49), (9, 192, 24), (33, 384, 100)):
        w = quant.quantize(rng.standard_normal((k, n)).astype(np.float32), scheme, group, sym)
        w = quant.QuantizedWeight(w.values, w.scales.astype(scale_dtype),
                                  None if sym else w.offsets.astype(scale_dtype), scheme, w.group_size)
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.asarray(native.matmul_packed(x, native.pack_quantized(w)), np.float64)
        wd = quant.dequantize(w).astype(np.float64)
        bound = np.abs(x) @ np.abs(wd)
        assert np.all(np.abs(out - x.astype(np.float64) @ wd) <= 1e-5 * bound), (scheme, group, m, k, n)
""", os.environ["JSERVE_KERNEL_CACHE"], JSERVE_NATIVE_ARCH=arch)  # the run's cache: builds keyed by arch


def test_native_linear_takes_a_tuple_of_weights():
    # The model's hook: a tuple of packed weights is one call, a tuple with a plain weight is not.
    from jserve.model.llama import xla_linear
    from jserve.runtime.backends.native_cpu import native_linear

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((32, n)), jnp.float32) for n in (40, 8)]
    want = [np.asarray(x) @ np.asarray(w) for w in ws]
    cases = ((native_linear, tuple(native.pack(w) for w in ws)),
             (native_linear, (native.pack(ws[0]), ws[1])), (xla_linear, tuple(ws)))
    for hook, params in cases:
        outs = hook(x, params, (40, 8))
        assert isinstance(outs, tuple) and len(outs) == 2
        for out, w in zip(outs, want):
            np.testing.assert_allclose(np.asarray(out), w, rtol=1e-5, atol=1e-4)


def test_embedding_rows_from_the_packed_transpose():
    # The native CPU backend packs the embedding's transpose; its lookup reads the panels.
    from jserve.runtime.backends.native_cpu import NativeCpuOps

    embed_rows = NativeCpuOps(None).embed

    embed = jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), jnp.float32)
    tokens = jnp.array([[0, 23, 24, 49], [7, 47, 48, 1]], jnp.int32)  # across 24- and 48-lane panels
    packed = native.pack(embed.T)
    np.testing.assert_array_equal(np.asarray(embed_rows(packed, tokens)), np.asarray(embed)[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(embed_rows(embed, tokens)), np.asarray(embed)[np.asarray(tokens)])


def test_packed_refuses_bad_shapes():
    packed = native.pack(jnp.ones((8, 30)))
    with pytest.raises(ValueError, match=rf"\(2, 9\) and \({packed.shape[0]}, 8, {native.panel()}\)"):
        native.matmul_packed(jnp.ones((2, 9)), packed, 30)
    with pytest.raises(ValueError, match="n=49"):
        native.matmul_packed(jnp.ones((2, 8)), packed, 49)
    with pytest.raises(ValueError, match="2-D"):
        native.pack(jnp.ones((2, 3, 4)))
    assert native.pack(jnp.ones((8, 30), jnp.float16)).dtype == jnp.float32  # only bf16 stays narrow
    with pytest.raises(ValueError, match="float32 or bfloat16 packed weight, got float16"):
        native.matmul_packed(jnp.ones((2, 8)), packed.astype(jnp.float16), 30)
    with pytest.raises(ValueError, match="n=49"):
        native.matmul_packed_many(jnp.ones((2, 8)), (packed, packed), (30, 49))
    with pytest.raises(ValueError, match="one width per weight"):
        native.matmul_packed_many(jnp.ones((2, 8)), (packed, packed), (30,))


def test_without_a_compiler_it_says_why_once(tmp_path):
    code = ("from pallas_kernels.native import matmul as native\n"
            "assert not native.available() and not native.available()\n"
            "print('REASON', native.unavailable_reason())\n")
    done = run_python(code, tmp_path, CXX="/bin/false")
    assert "REASON RuntimeError: /bin/false" in done.stdout
    assert done.stderr.count("native CPU matmul unavailable, using XLA's dot") == 1
