"""Device KV pages: sizing the pool from a memory budget, allocating it, writing new K/V.

Per layer, `k_pages` and `v_pages` have shape `[num_kv_heads, num_pages, page_size, head_dim]`
(the layout of JAX's TPU paged-attention kernel). Page 0 is the null page: padded page-table
slots and padded tokens' writes point at it, and nothing ever reads it as live data.

A quantized cache ("int8", "fp8" = float8_e4m3fn) holds codes in that layout and float32 scales
`[num_kv_heads, num_pages, page_size]`, one per token and KV head, so a cache entry is
`(k_pages, v_pages, k_scales, v_scales)`; a float cache's entry is `(k_pages, v_pages)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model.config import ModelConfig
from pallas_kernels.paged_attention.common import QUANT_DTYPES, QUANT_MAX

KV_LAYOUTS = ("per_layer", "folded")  # see init_kv_pages
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}
_ALIASES = {"fp8": "float8_e4m3fn"}  # vLLM's name for the KV cache dtype
SCALE_DTYPE = jnp.float32  # of a quantized cache's scales, one per token and KV head


def _name(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {name!r} (choose one of {', '.join([*_DTYPE_BYTES, *_ALIASES])})")
    return name


def dtype_bytes(name: str) -> int:
    """Bytes of one K or V element (a code, for a quantized cache)."""
    return _DTYPE_BYTES[_name(name)]


def kv_page_dtype(name: str) -> jnp.dtype:
    """The pages' dtype for a KV dtype name ("fp8" is float8_e4m3fn)."""
    return jnp.dtype(_name(name))


def is_quantized(dtype) -> bool:
    """Whether pages of this dtype (or dtype name) hold codes with scales."""
    return jnp.dtype(_name(dtype) if isinstance(dtype, str) else dtype) in QUANT_DTYPES


def scale_bytes(name: str) -> int:
    """Bytes of scales per token, KV head and tensor (K or V): 0 for a float cache."""
    return jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(name) else 0


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
    per_token = config.kv_bytes_per_token(dtype_bytes(kv_dtype), scale_bytes(kv_dtype))
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
        where = (f"--kv-cache-bytes {kv_budget_bytes}" if kv_budget_bytes is not None else
                 f"{memory_fraction:g} (--memory-fraction) of {device_bytes / 2**30:.1f} GiB")
        raise ValueError(f"no room for KV pages: {budget / 2**20:.1f} MiB left of {where} after "
                         f"{weights / 2**20:.1f} MiB of weights and {acts / 2**20:.1f} MiB of activations "
                         f"(--max-num-batched-tokens {max_num_batched_tokens}); a page of {page_size} tokens "
                         f"needs {per_token * page_size / 2**20:.2f} MiB. Raise --memory-fraction or "
                         "--kv-cache-bytes, lower --max-num-batched-tokens, shrink the pages with "
                         "--kv-cache-dtype bfloat16 / int8 / fp8 or the weights with --quantization, or shard "
                         "them over more devices (--mesh tp=N, -tp N)")
    return MemoryPlan(device_bytes=int(device_bytes), usable_bytes=int(usable), weight_bytes=int(weights),
                      activation_bytes=int(acts), kv_bytes_per_token=per_token, page_size=page_size,
                      num_pages=int(budget // (per_token * page_size)), context=context)


def device_memory_bytes(device: Any | None = None) -> int | None:
    """The accelerator's memory limit, or None where JAX does not report one (CPU)."""
    device = device or jax.local_devices()[0]  # another process's devices report no memory
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def init_kv_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16,
                  sharding: Any = None, *, layout: str = "per_layer", local_pages: int | None = None) -> Any:
    """Zeroed pages: one (k_pages, v_pages) pair per layer, each [num_kv_heads, num_pages,
    page_size, head_dim] (`layout` "per_layer"), or one pair for all layers, [num_kv_heads,
    num_layers * num_pages, page_size, head_dim] ("folded", see
    `jserve.runtime.paged_attention.PagedAttention`).

    `dtype` int8 or float8_e4m3fn (or "int8" / "fp8"): each entry is (k_pages, v_pages, k_scales,
    v_scales), the scales float32 [num_kv_heads, pages, page_size] (the pages' first three dims),
    laid out as the pages (a `NamedSharding`'s spec without its head_dim entry).

    `local_pages` (hybrid pages, `jserve.core.hybrid_pages`): each sliding layer has this many
    pages instead of `num_pages` (folded: the layers' blocks, each of its kind's size, in order)."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    if local_pages is not None and local_pages < 2:
        raise ValueError(f"local_pages must be >= 2 (page 0 is the null page), got {local_pages}")
    folded = layout == "folded"
    per_layer = [local_pages if local_pages is not None and config.layer_is_sliding(i) else num_pages
                 for i in range(config.num_layers)]
    dtype = kv_page_dtype(dtype) if isinstance(dtype, str) else jnp.dtype(dtype)
    quantized = is_quantized(dtype)

    def zeros(shape, dtype, sharding):
        return jnp.zeros(shape, dtype, device=sharding) if sharding is not None else jnp.zeros(shape, dtype)

    def entry(pages):
        shape = (config.num_kv_heads, pages, page_size, config.head_dim)
        kv = (zeros(shape, dtype, sharding), zeros(shape, dtype, sharding))
        if not quantized:
            return kv
        sharding3 = scale_sharding(sharding)
        return kv + (zeros(shape[:3], SCALE_DTYPE, sharding3), zeros(shape[:3], SCALE_DTYPE, sharding3))

    if folded:
        return entry(sum(per_layer))
    return tuple(entry(pages) for pages in per_layer)


def scale_sharding(sharding: Any) -> Any:
    """The scales' sharding for pages laid out by `sharding`: a NamedSharding loses its head_dim
    entry; any other (one device) stays as it is."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[:3]))
    return sharding


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of rows x [..., head_dim] for int8 or float8_e4m3fn pages.

    Per row: scale = amax(|x|) / Q (Q = 127 for int8, 448 for float8_e4m3fn, each dtype's largest
    code), codes = x / scale rounded to the nearest code (saturating at +-Q); an all-zero row
    gets scale 0 and zero codes. So `codes * scale` is within scale / 2 of x for int8, and
    within |x| / 16 (3 mantissa bits) or, below the smallest normal, scale / 1024 for float8.
    Returns (codes [..., head_dim], float32 scales [...]).
    """
    dtype = jnp.dtype(dtype)
    qmax = QUANT_MAX[dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = amax / qmax
    inv = jnp.where(amax > 0, qmax / jnp.where(amax > 0, amax, 1.0), 0.0)
    y = jnp.clip(x * inv[..., None], -qmax, qmax)
    if dtype == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    return y.astype(dtype), scale.astype(SCALE_DTYPE)


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
             k_scales: jax.Array | None = None, v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Scatter new K/V into their page slots (use inside a jit that donates the pages).

    Takes a cache entry's arrays and returns the entry in the same form: `(k_pages, v_pages)`
    for float pages (K/V cast to their dtype); for int8 / float8_e4m3fn pages, pass the entry's
    scales and get `(k_pages, v_pages, k_scales, v_scales)`, each new token's K and V quantized
    per KV head (`quantize_kv`).

    Args:
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim].
      k, v: [tokens, num_kv_heads, head_dim].
      slots: int32 [tokens], `page * page_size + offset`; padded tokens point into page 0.
      k_scales, v_scales: float32 [num_kv_heads, num_pages, page_size], with quantized pages only.
    """
    K, P, S, D = k_pages.shape
    quantized = is_quantized(k_pages.dtype)
    if quantized != (k_scales is not None and v_scales is not None):
        raise ValueError(f"{k_pages.dtype} pages {'need' if quantized else 'take no'} k_scales and v_scales")

    def write(pages, new):
        flat = pages.reshape(K, P * S, *pages.shape[3:])
        flat = flat.at[:, slots].set(jnp.moveaxis(new, 0, 1).astype(pages.dtype), mode="promise_in_bounds")
        return flat.reshape(pages.shape)

    if not quantized:
        return write(k_pages, k), write(v_pages, v)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    return write(k_pages, k_codes), write(v_pages, v_codes), write(k_scales, k_scale), write(v_scales, v_scale)


def slot_mapping(page_ids: list[int], start: int, count: int, page_size: int) -> np.ndarray:
    """Slots of tokens `start .. start+count-1` of a sequence whose pages are `page_ids`."""
    pos = np.arange(start, start + count)
    pages = np.asarray(page_ids, np.int64)[pos // page_size]
    return (pages * page_size + pos % page_size).astype(np.int32)
