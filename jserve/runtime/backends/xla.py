"""The XLA backend: TPU, GPU, and a CPU without the native kernels.

Every operation is an XLA op except attention, which runs the platform's paged-attention kernel
(`pallas_kernels.paged_attention`: Mosaic TPU, Mosaic GPU, Pallas interpret mode on a CPU, or the
XLA reference). The layer stack is `jax.lax.scan` over stacked weights (the checkpoint's layout),
so a step compiles one layer whatever the depth. The KV cache is folded: one `(k, v)` pair for
all layers, layer i's pages at offset `i * num_pages`, so the scan carries the cache whole and a
layer's write and reads touch only its pages, in place (no layer's pages are sliced out or
copied: tests/test_backends.py checks the compiled HLO).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax

from jserve.model.config import ModelConfig
from jserve.model.llama import XlaOps
from jserve.runtime.backends.base import EIGEN_DOTS, Backend
from jserve.runtime.paged_attention import PagedAttention
from pallas_kernels.paged_attention import gpu as gpu_kernel

logger = logging.getLogger(__name__)

KERNELS = ("tpu", "gpu", "reference", "cpu_pallas")
# Prefill of one row on the interpret kernel compiles with XLA's Eigen dots (base.EIGEN_DOTS).


def platform_kernel() -> str:
    """The attention kernel for this machine's platform: Mosaic TPU, Mosaic GPU, else interpret."""
    return {"tpu": "tpu", "gpu": "gpu"}.get(jax.devices()[0].platform, "cpu_pallas")


class XlaBackend(Backend):
    """XLA ops, a scanned layer stack over folded KV pages, the platform's attention kernel.

    Args:
      scan: run the stack as `jax.lax.scan` (default); False unrolls it over the same folded
        pages (one traced layer each), for comparisons.
    """

    param_layout = "stacked"
    kv_layout = "folded"
    default_page_size = 16  # vLLM's

    def __init__(self, kernel: str | None = None, *, mesh: Any = None, huge_pages: bool = True,
                 scan: bool = True, batch_invariant: bool = False):
        kernel = kernel or platform_kernel()
        if kernel not in KERNELS:
            raise ValueError(f"the XLA backend's attention kernel must be one of {KERNELS}, got {kernel!r}")
        if batch_invariant:
            raise ValueError("batch_invariant: the XLA backends do not have a batch-invariant mode yet (XLA's dots "
                             "and the TPU / GPU attention kernels pick their reduction order by the step's shape); "
                             "it runs on the native CPU backend (--backend native)")
        super().__init__(kernel, mesh=mesh, huge_pages=huge_pages)
        self.name = "xla-reference" if kernel == "reference" else "xla"
        self.scan = scan
        if not scan:
            self.param_layout = "list"

    def check(self, config: ModelConfig, kv_dtype: Any, page_size: int) -> None:
        if self.kernel == "gpu" and not gpu_kernel.supports(kv_dtype, config.head_dim, page_size):
            logger.warning("the Mosaic GPU attention kernel needs a bfloat16 or float16 KV cache, "
                           "head_dim a multiple of 64 and page_size a multiple of 8 (got %s, %d, "
                           "%d): attention runs the slower XLA gather path; try "
                           "kv_cache_dtype='bfloat16'", kv_dtype, config.head_dim, page_size)

    def batch_buckets(self, buckets: Sequence[int]) -> tuple[int, ...]:
        # Batch 1 is not worth its own compiled shape on these kernels (batch 2 serves it).
        if 1 in buckets and len(buckets) > 1:
            return tuple(b for b in buckets if b != 1)
        return tuple(buckets)

    def ops(self, config: ModelConfig) -> XlaOps:
        attention = PagedAttention(self.kernel, config.sliding_window, self.mesh, self.kv_layout,
                                   config.num_layers)
        # MoE layers: ragged_dot where the platform has a grouped matmul (TPU, GPU); XLA:CPU lowers it
        # to a dense dot over every expert, so a CPU gathers the selected experts' weights (jserve.model.moe).
        grouped = "ragged_dot" if self.kernel in ("tpu", "gpu") else "gather"
        return XlaOps(attention, scan=self.scan, grouped_matmul=grouped, mesh=self.mesh)

    def compiler_options(self, rows: int, tokens: int) -> dict[str, str] | None:
        return EIGEN_DOTS if self.kernel == "cpu_pallas" and tokens > 1 and rows == 1 else None
