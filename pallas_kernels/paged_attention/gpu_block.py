"""The Mosaic GPU paged-attention kernel's body: the program one CUDA block runs (`kernel`,
`_CudaBlock`), traced by `gpu.paged_attention_rows`, which prepares its inputs, sizes its blocks
and launches it (`gpu._launch`).

`kernel`'s docstring gives the grid, the pipeline, the key splits and how quantized pages reach
wgmma. See docs/architecture.md, "The backend seam".
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_ROWS = 64  # wgmma's M: packed query rows per CUDA block
META = 4         # int32 columns in front of each page-table row: q_start, q_len, 0, 0
MASK = -1e30     # finite: exp2(MASK - m) underflows to 0 without inf - inf
LOG2E = math.log2(math.e)


def kernel(meta_ref, q_ref, k_ref, v_ref, *refs, quantized: bool, sm_scale: float,
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
    normalised output and log-sum-exp, merged by `gpu._combine`). It first copies its row of the page
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
    """One CUDA block of `kernel`: its refs and static options, and the steps of its work (the
    method calls trace `kernel`'s program in order)."""

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
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), MASK, jnp.float32),
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
            page = self.meta_smem[META + jnp.minimum(j * pages_per_block + i, self.max_pages - 1)]
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
        s = jnp.where(mask, s, MASK)
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
            return self.soft_cap * jnp.tanh(s * (self.sm_scale / self.soft_cap)) * LOG2E
        return s * (self.sm_scale * LOG2E)  # logits in log2 units

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
        # The row's log-sum-exp in base 2 (m is in log2 units): what `gpu._combine` weighs splits by.
        self.lse_smem[...] = jnp.where(l_i > 0.0, m_i + jnp.log(l_safe) * LOG2E, MASK)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.q_smem, self.o_ref.at[b, h, split, rows])
        if self.splits > 1:
            plgpu.copy_smem_to_gmem(self.lse_smem, self.lse_ref.at[b, h, split, rows])
        plgpu.wait_smem_to_gmem(0)
