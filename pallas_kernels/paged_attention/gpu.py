"""GPU paged-attention kernel (Mosaic GPU, Hopper): TMA page copies into a multi-stage
shared-memory pipeline, wgmma for both matmuls, online softmax in registers.

Supports bfloat16 and float16 K/V, and quantized K/V (int8 or float8_e4m3fn codes with float32
scales, one per token and KV head), with head_dim a multiple of 64 (`supports`); `ops.py` sends
anything else to the XLA reference path.

`_kernel`'s docstring gives the grid, the pipeline, the key splits and how quantized pages reach
wgmma. See docs/architecture.md, "The backend seam".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_ROWS = 64          # wgmma's M: packed query rows per CUDA block
DEFAULT_BLOCK_KEYS = 64  # keys per pipeline stage (pages_per_block * page_size)
_META = 4                # int32 columns in front of each page-table row: q_start, q_len, 0, 0
_MASK = -1e30            # finite: exp2(MASK - m) underflows to 0 without inf - inf
_LOG2E = math.log2(math.e)
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
    return -(-(_META + max_pages) // 32) * 32


def _kernel(meta_ref, q_ref, k_ref, v_ref, *refs, quantized: bool, sm_scale: float,
            soft_cap: float | None, sliding_window: int | None, groups: int,
            pages_per_block: int, max_pages: int, stages: int, splits: int, interpret: bool):
    # refs: quantized: ks_ref, vs_ref (f32 [batch, kv_heads, keys]: each row's scales in key
    # order); o_ref, lse_ref; q_smem, k_smem, v_smem, meta_smem, lse_smem; quantized: ks_smem,
    # vs_smem (f32 [stages, block_len]), k_wide, v_wide (the current block's K and V widened to
    # q's dtype); then q_bar, meta_bar, k_bars, v_bars.
    """Grid `(batch, num_kv_heads, row_blocks x splits)`: each CUDA block (one warpgroup) owns 64
    packed query rows (`common.pack_rows`: decode rows are the `groups` query heads of one KV head,
    padded to 64 for wgmma) of one KV head, and one of `splits` contiguous shares of their key
    blocks (flash-decoding: splits fill the GPU when batch x KV heads cannot; each writes its
    normalised output and log-sum-exp, merged by `_combine`). It first copies its row of the page
    table (with the row's `q_start` and `q_len` in front) into shared memory, then walks its key blocks
    (`pages_per_block` pages, 64 or more keys) with `stages` blocks of K and V in flight: each
    page is one TMA copy straight from the pool `[num_kv_heads, num_pages, page_size, head_dim]`,
    each stage's copies arrive on one barrier per tensor. Blocks outside the causal (and
    sliding-window) range of the row block are never read; keys past a row's length inside the
    last block are masked. Decode is the one-token case, so memory traffic is the live K/V bytes
    plus 64 query rows per (row, KV head).


    Quantized pages: the codes travel as the 16-bit pages do (one TMA copy per page, into 8-row
    shared-memory tiles of 64 or 128 one-byte columns, swizzled to the row's bytes). wgmma takes no
    mixed bf16 x int8 operands, so each stage's K and V code blocks are loaded into registers, widened
    to the compute dtype (bfloat16, or float16 with float16 queries: both hold every int8 and e4m3 code
    exactly) and stored into one 16-bit block each, the operand of the matmuls. The scales stay in
    float32 outside the matmuls, as tpu.py applies them: XLA first gathers each row's scales in key
    order ([batch, num_kv_heads, keys], 4 bytes per key next to head_dim code bytes), a stage copies
    its block's slice of them beside its pages, the key scales multiply the scores of their keys and
    the value scales the probabilities before P.V (the softmax denominator sums the unscaled ones).
    """
    block = _CudaBlock(meta_ref, q_ref, k_ref, v_ref, refs, quantized=quantized, sm_scale=sm_scale,
                       soft_cap=soft_cap, sliding_window=sliding_window, groups=groups,
                       pages_per_block=pages_per_block, max_pages=max_pages, stages=stages,
                       splits=splits, interpret=interpret)
    block.run()


class _CudaBlock:
    """One CUDA block of `_kernel`: its refs and static options, and the steps of its work (the
    method calls trace `_kernel`'s program in order)."""

    def __init__(self, meta_ref, q_ref, k_ref, v_ref, refs, *, quantized: bool, sm_scale: float,
                 soft_cap: float | None, sliding_window: int | None, groups: int,
                 pages_per_block: int, max_pages: int, stages: int, splits: int, interpret: bool):
        self.meta_ref, self.q_ref, self.k_ref, self.v_ref = meta_ref, q_ref, k_ref, v_ref
        self.ks_ref = self.vs_ref = self.ks_smem = self.vs_smem = self.k_wide = self.v_wide = None
        if quantized:
            (self.ks_ref, self.vs_ref, self.o_ref, self.lse_ref, self.q_smem, self.k_smem, self.v_smem,
             self.meta_smem, self.lse_smem, self.ks_smem, self.vs_smem, self.k_wide, self.v_wide,
             self.q_bar, self.meta_bar, self.k_bars, self.v_bars) = refs
        else:
            (self.o_ref, self.lse_ref, self.q_smem, self.k_smem, self.v_smem, self.meta_smem,
             self.lse_smem, self.q_bar, self.meta_bar, self.k_bars, self.v_bars) = refs
        self.quantized, self.sm_scale, self.soft_cap = quantized, sm_scale, soft_cap
        self.sliding_window, self.groups, self.pages_per_block = sliding_window, groups, pages_per_block
        self.max_pages, self.stages, self.splits, self.interpret = max_pages, stages, splits, interpret
        self.b, self.h = lax.axis_index("b"), lax.axis_index("h")
        self.rb, self.split = lax.div(lax.axis_index("r"), splits), lax.rem(lax.axis_index("r"), splits)
        self.page_size, self.head_dim = k_ref.shape[2], k_ref.shape[3]
        self.block_len = pages_per_block * self.page_size
        self.row0 = self.rb * BLOCK_ROWS

    def run(self):
        """The program: the page-table row and queries in, the key blocks through the stages, the
        output out."""
        b, h, row0 = self.b, self.h, self.row0
        # A plain bulk copy (no tensor map), so the row may be longer than TMA's 256-element box.
        plgpu.copy_gmem_to_smem(self.meta_ref.at[b], self.meta_smem, self.meta_bar,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.copy_gmem_to_smem(self.q_ref.at[b, h, pl.ds(row0, BLOCK_ROWS)], self.q_smem, self.q_bar)
        plgpu.barrier_wait(self.meta_bar)
        q_start, q_len = self.meta_smem[0], self.meta_smem[1]
        first, stop = self.key_block_range(q_start, q_len)
        for s in range(self.stages):
            @pl.when(first + s < stop)
            def _():
                self.fetch(first + s, s)

        plgpu.barrier_wait(self.q_bar)
        shape = (BLOCK_ROWS, self.block_len)
        row = row0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), _MASK, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, self.head_dim), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)
        body = functools.partial(self.key_block, first=first, stop=stop, q_start=q_start, q_len=q_len,
                                 row=row, col=col)
        self.write_output(*lax.fori_loop(first, stop, body, (acc, m_i, l_i)))

    def key_block_range(self, q_start, q_len):
        """[first, stop): the key blocks of this CUDA block's share of the row block's key range
        [begin, end) (common.key_range, in scalars)."""
        groups, block_len, splits = self.groups, self.block_len, self.splits
        first_token = lax.div(self.row0, groups)
        last_token = jnp.minimum(lax.div(self.row0 + BLOCK_ROWS - 1, groups), q_len - 1)
        end = jnp.where(first_token <= last_token, q_start + last_token + 1, 0)
        begin = jnp.int32(0)
        if self.sliding_window is not None:
            begin = jnp.maximum(q_start + first_token - self.sliding_window + 1, 0)
        first = lax.div(begin, block_len)
        stop = jnp.maximum(lax.div(end + block_len - 1, block_len), first)
        if splits > 1:  # this CUDA block's share: a contiguous run of the key blocks
            share = lax.div(stop - first + splits - 1, splits)
            first = first + self.split * share
            stop = jnp.maximum(jnp.minimum(stop, first + share), first)
        return first, stop

    def fetch(self, j, slot):
        """Start key block j's copies into stage `slot`: its pages' K and V (and scales)."""
        page_size, pages_per_block, h = self.page_size, self.pages_per_block, self.h
        for i in range(pages_per_block):
            # Slots past the table's end only hold positions >= every length: clamp, then mask.
            page = self.meta_smem[_META + jnp.minimum(j * pages_per_block + i, self.max_pages - 1)]
            rows = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(self.k_ref.at[h, page], self.k_smem.at[slot, rows], self.k_bars.at[slot])
            plgpu.copy_gmem_to_smem(self.v_ref.at[h, page], self.v_smem.at[slot, rows], self.v_bars.at[slot])
        if self.quantized:  # the block's scales: block_len * 4 bytes, a multiple of 128 (one copy)
            keys = pl.ds(j * self.block_len, self.block_len)
            for ref, buf, bar in ((self.ks_ref, self.ks_smem, self.k_bars),
                                  (self.vs_ref, self.vs_smem, self.v_bars)):
                plgpu.copy_gmem_to_smem(ref.at[self.b, h, keys], buf.at[slot], bar.at[slot],
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    def widen(self, codes, wide):
        """A stage's code block into the 16-bit block the matmul reads (exact: every code is
        a value of the compute dtype)."""
        if self.interpret:
            wide[...] = codes[...].astype(wide.dtype)
            return
        x = plgpu.load(codes, layout=plgpu.Layout.WGMMA_8BIT)
        if x.dtype == jnp.float8_e4m3fn and wide.dtype != jnp.float16:
            x = x.astype(jnp.float16)  # Hopper converts e4m3 to f16 only; f16 -> bf16 is exact here
        wide[...] = x.astype(wide.dtype)
        # The stores, visible to wgmma. Its warpgroup barrier also orders them after every warp's
        # wait on the block's previous reader: the last matmul that read `wide` finished in all
        # warps before any of them got past the barrier that followed it (the other block's).
        plgpu.commit_smem()

    def column(self, scales):
        """A stage's f32 scales [block_len] as a row vector over the score columns."""
        if self.interpret:
            return scales[...][None, :]
        x = plgpu.load(scales, layout=plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(x, (BLOCK_ROWS, self.block_len), [1])

    def key_block(self, j, carry, *, first, stop, q_start, q_len, row, col):
        """fori_loop body: the online-softmax update (in log2 units) with key block j."""
        acc, m_i, l_i = carry
        slot = lax.rem(j - first, jnp.int32(self.stages))
        s = self.scores(slot)
        rel = j * self.block_len + col - q_start  # key position relative to the row's first token
        mask = (rel * self.groups <= row) & (row < q_len * self.groups)
        if self.sliding_window is not None:
            mask &= row < (rel + self.sliding_window) * self.groups
        s = jnp.where(mask, s, _MASK)
        m_next = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_next)
        p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = self.add_pv(acc, p, slot)

        # Both matmuls are done with this slot: refill it with block j + stages.
        @pl.when(j + self.stages < stop)
        def _():
            self.fetch(j + self.stages, slot)
        return acc, m_next, l_i

    def scores(self, slot):
        """Q.K of stage `slot` once its K has arrived: logits (soft-capped) in log2 units."""
        plgpu.barrier_wait(self.k_bars.at[slot])
        k_block = self.k_smem.at[slot]
        if self.quantized:
            self.widen(k_block, self.k_wide)
            k_block = self.k_wide

        if self.interpret:  # the GPU interpreter has no wgmma: the same products with jnp
            s = lax.dot_general(self.q_smem[...], k_block[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        else:
            def qk(acc_ref):
                plgpu.wgmma(acc_ref, self.q_smem, k_block.transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, self.block_len), jnp.float32))
        if self.quantized:
            s = s * self.column(self.ks_smem.at[slot])  # q . (codes * scale) = (q . codes) * scale
        if self.soft_cap is not None:
            return self.soft_cap * jnp.tanh(s * (self.sm_scale / self.soft_cap)) * _LOG2E
        return s * (self.sm_scale * _LOG2E)  # logits in log2 units

    def add_pv(self, acc, p, slot):
        """acc + P.V of stage `slot` once its V has arrived."""
        plgpu.barrier_wait(self.v_bars.at[slot])
        v_block = self.v_smem.at[slot]
        if self.quantized:
            self.widen(v_block, self.v_wide)
            v_block = self.v_wide
            p = p * self.column(self.vs_smem.at[slot])  # sum_k p_k (codes_k * scale_k)

        if self.interpret:
            return acc + jnp.dot(p.astype(v_block.dtype), v_block[...],
                                 preferred_element_type=jnp.float32)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(v_block.dtype), v_block)
        return pl.run_state(pv)(plgpu.ACC.init(acc))

    def write_output(self, acc, m_i, l_i):
        """The epilogue: the normalised rows (and, with splits, their log-sum-exp) to HBM."""
        b, h, split, rows = self.b, self.h, self.split, pl.ds(self.row0, BLOCK_ROWS)
        l_safe = jnp.where(l_i > 0.0, l_i, 1.0)  # rows with no key output zeros (acc is 0)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        self.q_smem[...] = out.astype(self.q_smem.dtype)
        # The row's log-sum-exp in base 2 (m is in log2 units): what `_combine` weighs splits by.
        self.lse_smem[...] = jnp.where(l_i > 0.0, m_i + jnp.log(l_safe) * _LOG2E, _MASK)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.q_smem, self.o_ref.at[b, h, split, rows])
        if self.splits > 1:
            plgpu.copy_smem_to_gmem(self.lse_smem, self.lse_ref.at[b, h, split, rows])
        plgpu.wait_smem_to_gmem(0)


def _combine(out, lse):
    """Merge key splits: out [batch, kv_heads, splits, rows, head_dim], lse [..., splits, rows]
    -> [batch, kv_heads, rows, head_dim] (float32 arithmetic; all-empty rows stay zeros)."""
    weight = jnp.exp2(lse - lse.max(axis=2, keepdims=True))
    weight = jnp.where(lse > _MASK / 2, weight, 0.0)
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
    meta = meta.at[:, _META:_META + max_pages].set(page_indices)
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
        _kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
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
    """Runs `_kernel` on its grid: its outputs (per split: rows and their log-sum-exp) and its
    shared-memory scratch and barriers, in `_kernel`'s order."""
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
