"""Ragged paged attention: one call for a mixed batch of decode rows and prefill chunks.

All rows' new tokens come flattened, `q [num_tokens, num_q_heads, head_dim]` (num_tokens a padded
bucket); row r's tokens are `q[cu_q_lens[r]:cu_q_lens[r + 1]]` and its KV length (its new tokens
included, already written into its pages) is `kv_lens[r]`, so its token i sits at position
`kv_lens[r] - q_len_r + i` and attends keys 0..position (only the last `sliding_window` of them
when set; logits `q.k * sm_scale`, then `soft_cap * tanh(logits / soft_cap)`: `common.py`'s and
`reference.py`'s definitions). Rows >= num_rows[0] are padding, and so is every token at or past
`cu_q_lens[num_rows]` (it comes out as zeros). Pages and page tables follow `ops.py`'s contract
([num_kv_heads, num_pages, page_size, head_dim]; int8 / float8_e4m3fn codes with float32 scales;
padded slots -> page 0).

Backends ("tpu", "gpu", "cpu_pallas", "cpu", "reference"): `ragged_paged_attention`'s docstring;
the device-side work list of row tiles: `tile_rows`'s.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import ragged_gpu, ragged_tpu, reference
from pallas_kernels.paged_attention.ops import (
    BACKENDS,
    FLOAT_DTYPES,
    _check,
    check_options,
    check_pages,
    paged_prefill_attention,
)

_REFERENCE_TILE = 16  # tokens per work item of the reference path


class Tiles(NamedTuple):
    """A ragged batch cut into items of `tile` tokens of one row each (see `tile_rows`)."""
    tokens: jax.Array   # int32 [items, tile]: flat token index of each item slot (clamped in range)
    q_start: jax.Array  # int32 [items]: position of the item's first token
    q_lens: jax.Array   # int32 [items]: real tokens of the item (0: an unused item)
    rows: jax.Array     # int32 [items]: the item's row (clamped in range)
    slot: jax.Array     # int32 [num_tokens]: index into [items * tile] of each token's output
    live: jax.Array     # bool [num_tokens]: the token belongs to a live row


def clip_cu(cu_q_lens, num_rows, num_tokens):
    """cu_q_lens clipped into [0, num_tokens], and each row's token count (0 past num_rows)."""
    max_rows = cu_q_lens.shape[0] - 1
    cu = jnp.clip(cu_q_lens, 0, num_tokens)
    live = jnp.arange(max_rows) < num_rows[0]
    return cu, jnp.where(live, jnp.maximum(cu[1:] - cu[:-1], 0), 0)


def max_items(num_tokens: int, max_rows: int, tile: int) -> int:
    """A static bound on the items of `tile_rows`: each live row has ceil(q_len / tile) items,
    which sums to at most T // tile + (rows with a token), and no item is empty."""
    return max(1, min(num_tokens, num_tokens // tile + min(max_rows, num_tokens)))


def tile_rows(kv_lens, cu_q_lens, num_rows, num_tokens: int, tile: int) -> Tiles:
    """Cuts every live row's new tokens into items of `tile` tokens (the last one of a row
    shorter), in row order; computed by XLA on the device.

    The work list (`tile_rows`) is built on the device by XLA from cu_q_lens / kv_lens / num_rows:
    nothing is read back to the host, and its length is a static bound
    (`min(T, T // tile + min(max_rows, T))` items for T tokens), so one compiled shape serves any mix.
    """
    max_rows = kv_lens.shape[0]
    cu, q_len = clip_cu(cu_q_lens, num_rows, num_tokens)
    count = -(-q_len // tile)
    ends = jnp.cumsum(count)
    starts = ends - count
    n = max_items(num_tokens, max_rows, tile)
    item = jnp.arange(n, dtype=jnp.int32)
    row = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)
    valid = row < max_rows
    row = jnp.minimum(row, max_rows - 1)
    first = (item - starts[row]) * tile  # the item's first token within its row
    lens = jnp.where(valid, jnp.clip(q_len[row] - first, 0, tile), 0)
    tok0 = cu[row] + first
    tokens = jnp.clip(tok0[:, None] + jnp.arange(tile, dtype=jnp.int32)[None], 0, num_tokens - 1)
    q_start = kv_lens[row] - q_len[row] + first
    # Each token's item: its row is the number of live rows ending at or before it.
    p = jnp.arange(num_tokens, dtype=jnp.int32)
    live_rows = jnp.arange(max_rows) < num_rows[0]
    tok_row = jnp.sum(live_rows[None] & (cu[None, 1:] <= p[:, None]), axis=1)
    live = (p >= cu[0]) & (p < cu[jnp.clip(num_rows[0], 0, max_rows)])
    tok_row = jnp.minimum(tok_row, max_rows - 1)
    t = p - cu[tok_row]
    slot = jnp.clip((starts[tok_row] + t // tile) * tile + t % tile, 0, n * tile - 1)
    return Tiles(tokens, q_start.astype(jnp.int32), lens.astype(jnp.int32), row, slot, live)


def untile(out_items: jax.Array, tiles: Tiles) -> jax.Array:
    """[items, tile, heads, head_dim] -> [num_tokens, heads, head_dim]; padding tokens zeros."""
    flat = out_items.reshape(-1, *out_items.shape[2:])[tiles.slot]
    return jnp.where(tiles.live[:, None, None], flat, jnp.zeros((), flat.dtype))


def _validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, *, backend,
              sm_scale, soft_cap, sliding_window, k_scales, v_scales) -> None:
    """Raises ValueError naming the bad argument (with its shape or dtype)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check("q", q, 3)
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must have a float dtype, got {q.dtype} (shape {q.shape})")
    check_pages(k_pages, v_pages, k_scales, v_scales)
    num_kv_heads, _, _, head_dim = k_pages.shape
    num_tokens, num_q_heads, q_head_dim = q.shape
    if num_tokens < 1:
        raise ValueError(f"q must have at least one token, got shape {q.shape}")
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} (shape {q.shape}) != k_pages head_dim "
                         f"{head_dim} (shape {k_pages.shape})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads (shape {q.shape}), not a multiple of "
                         f"k_pages' {num_kv_heads} KV heads (shape {k_pages.shape})")
    int32 = (jnp.dtype(jnp.int32),)
    _check("page_indices", page_indices, 2, int32)
    _check("kv_lens", kv_lens, 1, int32)
    _check("cu_q_lens", cu_q_lens, 1, int32)
    _check("num_rows", num_rows, 1, int32)
    max_rows = page_indices.shape[0]
    if max_rows < 1 or page_indices.shape[1] < 1:
        raise ValueError(f"page_indices shape {page_indices.shape} must have a row and a slot")
    if kv_lens.shape != (max_rows,):
        raise ValueError(f"kv_lens shape {kv_lens.shape} must be ({max_rows},) (page_indices "
                         f"shape {page_indices.shape})")
    if cu_q_lens.shape != (max_rows + 1,):
        raise ValueError(f"cu_q_lens shape {cu_q_lens.shape} must be ({max_rows + 1},) "
                         f"(page_indices shape {page_indices.shape})")
    if num_rows.shape != (1,):
        raise ValueError(f"num_rows shape {num_rows.shape} must be (1,)")
    check_options(sm_scale, soft_cap, sliding_window)


def _per_item(fn, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, tile, **kw):
    """Runs `fn(q_items, ..., q_start, q_lens, table)` (the per-row prefill contract) on the
    work list of `tile`-token items and puts the outputs back in token order."""
    tiles = tile_rows(kv_lens, cu_q_lens, num_rows, q.shape[0], tile)
    out = fn(q[tiles.tokens], k_pages, v_pages, tiles.q_start, tiles.q_lens,
             page_indices[tiles.rows], **kw)
    return untile(out, tiles).astype(q.dtype)


def ragged_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, *, sm_scale,
                     soft_cap=None, sliding_window=None, k_scales=None, v_scales=None):
    """The XLA reference (no validation): `reference.paged_prefill_attention_reference` on the
    work list."""
    return _per_item(reference.paged_prefill_attention_reference, q, k_pages, v_pages, kv_lens,
                     page_indices, cu_q_lens, num_rows, _REFERENCE_TILE, sm_scale=sm_scale,
                     soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
                     v_scales=v_scales)


def ragged_paged_attention_gpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, *,
                               sm_scale, soft_cap=None, sliding_window=None, k_scales=None,
                               v_scales=None, interpret: bool = False, **tuning):
    """The "gpu" path (no validation; `ragged_gpu.supports` must hold): `ragged_gpu.attend_items`
    on the work list of `ragged_gpu.tile_tokens(groups)`-token items. `interpret` runs the
    kernel in the Mosaic GPU interpreter; `tuning`: pages_per_block, splits."""
    groups = q.shape[1] // k_pages.shape[0]
    attend = functools.partial(ragged_gpu.attend_items, interpret=interpret, **tuning)
    return _per_item(attend, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows,
                     ragged_gpu.tile_tokens(groups), sm_scale=sm_scale, soft_cap=soft_cap,
                     sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)


@functools.partial(jax.jit, static_argnames=("backend", "sm_scale", "soft_cap", "sliding_window", "batch_invariant"))
def ragged_paged_attention(
    q: jax.Array,             # [num_tokens, num_q_heads, head_dim]: every row's new tokens
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,       # int32 [max_rows]: row r's KV length, its new tokens included
    page_indices: jax.Array,  # int32 [max_rows, max_pages_per_row]; padded slots -> page 0
    cu_q_lens: jax.Array,     # int32 [max_rows + 1], non-decreasing: row r's tokens' bounds
    num_rows: jax.Array,      # int32 [1]: live rows (the rest are padding)
    *,
    backend: str,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
    batch_invariant: bool = False,  # the native kernel's batch-invariant mode ("cpu" only)
) -> jax.Array:
    """Causal attention of a ragged batch of rows (decode rows and prefill chunks alike) over
    their pages; see the module docstring for the contract.

    Returns [num_tokens, num_q_heads, head_dim] in q's dtype; padding tokens are zeros.

    Backends:
    - "tpu": `ragged_tpu.py`, a Mosaic kernel over blocks of the flattened token axis.
    - "gpu": `ragged_gpu.py`, the Hopper kernel of `gpu.py` run on a device-side work list of
      (row, 64-row tile) items; dtypes / head sizes / page sizes it does not take run "reference".
    - "cpu_pallas": the TPU kernel in Pallas' generic interpreter (`interpret="generic"`: its DMAs run
      as plain copies). Pallas' TPU interpreter, which simulates every DMA and semaphore and checks
      for races, is the strict check the kernel tests run; it is far too slow to serve from
      (docs/performance.md, "Ragged attention").
    - "cpu": the same work list as "gpu" (one item per tile of `64 // groups` tokens of one row, the
      native kernel's own tile) handed to `paged_prefill_attention(..., backend="cpu")`, i.e. the
      native C++ kernel (Pallas interpret mode without a compiler). Chosen over the reference because
      the native kernel reads only a row's live pages, while the reference gathers every slot of every
      item's page table; and over the TPU interpreter, which simulates every DMA.
    - "reference": the work list (tiles of `_REFERENCE_TILE` tokens) through
      `paged_prefill_attention_reference` (pure jnp).
    """
    _validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, backend=backend,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              k_scales=k_scales, v_scales=v_scales)
    kw = dict(sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window,
              k_scales=k_scales, v_scales=v_scales)
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows)
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    groups = q.shape[1] // num_kv_heads
    if backend in ("tpu", "cpu_pallas"):
        return ragged_tpu.ragged_paged_attention_tpu(*args, interpret="generic" if backend == "cpu_pallas" else False,
                                                     **kw)
    if backend == "gpu" and ragged_gpu.supports(k_pages.dtype, head_dim, page_size):
        return ragged_paged_attention_gpu(*args, **kw)
    if batch_invariant and backend != "cpu":
        raise ValueError(f"batch_invariant ragged attention runs on the native CPU kernel ('cpu') only, "
                         f"not {backend!r}")
    if backend == "cpu":
        cpu = functools.partial(paged_prefill_attention, backend="cpu", batch_invariant=batch_invariant)
        return _per_item(cpu, *args, max(1, 64 // groups), **kw)
    return ragged_reference(*args, **kw)  # "reference", and "gpu" for what its kernel does not take
