"""Backends: how the paged runner's steps execute (`Backend`, the runtime's one seam).

`create(name)` builds one by its `--attention-backend` name: "cpu" is the native CPU backend;
"tpu", "gpu", "reference" and "cpu_pallas" are the XLA backend with that attention kernel; None
picks the platform's (native on a CPU, XLA elsewhere).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from jserve.runtime.backends.base import Backend
from jserve.runtime.backends.native_cpu import NativeCpuBackend
from jserve.runtime.backends.xla import KERNELS as XLA_KERNELS
from jserve.runtime.backends.xla import XlaBackend

NAMES = ("cpu", *XLA_KERNELS)

__all__ = ["NAMES", "Backend", "NativeCpuBackend", "XlaBackend", "create", "default_name", "prebuild"]


def default_name() -> str:
    """The backend for this platform: the XLA one with Mosaic kernels on TPU and GPU, else native."""
    return {"tpu": "tpu", "gpu": "gpu"}.get(jax.devices()[0].platform, "cpu")


def create(name: str | Backend | None = None, *, mesh: Any = None, **options: Any) -> Backend:
    """The backend called `name` (a Backend passes through); `options` go to its constructor
    (`huge_pages`, and `native_matmuls` for "cpu" or `scan` for the XLA ones). Another backend's
    option at its default value is ignored (callers such as the Runner pass both); set to anything
    else it is a ValueError naming it."""
    if isinstance(name, Backend):
        return name
    name = name or default_name()
    if name == "cpu":
        if options.pop("scan", True) is not True:
            raise ValueError("scan is an option of the XLA backends; the native CPU backend ('cpu') runs its "
                             "layers unrolled")
        return NativeCpuBackend(mesh=mesh, **options)
    if name in XLA_KERNELS:
        if options.pop("native_matmuls", True) is not True:
            raise ValueError(f"native_matmuls is an option of the native CPU backend ('cpu'), not of {name!r}")
        return XlaBackend(name, mesh=mesh, **options)
    raise ValueError(f"backend must be one of {NAMES}, got {name!r}")


def prebuild(name: str | Backend | None = None, *, quantized_weights: bool = False,
             quantized_kv: bool = False) -> list[threading.Thread]:
    """Start building the native kernels backend `name` will use, each on a daemon thread, so
    their C++ compilations (about 25 s one after another on a 2-core machine with an empty
    kernel cache, docs/performance.md) run beside each other and beside the checkpoint's
    loading; the backend's own `available()` calls then wait for those builds instead of
    starting them one after another. The float kernels always; the builds with the quantized
    kernels too for quantized weights (the matmul and the decoder layer) and KV pages (the
    attention). Nothing to do (no threads) for an XLA backend."""
    if isinstance(name, Backend) or (name or default_name()) != "cpu":
        return []
    from pallas_kernels.native import decoder_layer, matmul, paged_attention

    builds = [(m, False) for m in (paged_attention, matmul, decoder_layer)]
    builds += [(m, True) for m in (matmul, decoder_layer) if quantized_weights]
    builds += [(paged_attention, True)] if quantized_kv else []
    threads = [threading.Thread(target=m.available, args=(quantized,), daemon=True,
                                name=f"jserve-build-{m.__name__.rsplit('.', 1)[-1]}{'-quantized' * quantized}")
               for m, quantized in builds]
    for t in threads:
        t.start()
    return threads
