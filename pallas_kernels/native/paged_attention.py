"""The native CPU attention kernel (`paged_attention.cc`): built on first use, called as an XLA FFI target.

See `pallas_kernels.native.build` for how it is built and cached. If there is no compiler or the
build fails, `available()` says so once in the log and the "cpu" backend keeps its Pallas
interpret-mode kernels (which the "cpu_pallas" backend always uses).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native.build import NativeLibrary

TARGET = "jserve_paged_attention"
MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # kMaxGroups, kMaxHeadDim in decode_attention.h (checked at load)
_LIBRARY = NativeLibrary("paged_attention", Path(__file__).with_name("paged_attention.cc"),
                         {TARGET: "JservePagedAttention"}, what="native CPU attention kernel",
                         fallback="using the Pallas interpret kernels",
                         constants={"JserveMaxGroups": MAX_GROUPS, "JserveMaxHeadDim": MAX_HEAD_DIM})


# float pages, and quantized codes (with float32 scales per token and KV head)
QUANTIZED_PAGE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # the quantized build's
PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), *QUANTIZED_PAGE_DTYPES)


def supports(groups: int, head_dim: int, dtype=jnp.float32) -> bool:
    """Whether the kernel takes this many query heads per KV head, this head_dim and pages of
    this dtype."""
    return groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM and jnp.dtype(dtype) in PAGE_DTYPES


def available(quantized: bool = False) -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed.
    `quantized`: its build with the quantized kernels too (`build.NativeLibrary`)."""
    return _LIBRARY.available(quantized)


def unavailable_reason(quantized: bool = False) -> str | None:
    return _LIBRARY.unavailable_reason(quantized)


def paged_attention_rows(q_rows: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         q_start: jax.Array, q_lens: jax.Array, page_indices: jax.Array, *,
                         groups: int, sm_scale: float, soft_cap: float | None,
                         sliding_window: int | None, k_scales: jax.Array | None = None,
                         v_scales: jax.Array | None = None, batch_invariant: bool = False) -> jax.Array:
    """Attention of packed query rows [batch, num_kv_heads, tokens * groups, head_dim]; f32 out.

    Same contract as `cpu.paged_attention_rows` (decode is the one-token case); int8 and
    float8_e4m3fn pages take their float32 scales [num_kv_heads, num_pages, page_size].
    `batch_invariant`: each token's output bitwise the same whatever the call's other rows and
    tokens (one code path for decode and prefill, key blocks at fixed positions, no split keys).
    """
    if not available():
        raise RuntimeError(f"native CPU attention kernel unavailable: {unavailable_reason()}")
    if k_scales is None:  # float pages: the kernel takes empty scales
        k_scales = v_scales = jnp.zeros((0,), jnp.float32)
    quantized = jnp.dtype(k_pages.dtype) in QUANTIZED_PAGE_DTYPES
    call = jax.ffi.ffi_call(_LIBRARY.target(TARGET, quantized), jax.ShapeDtypeStruct(q_rows.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q_rows.astype(jnp.float32), k_pages, v_pages, k_scales, v_scales, q_start, q_lens, page_indices,
                groups=np.int32(groups), sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int32(sliding_window or 0),
                batch_invariant=np.int32(batch_invariant))
