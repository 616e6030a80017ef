"""Backends: how the paged runner's steps execute (`Backend`, the runtime's one seam).

`create(name)` builds one by its `--backend` name: "native" (the native CPU kernels), "xla" (XLA
with the platform's Pallas attention kernel: Mosaic on a TPU or GPU, Pallas' interpreter on a
CPU) or "xla-reference" (XLA with the dense reference attention); None picks the platform's
(native on a CPU, XLA elsewhere). The older names, which name the attention kernel, stay as
aliases (`ALIASES`): "cpu", and "tpu", "gpu", "cpu_pallas", "reference" for that XLA kernel.
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from jserve.runtime.backends.base import Backend
from jserve.runtime.backends.native_cpu import NativeCpuBackend
from jserve.runtime.backends.xla import KERNELS as XLA_KERNELS
from jserve.runtime.backends.xla import XlaBackend

NAMES = ("native", "xla", "xla-reference")
# The older names, each naming its attention kernel: kept as aliases of the backend that runs it.
ALIASES = {"cpu": "native", "reference": "xla-reference", **{k: "xla" for k in XLA_KERNELS if k != "reference"}}

__all__ = ["ALIASES", "NAMES", "Backend", "NativeCpuBackend", "XlaBackend", "canonical_name", "create",
           "default_name", "prebuild"]


def default_name() -> str:
    """The backend for this platform: XLA with the Mosaic kernels on TPU and GPU, else native."""
    return "xla" if jax.devices()[0].platform in ("tpu", "gpu") else "native"


def canonical_name(name: str | None) -> str:
    """`name` (None: the platform's, an alias: its backend) as one of `NAMES`; ValueError naming
    an unknown one."""
    name = name or default_name()
    if name in NAMES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"backend must be one of {NAMES} (or the older {tuple(ALIASES)}), got {name!r}")


def create(name: str | Backend | None = None, *, mesh: Any = None, **options: Any) -> Backend:
    """The backend called `name` (a Backend passes through); `options` go to its constructor
    (`huge_pages`; `native_matmuls` and `int8_activations` for "native", `scan` for the XLA ones). Another backend's
    option at its default value is ignored (callers such as the Runner pass both); set to anything
    else it is a ValueError naming it."""
    if isinstance(name, Backend):
        return name
    backend = canonical_name(name)
    if backend == "native":
        if options.pop("scan", True) is not True:
            raise ValueError("scan is an option of the XLA backends; the native CPU backend ('native') runs its "
                             "layers unrolled")
        return NativeCpuBackend(mesh=mesh, **options)
    for option in ("native_matmuls", "int8_activations"):
        if options.pop(option, True) is not True:
            raise ValueError(f"{option} is an option of the native CPU backend ('native'), not of {name!r}")
    # An alias names its kernel exactly ("tpu" lowers the Mosaic TPU kernel on any host, for export).
    kernel = "reference" if backend == "xla-reference" else (name if name in XLA_KERNELS else None)
    return XlaBackend(kernel, mesh=mesh, **options)


def prebuild(name: str | Backend | None = None, *, quantized_weights: bool = False,
             quantized_kv: bool = False, lora: bool = False) -> list[threading.Thread]:
    """Start building the native kernels backend `name` will use, each on a daemon thread, so
    their C++ compilations (about 25 s one after another on a 2-core machine with an empty
    kernel cache, docs/performance.md) run beside each other and beside the checkpoint's
    loading; the backend's own `available()` calls then wait for those builds instead of
    starting them one after another. The float kernels always; the builds with the quantized
    kernels too for quantized weights (the matmul and the decoder layer) and KV pages (the
    attention); the LoRA delta's with `lora`. Nothing to do (no threads) for an XLA backend."""
    if isinstance(name, Backend) or canonical_name(name) != "native":
        return []
    from pallas_kernels.native import decoder_layer, matmul, paged_attention
    from pallas_kernels.native import lora as lora_kernel

    builds = [(m, False) for m in (paged_attention, matmul, decoder_layer, *((lora_kernel,) if lora else ()))]
    builds += [(m, True) for m in (matmul, decoder_layer) if quantized_weights]
    builds += [(paged_attention, True)] if quantized_kv else []
    threads = [threading.Thread(target=m.available, args=(True,) if quantized else (), daemon=True,
                                name=f"jserve-build-{m.__name__.rsplit('.', 1)[-1]}{'-quantized' * quantized}")
               for m, quantized in builds]
    for t in threads:
        t.start()
    return threads
