"""Ragged paged attention on TPU (Mosaic): blocks of the flattened token axis, each walking the
rows that intersect it, with double-buffered page DMAs across rows.

NOT RUN ON A TPU: checked on CPU in Pallas' TPU interpret mode (`interpret="tpu"`: DMAs,
semaphores, SMEM, NaN-filled uninitialised VMEM) and by lowering for TPU with `jax.export`, which
runs Pallas' lowering to Mosaic but not Mosaic's own layout passes (those run in libtpu);
`scripts/bench_ragged_attention.py --backend tpu` is the check to run on a TPU VM.

`_kernel`'s docstring gives the layout and how quantized pages are read, `_GridStep`'s what one grid
step does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.common import MASK_VALUE, attention_mask, key_range, online_softmax_update

DEFAULT_BLOCK_KEYS = 128  # keys per compute block: one lane row (as tpu.py)
DEFAULT_BLOCK_ROWS = 128  # packed query rows per grid step


def _align(dtype) -> int:
    """Sublanes of one VMEM tile of the query dtype: dynamic row offsets are multiples of it."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _compute_dtype(q_dtype, kv_dtype, quantized: bool):
    """The matmuls' operand dtype (as tpu.py): float32 with float32 queries or pages; for codes
    bfloat16 queries' dtype, else float32 (codes widen exactly into both); else q's dtype."""
    if jnp.dtype(q_dtype) == jnp.float32 or jnp.dtype(kv_dtype) == jnp.float32:
        return jnp.dtype(jnp.float32)
    if quantized and jnp.dtype(q_dtype) != jnp.bfloat16:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(q_dtype)


def _kernel(
    kv_lens_ref,        # SMEM int32 [max_rows]
    cu_ref,             # SMEM int32 [max_rows + 1] (clipped to [0, num_tokens])
    pages_ref,          # SMEM int32 [max_rows * max_pages]
    first_row_ref,      # SMEM int32 [row_blocks]: first row that may intersect the block
    end_row_ref,        # SMEM int32 [row_blocks]: end of them (exclusive, <= num_rows)
    q_ref,              # VMEM [block_rows, head_dim]
    k_hbm_ref,          # ANY  [num_kv_heads, num_pages, page_size, head_dim]
    v_hbm_ref,          # ANY  [num_kv_heads, num_pages, page_size, head_dim]
    *refs,              # quantized: ks_hbm, vs_hbm ANY f32 [num_kv_heads, max_rows * blocks,
                        # block_len]; o_ref VMEM [block_rows, head_dim]; k_buf, v_buf VMEM
                        # [2, pages_per_block, page_size, head_dim]; quantized: ks_buf, vs_buf
                        # VMEM f32 [2, 1, block_len]; sems DMA [4, 2]; m_ref, l_ref f32
                        # [block_rows, 128]; acc_ref f32 [block_rows, head_dim]
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    groups: int,
    pages_per_block: int,
    max_pages: int,
    window: int,
    align: int,
):
    """Layout: the queries of KV head h, packed token-major as in `common.pack_rows` but over the
    flattened token axis (packed row `t * groups + i` is token t, query head `h * groups + i`),
    padded to whole blocks of `block_rows` packed rows. Grid `(num_kv_heads, row_blocks)`, both
    "parallel" (no state crosses grid steps). Scalar prefetch puts kv_lens, cu_q_lens, the flattened
    page table and, per block, the first and the end of the rows that may intersect it (computed by
    XLA from cu_q_lens) in SMEM; the pages stay in HBM (`memory_space=ANY`). `_GridStep` gives
    what one grid step (one KV head, one block of packed rows) does.

    Every page a row needs is read once per (KV head, block holding some of the row's tokens): once for
    a decode row, and for a prefill chunk once per block it spans, up to the block's last token.

    Quantized pages (int8 / float8_e4m3fn codes): as `tpu.py`, XLA first gathers each row's scales
    in key order ([num_kv_heads, max_rows * key_blocks, block_len]: the whole page table's slots, 4
    bytes per key and head); a key block's scales are one more DMA per tensor beside its pages. The
    key scales multiply the scores and the value scales the probabilities before P.V.
    """
    step = _GridStep((kv_lens_ref, cu_ref, pages_ref, end_row_ref), q_ref, (k_hbm_ref, v_hbm_ref),
                     refs, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap,
                     sliding_window=sliding_window, groups=groups, pages_per_block=pages_per_block,
                     max_pages=max_pages, window=window, align=align)
    step.run(first_row_ref)


class _GridStep:
    """One grid step of `_kernel` (one KV head, one block of packed rows):
    - zeroes its output block (padding tokens stay zeros), then walks the rows intersecting the block
      in order, skipping rows with no token in it or no key to attend (`run`, `next_row`);
    - for each row, the block's rows that are the row's own tokens form a local range [lo, hi). When
      that range fits in one aligned window of `window` packed rows (a decode row: `groups` rows; a
      few speculative tokens), the row is computed on that window only (a `window x keys` product),
      else on the whole block, masked to the row's tokens (`rows_of`). So a block of decode rows costs
      one small window per row, not a full block per token;
    - walks the row's key blocks of `pages_per_block` pages that its tokens in this block can attend
      (causal, and the sliding window): pages outside that range are never copied, neither whole key
      blocks nor the pages past the row's last key inside its last block (`copies`);
    - the copies of the next key block, which may be the next row's first one, are started before
      the current block is waited for, into the other half of a two-slot VMEM buffer, so within a
      grid step only its first copy is exposed (each grid step still pays that one latency: there is
      no prefetch across grid steps) (`key_block`);
    - key slots of a block that were not copied hold stale or uninitialised VMEM: their scores are
      masked, and V is zeroed there (a select over the block; 0 * NaN would reach P.V);
    - online softmax (float32, m and l replicated over 128 lanes as in `tpu.py`) in VMEM scratch,
      reinitialised per row over the rows it computes; at the row's end its normalised output is
      merged into the output block on its own rows only (`merge_output`).
    """

    def __init__(self, smem_refs, q_ref, hbm_refs, refs, *, quantized: bool, sm_scale: float,
                 soft_cap: float | None, sliding_window: int | None, groups: int,
                 pages_per_block: int, max_pages: int, window: int, align: int):
        self.kv_lens_ref, self.cu_ref, self.pages_ref, end_row_ref = smem_refs
        self.q_ref, (self.k_hbm_ref, self.v_hbm_ref) = q_ref, hbm_refs
        if quantized:
            (self.ks_hbm_ref, self.vs_hbm_ref, self.o_ref, self.k_buf, self.v_buf, self.ks_buf,
             self.vs_buf, self.sems, self.m_ref, self.l_ref, self.acc_ref) = refs
        else:
            self.o_ref, self.k_buf, self.v_buf, self.sems, self.m_ref, self.l_ref, self.acc_ref = refs
        self.quantized, self.sm_scale, self.soft_cap = quantized, sm_scale, soft_cap
        self.sliding_window, self.groups, self.pages_per_block = sliding_window, groups, pages_per_block
        self.max_pages, self.window, self.align = max_pages, window, align
        self.h, self.blk = pl.program_id(0), pl.program_id(1)
        self.block_rows, self.head_dim = q_ref.shape
        self.page_size = self.k_buf.shape[2]
        self.block_len = pages_per_block * self.page_size
        self.key_blocks = pl.cdiv(max_pages, pages_per_block)
        self.row0 = self.blk * self.block_rows  # packed row of the block's first row
        self.r_end = end_row_ref[self.blk]
        self.compute = _compute_dtype(q_ref.dtype, self.k_buf.dtype, quantized)

    def info(self, r):
        """Scalars of row r in this block; all lax.div operands are >= 0."""
        groups, block_rows, block_len = self.groups, self.block_rows, self.block_len
        c0, c1 = self.cu_ref[r], self.cu_ref[r + 1]
        q_len = c1 - c0
        q_start = self.kv_lens_ref[r] - q_len  # position of the row's first new token
        base = c0 * groups - self.row0  # local index of the row's packed row 0
        lo = jnp.clip(base, 0, block_rows)
        hi = jnp.clip(c1 * groups - self.row0, 0, block_rows)
        first_tok = lax.div(jnp.maximum(lo - base, 0), groups)
        last_tok = lax.div(jnp.maximum(hi - 1 - base, 0), groups)
        begin, end = key_range(q_start, q_len, first_tok, last_tok, sliding_window=self.sliding_window)
        end = jnp.maximum(end, 0)
        first = lax.div(jnp.minimum(begin, end), block_len)
        stop = lax.div(end + block_len - 1, block_len)
        # The aligned window holding the row's local rows (kept inside the block).
        ws = jnp.minimum(lax.div(lo, self.align) * self.align, block_rows - self.window)
        small = hi - ws <= self.window
        return dict(q_start=q_start, q_len=q_len, base=base, lo=lo, hi=hi, begin=begin, end=end,
                    first=first, stop=stop, ws=ws, small=small, live=(hi > lo) & (stop > first))

    def next_row(self, r):
        """The first row >= r intersecting the block with keys to attend (r_end if none)."""
        return lax.while_loop(lambda r: (r < self.r_end) & ~self.info(jnp.minimum(r, self.r_end - 1))["live"],
                              lambda r: r + 1, r)

    def copies(self, r, j, slot):
        """(predicate, copy) pairs of key block j of row r: pages [begin, end) of it only."""
        i, page_size, pages_per_block, max_pages = self.info(r), self.page_size, self.pages_per_block, self.max_pages
        first_page = lax.div(i["begin"], page_size)
        end_page = lax.div(i["end"] + page_size - 1, page_size)
        out = []
        for p in range(pages_per_block):
            page_slot = j * pages_per_block + p
            page = self.pages_ref[r * max_pages + jnp.minimum(page_slot, max_pages - 1)]
            need = (page_slot >= first_page) & (page_slot < end_page) & (page_slot < max_pages)
            for ref, buf, sem in ((self.k_hbm_ref, self.k_buf, self.sems.at[0, slot]),
                                  (self.v_hbm_ref, self.v_buf, self.sems.at[1, slot])):
                out.append((need, pltpu.make_async_copy(ref.at[self.h, page], buf.at[slot, p], sem)))
        if self.quantized:
            item = pl.ds(r * self.key_blocks + j, 1)
            for ref, buf, sem in ((self.ks_hbm_ref, self.ks_buf, self.sems.at[2, slot]),
                                  (self.vs_hbm_ref, self.vs_buf, self.sems.at[3, slot])):
                out.append((True, pltpu.make_async_copy(ref.at[self.h, item], buf.at[slot], sem)))
        return out

    def start(self, r, j, slot):
        for need, c in self.copies(r, j, slot):
            c.start() if need is True else pl.when(need)(c.start)

    def wait(self, r, j, slot):
        for need, c in self.copies(r, j, slot):
            c.wait() if need is True else pl.when(need)(c.wait)

    def rows_of(self, small, fn):
        """fn(start, rows) on the row's window (small) or on the whole block."""
        @pl.when(small)
        def _():
            fn(None, self.window)

        @pl.when(~small)
        def _():
            fn(0, self.block_rows)

    def run(self, first_row_ref):
        """The grid step: its rows from the block's first candidate (`first_row_ref`) on."""
        self.o_ref[...] = jnp.zeros(self.o_ref.shape, self.o_ref.dtype)
        r0 = self.next_row(first_row_ref[self.blk])

        @pl.when(r0 < self.r_end)
        def _():
            self.start(r0, self.info(r0)["first"], 0)

        lax.while_loop(lambda c: c[0] < self.r_end, self.attend_row, (r0, jnp.int32(0)))

    def attend_row(self, carry):
        """while_loop body: row r's tokens in this block; returns (the next row, the free slot)."""
        r, slot = carry
        i = self.info(r)
        nr = self.next_row(r + 1)
        ws = pl.multiple_of(i["ws"], self.align)
        self.rows_of(i["small"], functools.partial(self.init_state, ws))
        slot = lax.fori_loop(i["first"], i["stop"],
                             functools.partial(self.key_block, r=r, i=i, nr=nr, ws=ws), slot)
        self.rows_of(i["small"], functools.partial(self.merge_output, ws, i))
        return nr, slot

    def init_state(self, ws, start_, rows):
        """Resets the softmax state of rows [start_, start_ + rows) (None: the window at ws)."""
        s = _span(ws, start_, rows)
        self.m_ref[s] = jnp.full((rows, self.m_ref.shape[1]), MASK_VALUE, jnp.float32)
        self.l_ref[s] = jnp.zeros((rows, self.l_ref.shape[1]), jnp.float32)
        self.acc_ref[s] = jnp.zeros((rows, self.head_dim), jnp.float32)

    def key_block(self, j, slot, *, r, i, nr, ws):
        """fori_loop body: key block j of row r (info i) from `slot`; returns the other slot."""
        block_len, head_dim, compute, r_end = self.block_len, self.head_dim, self.compute, self.r_end
        last = j + 1 == i["stop"]

        @pl.when(~last)
        def _():
            self.start(r, j + 1, 1 - slot)

        @pl.when(last & (nr < r_end))
        def _():
            self.start(nr, self.info(jnp.minimum(nr, r_end - 1))["first"], 1 - slot)

        self.wait(r, j, slot)
        key_pos = j * block_len + lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
        k = self.k_buf[slot].reshape(block_len, head_dim).astype(compute)
        v = self.v_buf[slot].reshape(block_len, head_dim).astype(compute)
        # Slots of the block outside the row's keys were not copied (stale or uninitialised
        # VMEM, maybe NaN): zero V there, as 0 * NaN would reach P.V; scores are masked.
        key_col = j * block_len + lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
        v = jnp.where((key_col >= i["begin"]) & (key_col < i["end"]), v,
                      jnp.zeros((), compute))
        self.rows_of(i["small"], functools.partial(self.update_softmax, ws, i, slot, key_pos, k, v))
        return 1 - slot

    def update_softmax(self, ws, i, slot, key_pos, k, v, start_, rows):
        """The online-softmax update of rows [start_, start_ + rows) (None: the window at ws)."""
        s_rows = _span(ws, start_, rows)
        q = self.q_ref[s_rows].astype(self.compute)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * self.sm_scale
        if self.quantized:
            s = s * self.ks_buf[slot]  # [1, block_len]
        if self.soft_cap is not None:
            s = self.soft_cap * jnp.tanh(s / self.soft_cap)
        local = (ws if start_ is None else start_) + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        mask = attention_mask(key_pos, local - i["base"], i["q_start"], i["q_len"],
                              groups=self.groups, sliding_window=self.sliding_window)
        online_softmax_update(s, mask, v, self.m_ref, self.l_ref, self.acc_ref, s_rows,
                              v_scales=(lambda: self.vs_buf[slot]) if self.quantized else None)

    def merge_output(self, ws, i, start_, rows):
        """Row i's normalised output into the output block, on its own rows [lo, hi) only."""
        s = _span(ws, start_, rows)
        l = self.l_ref[s][:, :1]
        out = jnp.where(l > 0, self.acc_ref[s] / jnp.where(l > 0, l, 1.0), 0.0)
        local = (ws if start_ is None else start_) + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        mine = (local >= i["lo"]) & (local < i["hi"])
        self.o_ref[s] = jnp.where(mine, out, self.o_ref[s].astype(jnp.float32)).astype(self.o_ref.dtype)


def _span(ws, start_, rows):
    """Rows [start_, start_ + rows) of the block; start_ None: the row's window at ws."""
    return pl.ds(ws if start_ is None else start_, rows)


def _block_rows(total_rows: int, align: int, block_rows: int | None) -> int:
    if block_rows is None:
        block_rows = DEFAULT_BLOCK_ROWS
    block_rows = min(block_rows, -(-total_rows // align) * align)
    return max(align, -(-block_rows // align) * align)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "pages_per_block", "block_rows", "interpret"))
def ragged_paged_attention_tpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_rows, *,
                               sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                               k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                               pages_per_block: int | None = None, block_rows: int | None = None,
                               interpret: bool | str = False) -> jax.Array:
    """`ragged.ragged_paged_attention`'s contract on the Mosaic TPU kernel (inputs validated).

    `block_rows` packed query rows per grid step (default 128; rounded to the query dtype's
    sublane tile), `pages_per_block` pages per key block (default 128 keys' worth). `interpret`:
    False compiles it with Mosaic; True or "tpu" runs it in Pallas' TPU interpreter (simulated
    DMAs and semaphores, uninitialised VMEM filled with NaN: the strict check, slow
    even on a tiny batch); "generic" in Pallas' generic interpreter (DMAs become plain copies, no
    race or uninitialised-read checks; the same kernel code and index math, as fast as XLA runs
    it: what the "cpu_pallas" serving backend uses).
    """
    if interpret not in (False, True, "tpu", "generic"):
        raise ValueError(f"interpret must be False, True, 'tpu' or 'generic', got {interpret!r}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_rows, max_pages = page_indices.shape
    groups = num_q_heads // num_kv_heads
    align = _align(q.dtype)
    total_rows = num_tokens * groups
    block_rows = _block_rows(total_rows, align, block_rows)
    row_blocks = pl.cdiv(total_rows, block_rows)
    # Rows of a decode token (groups rows from any offset) fit one aligned window of this size.
    window = min(block_rows, -(-(groups + align - 1) // align) * align)
    if pages_per_block is None:
        pages_per_block = max(1, DEFAULT_BLOCK_KEYS // page_size)
    pages_per_block = min(pages_per_block, max_pages)

    qp = q.reshape(num_tokens, num_kv_heads, groups, head_dim).transpose(1, 0, 2, 3)
    qp = qp.reshape(num_kv_heads, total_rows, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, row_blocks * block_rows - total_rows), (0, 0)))
    cu, first_row, end_row = _rows_by_block(cu_q_lens, num_rows, num_tokens, max_rows,
                                            row_blocks=row_blocks, block_rows=block_rows, groups=groups)
    quantized = k_scales is not None
    scales = _scales_by_key_block(k_scales, v_scales, page_indices, page_size,
                                  pages_per_block) if quantized else ()
    kernel = functools.partial(_kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, groups=groups,
                               pages_per_block=pages_per_block, max_pages=max_pages,
                               window=window, align=align)
    out = pl.pallas_call(
        kernel,
        grid_spec=_grid_spec(num_kv_heads, row_blocks, block_rows, head_dim, pages_per_block,
                             page_size, k_pages.dtype, quantized),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=True if interpret == "generic" else pltpu.InterpretParams() if interpret else False,
    )(kv_lens, cu, page_indices.reshape(-1), first_row, end_row, qp, k_pages, v_pages, *scales)
    out = out[:, :total_rows].reshape(num_kv_heads, num_tokens, groups, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)


def _rows_by_block(cu_q_lens, num_rows, num_tokens: int, max_rows: int, *, row_blocks: int,
                   block_rows: int, groups: int):
    """cu_q_lens clipped to [0, num_tokens], and per block the rows that may intersect it (by
    tokens): [first, end) among live rows."""
    cu = jnp.clip(cu_q_lens, 0, num_tokens).astype(jnp.int32)
    live = jnp.arange(max_rows) < num_rows[0]
    b = jnp.arange(row_blocks, dtype=jnp.int32)
    tok0 = (b * block_rows) // groups  # first token with a row in the block
    tok1 = ((b + 1) * block_rows + groups - 1) // groups  # end of those tokens
    first_row = jnp.sum(live[None] & (cu[None, 1:] <= tok0[:, None]), axis=1).astype(jnp.int32)
    end_row = jnp.sum(live[None] & (cu[None, :-1] < tok1[:, None]), axis=1).astype(jnp.int32)
    return cu, first_row, end_row


def _scales_by_key_block(k_scales, v_scales, page_indices, page_size: int, pages_per_block: int):
    """Each row's scales in key order: [num_kv_heads, max_rows * key_blocks, block_len]."""
    max_rows, max_pages = page_indices.shape
    key_blocks = pl.cdiv(max_pages, pages_per_block)
    table = jnp.pad(page_indices, ((0, 0), (0, key_blocks * pages_per_block - max_pages)))
    return tuple(x[:, table].reshape(x.shape[0], max_rows * key_blocks, pages_per_block * page_size)
                 for x in (k_scales, v_scales))


def _grid_spec(num_kv_heads: int, row_blocks: int, block_rows: int, head_dim: int,
               pages_per_block: int, page_size: int, kv_dtype, quantized: bool):
    """The kernel's grid, blocks and scratch (`_kernel`'s arguments)."""
    block = pl.BlockSpec((None, block_rows, head_dim), lambda h, blk, *_: (h, blk, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), kv_dtype)
    scale_bufs = [pltpu.VMEM((2, 1, pages_per_block * page_size), jnp.float32)] * 2 if quantized else []
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_kv_heads, row_blocks),
        in_specs=[block] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 + 2 * quantized),
        out_specs=block,
        scratch_shapes=[buf, buf, *scale_bufs, pltpu.SemaphoreType.DMA((4, 2)),
                        pltpu.VMEM((block_rows, 128), jnp.float32),
                        pltpu.VMEM((block_rows, 128), jnp.float32),
                        pltpu.VMEM((block_rows, head_dim), jnp.float32)],
    )
