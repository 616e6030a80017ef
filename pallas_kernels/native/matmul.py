"""The native CPU matmul (`matmul.cc`), built on first use (`pallas_kernels.native.build`).

`pack(w)` once at load, then `matmul_packed(x, packed, n)`: `x @ w` with w [K, N] packed as
[N / P, K, P] panels (P = `panel()`: 24 columns where the build has AVX2, 48 with AVX-512),
float32 or bfloat16 (`matmul_packed_many`: several weights that read the same x, one call): the
paged runner's layer matmuls and tied LM head on CPU (see `jserve.cpu_kernels`). Without a
compiler `available()` is False and the runner keeps XLA's dots and unpacked weights.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.native.build import NativeLibrary

TARGET = "jserve_matmul_packed"
TARGET_MANY = "jserve_matmul_packed_many"
_LIBRARY = NativeLibrary("matmul", Path(__file__).with_name("matmul.cc"),
                         {TARGET: "JserveMatmulPacked", TARGET_MANY: "JserveMatmulPackedMany"},
                         what="native CPU matmul", fallback="using XLA's dot")


def available() -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


@functools.cache
def panel() -> int:
    """Columns per packed panel of this machine's build (kPanel in matmul.cc: three SIMD
    vectors, 24 columns with AVX2, 48 with AVX-512, 24 in the plain-C++ fallback)."""
    if not available():
        raise RuntimeError(f"native CPU matmul unavailable: {unavailable_reason()}")
    return _LIBRARY.function("JserveMatmulPanel")()


WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def pack(w: jax.Array) -> jax.Array:
    """[K, N] -> [ceil(N / P), K, P] with P = `panel()`: column panels, N padded with zero
    columns. A bfloat16 weight stays bfloat16 (the kernel reads half the bytes and computes in
    float32); any other dtype becomes float32."""
    if w.ndim != 2:
        raise ValueError(f"pack needs a 2-D weight [K, N], got shape {w.shape}")
    k, n = w.shape
    width = panel()
    panels = -(-n // width)
    w = jnp.pad(w if w.dtype in WEIGHT_DTYPES else w.astype(jnp.float32),
                ((0, 0), (0, panels * width - n)))
    return w.reshape(k, panels, width).transpose(1, 0, 2)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of `pack`: [N / P, K, P] -> [K, n]."""
    p, k, width = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, p * width)[:, :n]


def matmul_packed(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """`x @ w` in float32 (x cast to float32) for x [..., K] and `packed = pack(w)`; returns
    float32 [..., n]."""
    return _call(TARGET, x, (packed,), (n,))[0]


def matmul_packed_many(x: jax.Array, packed: Sequence[jax.Array], ns: Sequence[int]) -> tuple[jax.Array, ...]:
    """`(x @ w_1, ..., x @ w_k)` for `packed[i] = pack(w_i)` as one call: the panels of all the
    weights are shared out over the threads together (q/k/v, gate/up: one wait, not three)."""
    if len(packed) != len(ns) or not packed:
        raise ValueError(f"matmul_packed_many needs one width per weight, got {len(packed)} weights "
                         f"and widths {tuple(ns)}")
    return _call(TARGET_MANY, x, tuple(packed), tuple(ns))


def _call(target: str, x: jax.Array, packed: tuple, ns: tuple) -> tuple[jax.Array, ...]:
    width = panel()  # raises if the kernel is unavailable
    for w, n in zip(packed, ns):
        if w.ndim != 3 or w.shape[2] != width or x.shape[-1] != w.shape[1]:
            raise ValueError(f"matmul_packed needs x [..., K] and a packed weight [N / {width}, K, {width}], "
                             f"got {x.shape} and {w.shape}")
        if w.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"matmul_packed needs a float32 or bfloat16 packed weight, got {w.dtype}")
        if not 0 < n <= w.shape[0] * width:
            raise ValueError(f"n={n} must be in (0, {w.shape[0] * width}] for packed {w.shape}")
    lead = x.shape[:-1]
    flat = x.reshape(math.prod(lead), x.shape[-1]).astype(jnp.float32)
    shapes = [jax.ShapeDtypeStruct((flat.shape[0], w.shape[0] * width), jnp.float32) for w in packed]
    outs = jax.ffi.ffi_call(target, shapes if target == TARGET_MANY else shapes[0],
                            vmap_method="sequential")(flat, *packed)
    outs = outs if target == TARGET_MANY else (outs,)
    return tuple((o if o.shape[1] == n else o[:, :n]).reshape(*lead, n) for o, n in zip(outs, ns))
