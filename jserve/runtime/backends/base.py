"""The backend interface: one object per execution strategy, the runtime's only seam.

A backend decides everything about how the model's computation runs on a machine: the KV
page size and layout, how the checkpoint's weights are prepared (layout, packing, huge
pages), the model's operations (`jserve.model.ModelOps`: linears, embedding, head, attention,
the layer stack) and the jit options of each step shape. The runner and the engine call these
methods and never branch on a backend or platform name (see docs/architecture.md).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

from jserve.model import ModelOps, model_params, params_layout
from jserve.model.config import ModelConfig
from jserve.runtime.huge_pages import Advice as HugePagesAdvice
from jserve.runtime.kv_cache import init_kv_pages

# XLA:CPU's Eigen dots instead of its default (YNNPACK) for a step shape: some CPU steps run faster
# with them (each backend says which; docs/performance.md has the measurements).
EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}


class Backend(abc.ABC):
    """How the paged runner's steps execute.

    Args:
      kernel: the paged-attention kernel (`pallas_kernels.paged_attention.BACKENDS`).
      mesh: a ('dp', 'tp') `jax.sharding.Mesh`, or None for one device.
      huge_pages: back CPU weights and KV pages with transparent huge pages where the OS allows.
      batch_invariant: every token's outputs bitwise the same whatever else its step holds
        (`EngineConfig.batch_invariant`); a backend that cannot says so with a ValueError.
    """

    name: str  # what `--backend` calls it (`backends.NAMES`)
    param_layout: str  # "list" or "stacked" (`jserve.model.LAYOUTS`)
    kv_layout: str  # "per_layer" or "folded" (`jserve.runtime.kv_cache.KV_LAYOUTS`)
    default_page_size: int  # tokens per KV page when the user gives none

    def __init__(self, kernel: str, *, mesh: Any = None, huge_pages: bool = True, batch_invariant: bool = False):
        self.kernel = kernel
        self.mesh = mesh
        self.huge_pages = huge_pages
        self.batch_invariant = batch_invariant

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel!r})"

    @property
    def speculative_batch_limit(self) -> int | None:
        """Decoding sequences above which a step does not speculate, unless the speculative
        config says (`disable_by_batch_size`): 4 where the steps run on a CPU (the verify step
        costs 1.5x a decode step at batch 4, 2.2x at 8: scripts/bench_speculative.py,
        docs/performance.md); None (no limit, as vLLM) on TPU and GPU, where a step stays
        bandwidth-bound to far larger batches (not measured here yet)."""
        return None if self.kernel in ("tpu", "gpu") else 4

    # ---------------------------------------------------------------------------- set-up

    def check(self, config: ModelConfig, kv_dtype: Any, page_size: int) -> None:
        """Warn (log) where this configuration runs a slower path than the backend's best."""

    def batch_buckets(self, buckets: Sequence[int]) -> tuple[int, ...]:
        """The decode batch buckets this backend compiles, from the engine's."""
        return tuple(buckets)

    def prepare_params(self, config: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint weights (stacked per-layer arrays) or a model state in this backend's layout
        -> the model state the steps take (`nnx.merge` with `model_graphdef(config, layout)`)."""
        if "layers" in params:
            if params_layout(params) != self.param_layout:
                raise ValueError(f"{self} takes {self.param_layout!r} params, got {params_layout(params)!r}")
            return params
        return model_params(config, params, self.param_layout)

    def init_kv(self, config: ModelConfig, num_pages: int, page_size: int, dtype: Any, sharding: Any, *,
                local_pages: int | None = None) -> Any:
        """Zeroed KV pages in this backend's layout (`num_pages` per layer, page 0 the null page;
        `local_pages` per sliding layer with hybrid pages)."""
        return init_kv_pages(config, num_pages, page_size, dtype, sharding, layout=self.kv_layout,
                             local_pages=local_pages)

    def advise_memory(self, tree: Any) -> HugePagesAdvice:
        """Ask for huge pages under the CPU buffers of `tree`, in the background."""
        return HugePagesAdvice(tree if self.huge_pages else ())

    # ---------------------------------------------------------------------------- steps

    @abc.abstractmethod
    def ops(self, config: ModelConfig) -> ModelOps:
        """The model's operations over params from `prepare_params` and pages from `init_kv`."""

    def compiler_options(self, rows: int, tokens: int) -> dict[str, str] | None:
        """XLA compiler options for the step of `rows` rows (per data-parallel group) x `tokens`."""
        return None

    def describe(self) -> dict[str, Any]:
        """What the backend chose, for logs and tests."""
        return {"backend": self.name, "kernel": self.kernel, "param_layout": self.param_layout,
                "kv_layout": self.kv_layout}
