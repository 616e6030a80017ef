"""Device KV pages: sizing the pool from a memory budget, allocating it, writing new K/V.

Per layer, `k_pages` and `v_pages` have shape `[num_kv_heads, num_pages, page_size, head_dim]`
(the layout of JAX's TPU paged-attention kernel). Page 0 is the null page: padded page-table
slots and padded tokens' writes point at it, and nothing ever reads it as live data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig

KV_LAYOUTS = ("per_layer", "folded")  # see init_kv_pages
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


def dtype_bytes(name: str) -> int:
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {name!r} (choose one of {', '.join(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a device's memory splits between weights, activations and KV pages."""

    device_bytes: int
    usable_bytes: int  # device_bytes * memory_fraction (or the explicit KV budget + the rest)
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    page_size: int
    num_pages: int  # including the null page
    context: int

    @property
    def kv_bytes_per_page(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_page * self.num_pages

    @property
    def pages_per_sequence(self) -> int:
        return math.ceil(self.context / self.page_size)

    @property
    def max_sequences(self) -> int:
        """Sequences of the full context that fit at once (the null page excluded)."""
        return max(self.num_pages - 1, 0) // self.pages_per_sequence


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int) -> int:
    """A generous bound on one step's live activations: hidden, MLP and float32 logits per token."""
    per_token = 4 * (4 * config.hidden_size + 2 * config.intermediate_size + 2 * config.vocab_size)
    return per_token * max_num_batched_tokens


def plan_memory(config: ModelConfig, *, weight_dtype_bytes: int, kv_dtype: str = "bfloat16",
                page_size: int = 16, context: int = 8192, device_bytes: int | None = None,
                memory_fraction: float = 0.9, kv_budget_bytes: int | None = None,
                max_num_batched_tokens: int = 2048, weight_bytes: int | None = None) -> MemoryPlan:
    """Size the page pool.

    Either `kv_budget_bytes` (an explicit byte count, the usual choice on CPU) or
    `device_bytes * memory_fraction - weights - activations` goes to KV pages.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    weights = weight_bytes if weight_bytes is not None else config.num_params() * weight_dtype_bytes
    acts = activation_bytes(config, max_num_batched_tokens)
    per_token = config.kv_bytes_per_token(dtype_bytes(kv_dtype))
    if kv_budget_bytes is not None:
        budget = kv_budget_bytes
        device_bytes = device_bytes or budget + weights + acts
        usable = budget + weights + acts
    else:
        if device_bytes is None:
            raise ValueError("give device_bytes (the device's memory) or kv_budget_bytes")
        usable = int(device_bytes * memory_fraction)
        budget = usable - weights - acts
    if budget < 2 * per_token * page_size:
        raise ValueError(f"no room for KV pages: {budget / 2**20:.1f} MiB left after "
                         f"{weights / 2**20:.1f} MiB of weights and {acts / 2**20:.1f} MiB of activations")
    return MemoryPlan(device_bytes=int(device_bytes), usable_bytes=int(usable), weight_bytes=int(weights),
                      activation_bytes=int(acts), kv_bytes_per_token=per_token, page_size=page_size,
                      num_pages=int(budget // (per_token * page_size)), context=context)


def device_memory_bytes(device: Any | None = None) -> int | None:
    """The accelerator's memory limit, or None where JAX does not report one (CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def init_kv_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16,
                  sharding: Any = None, *, layout: str = "per_layer") -> Any:
    """Zeroed pages: one (k_pages, v_pages) pair per layer, each [num_kv_heads, num_pages,
    page_size, head_dim] (`layout` "per_layer"), or one pair for all layers, [num_kv_heads,
    num_layers * num_pages, page_size, head_dim] ("folded", see
    `jserve.runtime.paged_attention.PagedAttention`)."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    folded = layout == "folded"
    pages = num_pages * (config.num_layers if folded else 1)
    shape = (config.num_kv_heads, pages, page_size, config.head_dim)

    def zeros():
        return jnp.zeros(shape, dtype, device=sharding) if sharding is not None else jnp.zeros(shape, dtype)

    if folded:
        return (zeros(), zeros())
    return tuple((zeros(), zeros()) for _ in range(config.num_layers))


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V into their page slots (use inside a jit that donates the pages).

    Args:
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim].
      k, v: [tokens, num_kv_heads, head_dim].
      slots: int32 [tokens], `page * page_size + offset`; padded tokens point into page 0.
    """
    K, P, S, D = k_pages.shape

    def write(pages, new):
        flat = pages.reshape(K, P * S, D)
        flat = flat.at[:, slots].set(new.transpose(1, 0, 2).astype(pages.dtype), mode="promise_in_bounds")
        return flat.reshape(K, P, S, D)

    return write(k_pages, k), write(v_pages, v)


def slot_mapping(page_ids: list[int], start: int, count: int, page_size: int) -> np.ndarray:
    """Slots of tokens `start .. start+count-1` of a sequence whose pages are `page_ids`."""
    pos = np.arange(start, start + count)
    pages = np.asarray(page_ids, np.int64)[pos // page_size]
    return (pages * page_size + pos % page_size).astype(np.int32)
