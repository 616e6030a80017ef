"""LoRA deltas per row's slot (`lora.cc`): built on first use (`pallas_kernels.native.build`), called
as an XLA FFI target.

`lora_delta(x, ids, a, bs, outs)` adds to each base output the rows' adapter deltas,
(x @ A_s) @ B_s for each row's slot s only: what `jserve.model.lora.apply` computes densely over
every resident slot. The native backend's prefill and mixed steps take it (`NativeCpuOps.lora`);
decode steps have the same deltas inside the fused layers (`decoder_layer.cc`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.native.build import NativeLibrary

TARGET = "jserve_lora_delta"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LIBRARY = NativeLibrary("lora", Path(__file__).with_name("lora.cc"), {TARGET: "JserveLoraDelta"},
                         what="native CPU LoRA delta", fallback="the dense XLA delta over every slot")


def available() -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def takes(x: jax.Array, a: jax.Array, bs: Sequence[jax.Array]) -> bool:
    """Whether `lora_delta` takes these: A and the B stacks of one dtype, float32 or bfloat16, and
    the kernel built."""
    return (x.ndim >= 1 and a.ndim == 4 and jnp.dtype(a.dtype) in DTYPES
            and all(jnp.dtype(b.dtype) == jnp.dtype(a.dtype) and b.ndim == 3 for b in bs) and available())


def lora_delta(x: jax.Array, ids: jax.Array, a: jax.Array, bs: Sequence[jax.Array],
               outs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Each out_g [..., N_g] plus, for each row of x [..., K] whose id [...] is s > 0,
    (x @ a[:, g, s - 1, :]) @ bs[g][s - 1] (a [K, G, S, r], bs[g] [S, r, N_g]); rows with id 0
    unchanged. Products and sums in float32; the outputs keep their dtypes."""
    if not available():
        raise RuntimeError(f"native CPU LoRA delta unavailable: {unavailable_reason()}")
    K, G = a.shape[0], a.shape[1]
    if len(bs) != G or len(outs) != G:
        raise ValueError(f"lora_delta: A has {G} targets, got {len(bs)} B stacks and {len(outs)} outputs")
    lead = x.shape[:-1]
    flat = [o.reshape(-1, o.shape[-1]).astype(jnp.float32) for o in outs]
    call = jax.ffi.ffi_call(_LIBRARY.target(TARGET, False), tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in flat),
                            input_output_aliases={3 + G + g: g for g in range(G)}, vmap_method="sequential")
    new = call(x.reshape(-1, K).astype(jnp.float32), ids.reshape(-1).astype(jnp.int32), a, *bs, *flat)
    return tuple(n.reshape(*lead, n.shape[-1]).astype(o.dtype) for n, o in zip(new, outs))
