"""Ragged paged attention on a Hopper GPU: `gpu.py`'s Mosaic GPU kernel on a device-side work list.

NOT RUN ON A DEVICE: this path has been checked only on CPU, by the Mosaic GPU interpreter
(`interpret=True`: the same kernel with its two matmuls in jnp instead of wgmma) and by lowering
for CUDA with `jax.export`; `scripts/bench_ragged_attention.py --backend gpu` is the check to run
on an H100/H200.

`attend_items`'s docstring gives the schedule: XLA cuts the ragged batch into one-row items of
`64 // groups` tokens, each one 64-row wgmma block of `gpu.paged_attention_rows`.
"""

from __future__ import annotations

import jax

from pallas_kernels.paged_attention import gpu
from pallas_kernels.paged_attention.common import pack_rows, unpack_rows

supports = gpu.supports  # dtypes, head sizes and page sizes the kernel takes (else: the reference)


def tile_tokens(groups: int) -> int:
    """Tokens per work item: the most whose packed rows fit one 64-row wgmma block."""
    return max(1, gpu.BLOCK_ROWS // groups)


def attend_items(q_items, k_pages, v_pages, q_start, q_lens, table, *, sm_scale: float,
                 soft_cap: float | None, sliding_window: int | None,
                 k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                 pages_per_block: int | None = None, splits: int | None = None,
                 interpret: bool = False) -> jax.Array:
    """The Mosaic GPU kernel on work items: q_items [items, tile_tokens(groups), heads, head_dim],
    each a row's tokens from position q_start (q_lens real ones) over its page-table row `table`
    (`supports(k_pages.dtype, head_dim, page_size)` must hold). Returns q_items' shape, in
    `gpu.compute_dtype`; `ragged.ragged_paged_attention_gpu` builds the items and reorders.

    Schedule: the ragged batch is cut by XLA, on the device, into items of `64 // groups` tokens of
    one row each (`ragged.tile_rows`): one item's packed query rows (tokens x the `groups` query heads
    of a KV head) are one 64-row wgmma block, `gpu.py`'s BLOCK_ROWS. The items become the batch of
    `gpu.paged_attention_rows` (grid `(items, num_kv_heads, splits)`): each CUDA block TMA-copies its
    item's pages, only those in the item's causal / sliding-window key range, into a two-stage
    shared-memory pipeline and runs wgmma on them, with flash-decoding key splits when items x KV
    heads cannot fill the GPU. So a decode row costs one 64-row block (as in `gpu.py`'s decode, where
    wgmma's M of 64 is the floor) and reads each of its pages once per KV head; a prefill chunk of n
    tokens is ceil(n / (64 // groups)) blocks, each reading only the pages up to its last token.
    Unused items (the static bound exceeds the live count) have q_len 0 and exit after their metadata.

    The gather of the queries into items ([items, 64 // groups, heads, head_dim]) and of the outputs
    back to token order are XLA ops around the kernel; so is the page-table row per item and, for
    int8 / fp8 pages, each item's scales in key order (`gpu.py` gathers them per batch row). A fused
    kernel that TMA-copies each item's queries straight from the flattened token axis would save
    those copies; it is not written, because this kernel is the one that has run on an H200.
    """
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    groups = q_items.shape[2] // num_kv_heads
    if pages_per_block is None:
        pages_per_block = max(1, gpu.DEFAULT_BLOCK_KEYS // page_size)
    pages_per_block = gpu.fit_pages_per_block(pages_per_block, page_size, head_dim, table.shape[1],
                                              k_pages.dtype)
    scales = {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)
    out = gpu.paged_attention_rows(pack_rows(q_items, num_kv_heads), k_pages, v_pages, q_start,
                                   q_lens, table, sm_scale=float(sm_scale), soft_cap=soft_cap,
                                   sliding_window=sliding_window, groups=groups,
                                   pages_per_block=pages_per_block, splits=splits,
                                   interpret=interpret, **scales)
    return unpack_rows(out, q_items.shape[1])
