"""GPU paged-attention kernel (Mosaic GPU, Hopper): TMA page copies into a multi-stage
shared-memory pipeline, wgmma for both matmuls, online softmax in registers. This module is the
host side (what the kernel takes, block sizes, shared-memory budget, key splits, the inputs'
layout, the launch and the merge of splits); `gpu_block.py` is the kernel's body.

Supports bfloat16 and float16 K/V, and quantized K/V (int8 or float8_e4m3fn codes with float32
scales, one per token and KV head), with head_dim a multiple of 64 (`supports`); `ops.py` sends
anything else to the XLA reference path.

`gpu_block.kernel`'s docstring gives the grid, the pipeline, the key splits and how quantized
pages reach wgmma. See docs/architecture.md, "The backend seam".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import gpu_block
from pallas_kernels.paged_attention.gpu_block import BLOCK_ROWS, MASK, META

DEFAULT_BLOCK_KEYS = 64  # keys per pipeline stage (pages_per_block * page_size)
_SMEM_PER_CORE = 233472  # bytes of shared memory per multiprocessor on Hopper (228 KiB)
MAX_SMEM = 232448        # the most one CUDA block may use (227 KiB)


FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # codes, with float32 scales


def supports(dtype, head_dim: int, page_size: int) -> bool:
    """Whether the Mosaic kernel handles K/V of this dtype (16-bit floats, or int8 /
    float8_e4m3fn codes), head size and page size (pages are copied into 8-row shared-memory
    tiles of 64 columns, or 64-128 one-byte columns for codes)."""
    return (jnp.dtype(dtype) in FLOAT_DTYPES + QUANT_DTYPES
            and head_dim % 64 == 0 and page_size % 8 == 0)


def compute_dtype(q_dtype, kv_dtype) -> jnp.dtype:
    """The matmuls' operand dtype: the pages' for 16-bit pages; for codes, the query's when it
    is 16-bit, else bfloat16."""
    if jnp.dtype(kv_dtype) not in QUANT_DTYPES:
        return jnp.dtype(kv_dtype)
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in FLOAT_DTYPES else jnp.dtype(jnp.bfloat16)


def _transforms(itemsize: int, head_dim: int):
    """Shared-memory tiling of a [rows, head_dim] block: 8-row tiles whose 64 (16-bit) or 64-128
    (one-byte) columns fill one swizzle span of as many bytes."""
    cols = 64 if itemsize == 2 else math.gcd(128, head_dim)
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(cols * itemsize))


def fit_pages_per_block(pages_per_block: int, page_size: int, head_dim: int, max_pages: int,
                        dtype, stages: int = 2) -> int:
    """`pages_per_block` rounded up to whole 64-key tiles (wgmma's K for P.V), then lowered
    a tile at a time until `stages` blocks of K and V fit in shared memory."""
    step = 64 // math.gcd(64, page_size)
    pages = -(-pages_per_block // step) * step
    itemsize, width = jnp.dtype(dtype).itemsize, _meta_width(max_pages)
    quantized = jnp.dtype(dtype) in QUANT_DTYPES
    while pages > step and smem_bytes(head_dim, pages * page_size, stages, width,
                                      itemsize, quantized) > MAX_SMEM:
        pages -= step
    return pages


def _meta_width(max_pages: int) -> int:
    """int32 columns per page-table row: q_start, q_len, 0, 0, then the pages, padded to a
    multiple of 32 (a copy moves a multiple of 128 bytes: one 4-byte share per thread)."""
    return -(-(META + max_pages) // 32) * 32


def _combine(out, lse):
    """Merge key splits: out [batch, kv_heads, splits, rows, head_dim], lse [..., splits, rows]
    -> [batch, kv_heads, rows, head_dim] (float32 arithmetic; all-empty rows stay zeros)."""
    weight = jnp.exp2(lse - lse.max(axis=2, keepdims=True))
    weight = jnp.where(lse > MASK / 2, weight, 0.0)
    total = weight.sum(axis=2)
    merged = (out.astype(jnp.float32) * weight[..., None]).sum(axis=2)
    return (merged / jnp.where(total > 0, total, 1.0)[..., None]).astype(out.dtype)


def smem_bytes(head_dim: int, block_len: int, stages: int, width: int, itemsize: int,
               quantized: bool = False) -> int:
    """Shared memory one CUDA block allocates: q, `stages` K and V blocks, page table, lse; with
    quantized pages (`itemsize` 1) also each stage's K and V scales and one 16-bit K and V block."""
    if not quantized:
        return ((BLOCK_ROWS + 2 * stages * block_len) * head_dim * itemsize + 4 * width
                + 4 * BLOCK_ROWS)
    return ((BLOCK_ROWS + 2 * block_len) * head_dim * 2 + 2 * stages * block_len * head_dim
            * itemsize + 2 * stages * block_len * 4 + 4 * width + 4 * BLOCK_ROWS)


def default_splits(ctas: int, max_blocks: int, smem: int) -> int:
    """Key splits: the most that keep the grid within one wave of resident CUDA blocks.

    On an H200, decode was fastest when `ctas * splits` came closest to, without passing, the
    blocks the multiprocessors hold at once (two per SM at 80 KiB of shared memory, head_dim
    128): a second, partial wave costs more than the extra splits gain (docs/performance.md,
    "Paged attention on an NVIDIA H200"). Each split keeps at least two key blocks.
    """
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    per_core = max(1, min(4, _SMEM_PER_CORE // (smem + 1024)))  # 1 KiB reserved per block
    return max(1, min((cores * per_core) // ctas, max_blocks // 2, 16))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "groups",
                                             "pages_per_block", "stages", "splits", "interpret"))
def paged_attention_rows(
    q: jax.Array,             # [batch, num_kv_heads, rows, head_dim] (common.pack_rows)
    k_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,       # [num_kv_heads, num_pages, page_size, head_dim]
    q_start: jax.Array,       # int32[batch]
    q_lens: jax.Array,        # int32[batch]
    page_indices: jax.Array,  # int32[batch, max_pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
    stages: int = 2,
    splits: int | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # f32 [num_kv_heads, num_pages, page_size]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Runs the Mosaic GPU kernel; returns [batch, num_kv_heads, rows, head_dim] in the K/V
    dtype (q is cast to it), or for int8 / float8_e4m3fn pages (with `k_scales`, `v_scales`) in
    `compute_dtype` (q's when 16-bit, else bfloat16).

    `pages_per_block * page_size` keys per pipeline stage must be a multiple of 64 (wgmma's
    K for the P.V product); `stages` blocks are in flight per CUDA block (2 is the fastest
    on an H200, docs/performance.md: at 80 KiB of shared memory per block, two blocks share a
    multiprocessor). `splits` divides each row's keys among that many CUDA blocks, merged
    afterwards (flash-decoding; default `default_splits`: only when batch x KV heads is too small
    to fill the GPU). Raises ValueError when the blocks do not fit in shared memory.
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    _, _, page_size, _ = k_pages.shape
    max_pages = page_indices.shape[1]
    quantized = _check_pages(k_pages.dtype, k_scales, v_scales, pages_per_block, page_size)
    dtype = compute_dtype(q.dtype, k_pages.dtype)  # of q, the matmul operands and the output
    padded_rows = pl.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS
    q = jnp.pad(q.astype(dtype), ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    width = _meta_width(max_pages)  # one int32 row per batch row: q_start, q_len, 0, 0, pages
    meta = jnp.zeros((batch, width), jnp.int32)
    meta = meta.at[:, 0].set(q_start).at[:, 1].set(q_lens)
    meta = meta.at[:, META:META + max_pages].set(page_indices)
    block_len = pages_per_block * page_size
    smem = smem_bytes(head_dim, block_len, stages, width, k_pages.dtype.itemsize, quantized)
    if smem > MAX_SMEM:
        raise ValueError(f"pages_per_block={pages_per_block} x page_size={page_size} keys with "
                         f"stages={stages} and head_dim={head_dim} need {smem} bytes of shared "
                         f"memory, over the {MAX_SMEM} a CUDA block may use")
    if splits is None:
        splits = default_splits(batch * num_kv_heads * (padded_rows // BLOCK_ROWS),
                                pl.cdiv(max_pages * page_size, block_len), smem)
    scales = _scales_in_key_order(k_scales, v_scales, page_indices, pages_per_block) if quantized else ()
    kernel = functools.partial(
        gpu_block.kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        groups=groups, pages_per_block=pages_per_block, max_pages=max_pages, stages=stages,
        splits=splits, interpret=interpret)
    out, lse = _launch(kernel, meta, q, k_pages, v_pages, scales, splits=splits, stages=stages,
                       pages_per_block=pages_per_block, interpret=interpret)
    out = out[:, :, 0] if splits == 1 else _combine(out, lse)
    return out[:, :, :rows]


def _check_pages(kv_dtype, k_scales, v_scales, pages_per_block: int, page_size: int) -> bool:
    """Whether the pages are quantized; ValueError for a key block wgmma cannot take or scales
    that do not go with the pages."""
    if (pages_per_block * page_size) % 64:
        raise ValueError(f"pages_per_block * page_size = {pages_per_block} * {page_size} "
                         "must be a multiple of 64")
    quantized = kv_dtype in QUANT_DTYPES
    if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError(f"{kv_dtype} pages {'need' if quantized else 'take no'} "
                         "k_scales and v_scales")
    return quantized


def _scales_in_key_order(k_scales, v_scales, page_indices, pages_per_block: int):
    """Each row's scales in key order, padded to whole blocks: [batch, num_kv_heads, keys]."""
    batch, max_pages = page_indices.shape
    blocks = pl.cdiv(max_pages, pages_per_block)
    table = jnp.pad(page_indices, ((0, 0), (0, blocks * pages_per_block - max_pages)))
    return tuple(x[:, table].transpose(1, 0, 2, 3).reshape(batch, x.shape[0], -1)
                 for x in (k_scales, v_scales))


def _launch(kernel, meta, q, k_pages, v_pages, scales, *, splits: int, stages: int,
            pages_per_block: int, interpret: bool):
    """Runs `gpu_block.kernel` on its grid: its outputs (per split: rows and their log-sum-exp)
    and its shared-memory scratch and barriers, in the kernel's order."""
    batch, num_kv_heads, padded_rows, head_dim = q.shape
    dtype, kv_dtype, quantized = q.dtype, k_pages.dtype, bool(scales)
    block_len = pages_per_block * k_pages.shape[2]
    transforms = _transforms(2, head_dim)  # 16-bit blocks: 64-element rows, 128-byte swizzle
    kv_transforms = _transforms(kv_dtype.itemsize, head_dim)
    scale_scratch = []
    if quantized:
        scale_scratch = [plgpu.SMEM((stages, block_len), jnp.float32),
                         plgpu.SMEM((stages, block_len), jnp.float32),
                         plgpu.SMEM((block_len, head_dim), dtype, transforms=transforms),
                         plgpu.SMEM((block_len, head_dim), dtype, transforms=transforms)]
    arrivals = pages_per_block + quantized  # one per copy: a stage's pages (and, quantized, its scales)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((batch, num_kv_heads, splits, padded_rows, head_dim), dtype),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, splits, padded_rows), jnp.float32)),
        grid=(batch, num_kv_heads, padded_rows // BLOCK_ROWS * splits),
        grid_names=("b", "h", "r"),
        scratch_types=[
            plgpu.SMEM((BLOCK_ROWS, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((stages, block_len, head_dim), kv_dtype, transforms=kv_transforms),
            plgpu.SMEM((stages, block_len, head_dim), kv_dtype, transforms=kv_transforms),
            plgpu.SMEM((meta.shape[1],), jnp.int32),
            plgpu.SMEM((BLOCK_ROWS,), jnp.float32),
            *scale_scratch,
            plgpu.Barrier(),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(meta, q, k_pages, v_pages, *scales)
