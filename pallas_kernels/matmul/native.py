"""The native CPU matmul for few rows (`cpu_matmul.cc`): `x @ w.T` with w in [N, K] layout.

Built on first use like the native attention kernel (`pallas_kernels.native_build`). The runner
uses it for the tied LM head of decode steps, where XLA:CPU's dot is 2-3x slower (see
`jserve.runner.NATIVE_HEAD_MIN_ROWS`); without a compiler the head stays an XLA dot.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.native_build import NativeLibrary

TARGET = "jserve_matmul_nt"
_LIBRARY = NativeLibrary("matmul", Path(__file__).with_name("cpu_matmul.cc"),
                         {TARGET: "JserveMatmulNT"}, what="native CPU matmul",
                         fallback="using XLA's dot")


def available() -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` in float32: x [M, K], w [N, K] (both cast to float32) -> [M, N]."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_nt needs x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if not available():
        raise RuntimeError(f"native CPU matmul unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w.astype(jnp.float32))
