"""The native-kernel build: shared headers are part of the cache key, $JSERVE_NATIVE_ARCH picks the
target."""

from __future__ import annotations

import ctypes
import platform
import shutil

import pytest

from pallas_kernels.native import build as native_build
from pallas_kernels.native.build import NativeLibrary


@pytest.fixture
def library(tmp_path, monkeypatch):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("JSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("#define VALUE 1\n")
    (src / "lib.cc").write_text('#include "value.h"\nextern "C" int Value() { return VALUE; }\n')
    return NativeLibrary("probe", src / "lib.cc", {}, what="probe", fallback="none", include_dir=src)


def _value(path) -> int:
    return ctypes.CDLL(str(path)).Value()


def test_a_changed_header_rebuilds(library):
    first = library._build()
    assert _value(first) == 1 and library._build() == first  # cached
    (library.include_dir / "value.h").write_text("#define VALUE 2\n")
    second = library._build()
    assert second != first and _value(second) == 2


def test_the_arch_is_in_the_flags_and_the_key(library, monkeypatch):
    monkeypatch.delenv("JSERVE_NATIVE_ARCH", raising=False)
    assert native_build.flags()[-1] == "-march=native"
    native = library._build()
    if platform.machine() != "x86_64":
        pytest.skip("x86 only")
    monkeypatch.setenv("JSERVE_NATIVE_ARCH", "x86-64")
    assert native_build.flags()[-1] == "-march=x86-64"
    other = library._build()
    assert other != native and _value(other) == 1


def test_constants_shared_across_the_ffi_are_checked_at_load(library):
    agreed = NativeLibrary("probe", library.source, {}, what="probe", fallback="none",
                           include_dir=library.include_dir, constants={"Value": 1})
    assert agreed.available()
    drifted = NativeLibrary("probe", library.source, {}, what="probe", fallback="none",
                            include_dir=library.include_dir, constants={"Value": 2})
    assert not drifted.available()
    assert "lib.cc's Value() is 1, the Python side expects 2" in drifted.unavailable_reason()


def test_the_shipped_kernels_agree_with_their_python_side():
    from pallas_kernels.native import decoder_layer, paged_attention

    for lib in (decoder_layer, paged_attention):
        if not lib.available():
            pytest.skip(f"no native build: {lib.unavailable_reason()}")
    assert decoder_layer._PER_LAYER == 11 and decoder_layer._K_PAGES == 9  # 2 norms, 7 weights, K, V


def test_prebuild_builds_each_library_once_on_its_own_thread(library, monkeypatch):
    """`backends.prebuild("cpu")` starts one thread per native library of the backend; a caller's
    `available()` meanwhile waits for that build instead of starting another."""
    import threading

    from jserve.runtime import backends
    from pallas_kernels.native import decoder_layer, matmul, paged_attention

    assert backends.prebuild("reference") == [] and backends.prebuild("cpu_pallas") == []
    builds, started = [], threading.Event()
    build = library._build

    def slow_build(quantized=False):
        builds.append(threading.current_thread().name)
        started.set()
        threading.Event().wait(0.5)  # the main thread asks meanwhile
        return build(quantized)

    monkeypatch.setattr(library, "_build", slow_build)
    for module in (paged_attention, matmul, decoder_layer):
        monkeypatch.setattr(module, "available", library.available)
    threads = backends.prebuild("cpu")
    assert len(threads) == 3 and all(t.daemon for t in threads)
    assert started.wait(30)
    assert library.available()  # waits for the thread's build
    for t in threads:
        t.join(30)
    assert len(builds) == 1 and builds[0].startswith("jserve-build-")
    more = backends.prebuild("cpu", quantized_weights=True, lora=True)  # + 2 quantized builds and the LoRA delta
    assert {t.name.removeprefix("jserve-build-") for t in more} == {
        "paged_attention", "matmul", "decoder_layer", "lora", "matmul-quantized", "decoder_layer-quantized"}
    for t in more:
        t.join(30)


def test_the_float_build_refuses_quantized_weights_and_the_quantized_build_runs_them():
    """The float-only build (all a float model waits for at a cold start) refuses a quantized
    weight by name; `matmul_packed` sends one to the build with the quantized kernels."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.native import matmul

    if not matmul.available():
        pytest.skip(f"no native build: {matmul.unavailable_reason()}")
    width, k = matmul.panel(), 32
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, k)), jnp.float32)
    codes = jnp.asarray(np.random.default_rng(1).integers(-127, 128, size=(1, k, width)), jnp.int8)
    scales = jnp.full((1, 1, 1, width), 0.5, jnp.float32)
    out = jax.ShapeDtypeStruct((2, width), jnp.float32)
    float_call = jax.ffi.ffi_call(matmul.TARGET_MANY, [out], vmap_method="sequential")
    attrs = dict(int8_rows=np.int32(0), quads=np.int32(0))
    with pytest.raises(Exception, match="float kernels only"):
        jax.block_until_ready(float_call(x, codes, scales, **attrs))
    quantized = matmul._LIBRARY.target(matmul.TARGET_MANY, True)
    assert quantized == f"{matmul.TARGET_MANY}_quantized"
    got, = jax.ffi.ffi_call(quantized, [out], vmap_method="sequential")(x, codes, scales, **attrs)
    want = np.asarray(x) @ (np.asarray(codes, np.float32)[0] * 0.5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
