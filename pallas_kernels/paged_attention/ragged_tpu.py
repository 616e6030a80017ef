"""Ragged paged attention on TPU (Mosaic): blocks of the flattened token axis, each walking the
rows that intersect it, with double-buffered page DMAs across rows.

NOT RUN ON A TPU: checked on CPU in Pallas' TPU interpret mode (`interpret="tpu"`: DMAs,
semaphores, SMEM, NaN-filled uninitialised VMEM) and by lowering for TPU with `jax.export`, which
runs Pallas' lowering to Mosaic but not Mosaic's own layout passes (those run in libtpu);
`scripts/bench_ragged_attention.py --backend tpu` is the check to run on a TPU VM.

`_kernel`'s docstring gives the layout, what one grid step does, and how quantized pages are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.common import MASK_VALUE, attention_mask, key_range

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
    XLA from cu_q_lens) in SMEM; the pages stay in HBM (`memory_space=ANY`).

    One grid step (one KV head, one block of packed rows):
    - zeroes its output block (padding tokens stay zeros), then walks the rows intersecting the block
      in order, skipping rows with no token in it or no key to attend;
    - for each row, the block's rows that are the row's own tokens form a local range [lo, hi). When
      that range fits in one aligned window of `window` packed rows (a decode row: `groups` rows; a
      few speculative tokens), the row is computed on that window only (a `window x keys` product),
      else on the whole block, masked to the row's tokens. So a block of decode rows costs one small
      window per row, not a full block per token;
    - walks the row's key blocks of `pages_per_block` pages that its tokens in this block can attend
      (causal, and the sliding window): pages outside that range are never copied, neither whole key
      blocks nor the pages past the row's last key inside its last block;
    - the copies of the next key block, which may be the next row's first one, are started before
      the current block is waited for, into the other half of a two-slot VMEM buffer, so within a
      grid step only its first copy is exposed (each grid step still pays that one latency: there is
      no prefetch across grid steps);
    - key slots of a block that were not copied hold stale or uninitialised VMEM: their scores are
      masked, and V is zeroed there (a select over the block; 0 * NaN would reach P.V);
    - online softmax (float32, m and l replicated over 128 lanes as in `tpu.py`) in VMEM scratch,
      reinitialised per row over the rows it computes; at the row's end its normalised output is
      merged into the output block on its own rows only.

    Every page a row needs is read once per (KV head, block holding some of the row's tokens): once for
    a decode row, and for a prefill chunk once per block it spans, up to the block's last token.

    Quantized pages (int8 / float8_e4m3fn codes): as `tpu.py`, XLA first gathers each row's scales
    in key order ([num_kv_heads, max_rows * key_blocks, block_len]: the whole page table's slots, 4
    bytes per key and head); a key block's scales are one more DMA per tensor beside its pages. The
    key scales multiply the scores and the value scales the probabilities before P.V.
    """
    if quantized:
        (ks_hbm_ref, vs_hbm_ref, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref,
         acc_ref) = refs
    else:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    h, blk = pl.program_id(0), pl.program_id(1)
    block_rows, head_dim = q_ref.shape
    page_size = k_buf.shape[2]
    block_len = pages_per_block * page_size
    key_blocks = pl.cdiv(max_pages, pages_per_block)
    row0 = blk * block_rows  # packed row of the block's first row
    r_end = end_row_ref[blk]
    compute = _compute_dtype(q_ref.dtype, k_buf.dtype, quantized)

    def info(r):
        """Scalars of row r in this block; all lax.div operands are >= 0."""
        c0, c1 = cu_ref[r], cu_ref[r + 1]
        q_len = c1 - c0
        q_start = kv_lens_ref[r] - q_len  # position of the row's first new token
        base = c0 * groups - row0  # local index of the row's packed row 0
        lo = jnp.clip(base, 0, block_rows)
        hi = jnp.clip(c1 * groups - row0, 0, block_rows)
        first_tok = lax.div(jnp.maximum(lo - base, 0), groups)
        last_tok = lax.div(jnp.maximum(hi - 1 - base, 0), groups)
        begin, end = key_range(q_start, q_len, first_tok, last_tok, sliding_window=sliding_window)
        end = jnp.maximum(end, 0)
        first = lax.div(jnp.minimum(begin, end), block_len)
        stop = lax.div(end + block_len - 1, block_len)
        # The aligned window holding the row's local rows (kept inside the block).
        ws = jnp.minimum(lax.div(lo, align) * align, block_rows - window)
        small = hi - ws <= window
        return dict(q_start=q_start, q_len=q_len, base=base, lo=lo, hi=hi, begin=begin, end=end,
                    first=first, stop=stop, ws=ws, small=small, live=(hi > lo) & (stop > first))

    def next_row(r):
        """The first row >= r intersecting the block with keys to attend (r_end if none)."""
        return lax.while_loop(lambda r: (r < r_end) & ~info(jnp.minimum(r, r_end - 1))["live"],
                              lambda r: r + 1, r)

    def copies(r, j, slot):
        """(predicate, copy) pairs of key block j of row r: pages [begin, end) of it only."""
        i = info(r)
        first_page = lax.div(i["begin"], page_size)
        end_page = lax.div(i["end"] + page_size - 1, page_size)
        out = []
        for p in range(pages_per_block):
            page_slot = j * pages_per_block + p
            page = pages_ref[r * max_pages + jnp.minimum(page_slot, max_pages - 1)]
            need = (page_slot >= first_page) & (page_slot < end_page) & (page_slot < max_pages)
            for ref, buf, sem in ((k_hbm_ref, k_buf, sems.at[0, slot]),
                                  (v_hbm_ref, v_buf, sems.at[1, slot])):
                out.append((need, pltpu.make_async_copy(ref.at[h, page], buf.at[slot, p], sem)))
        if quantized:
            item = pl.ds(r * key_blocks + j, 1)
            for ref, buf, sem in ((ks_hbm_ref, ks_buf, sems.at[2, slot]),
                                  (vs_hbm_ref, vs_buf, sems.at[3, slot])):
                out.append((True, pltpu.make_async_copy(ref.at[h, item], buf.at[slot], sem)))
        return out

    def start(r, j, slot):
        for need, c in copies(r, j, slot):
            c.start() if need is True else pl.when(need)(c.start)

    def wait(r, j, slot):
        for need, c in copies(r, j, slot):
            c.wait() if need is True else pl.when(need)(c.wait)

    def rows_of(small, fn):
        """fn(start, rows) on the row's window (small) or on the whole block."""
        @pl.when(small)
        def _():
            fn(None, window)

        @pl.when(~small)
        def _():
            fn(0, block_rows)

    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    r0 = next_row(first_row_ref[blk])

    @pl.when(r0 < r_end)
    def _():
        start(r0, info(r0)["first"], 0)

    def row_body(carry):
        r, slot = carry
        i = info(r)
        nr = next_row(r + 1)
        ws = pl.multiple_of(i["ws"], align)

        def span(start_, rows):
            return pl.ds(ws if start_ is None else start_, rows)

        def init(start_, rows):
            s = span(start_, rows)
            m_ref[s] = jnp.full((rows, m_ref.shape[1]), MASK_VALUE, jnp.float32)
            l_ref[s] = jnp.zeros((rows, l_ref.shape[1]), jnp.float32)
            acc_ref[s] = jnp.zeros((rows, head_dim), jnp.float32)

        rows_of(i["small"], init)

        def kv_body(j, slot):
            last = j + 1 == i["stop"]

            @pl.when(~last)
            def _():
                start(r, j + 1, 1 - slot)

            @pl.when(last & (nr < r_end))
            def _():
                start(nr, info(jnp.minimum(nr, r_end - 1))["first"], 1 - slot)

            wait(r, j, slot)
            key_pos = j * block_len + lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
            k = k_buf[slot].reshape(block_len, head_dim).astype(compute)
            v = v_buf[slot].reshape(block_len, head_dim).astype(compute)
            # Slots of the block outside the row's keys were not copied (stale or uninitialised
            # VMEM, maybe NaN): zero V there, as 0 * NaN would reach P.V; scores are masked.
            key_col = j * block_len + lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
            v = jnp.where((key_col >= i["begin"]) & (key_col < i["end"]), v,
                          jnp.zeros((), compute))

            def step(start_, rows):
                s_rows = span(start_, rows)
                q = q_ref[s_rows].astype(compute)
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale
                if quantized:
                    s = s * ks_buf[slot]  # [1, block_len]
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                local = (ws if start_ is None else start_) + lax.broadcasted_iota(
                    jnp.int32, (rows, 1), 0)
                mask = attention_mask(key_pos, local - i["base"], i["q_start"], i["q_len"],
                                      groups=groups, sliding_window=sliding_window)
                s = jnp.where(mask, s, MASK_VALUE)
                m_prev = m_ref[s_rows]
                m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
                alpha = jnp.exp(m_prev - m_next)
                m_ref[s_rows] = m_next
                l_ref[s_rows] = alpha * l_ref[s_rows] + p.sum(axis=-1, keepdims=True)
                if quantized:
                    p = p * vs_buf[slot]
                pv = jnp.dot(p.astype(compute), v, preferred_element_type=jnp.float32)
                acc_ref[s_rows] = alpha[:, :1] * acc_ref[s_rows] + pv

            rows_of(i["small"], step)
            return 1 - slot

        slot = lax.fori_loop(i["first"], i["stop"], kv_body, slot)

        def finish(start_, rows):
            s = span(start_, rows)
            l = l_ref[s][:, :1]
            out = jnp.where(l > 0, acc_ref[s] / jnp.where(l > 0, l, 1.0), 0.0)
            local = (ws if start_ is None else start_) + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
            mine = (local >= i["lo"]) & (local < i["hi"])
            o_ref[s] = jnp.where(mine, out, o_ref[s].astype(jnp.float32)).astype(o_ref.dtype)

        rows_of(i["small"], finish)
        return nr, slot

    lax.while_loop(lambda c: c[0] < r_end, row_body, (r0, jnp.int32(0)))


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
    block_len = pages_per_block * page_size
    key_blocks = pl.cdiv(max_pages, pages_per_block)

    qp = q.reshape(num_tokens, num_kv_heads, groups, head_dim).transpose(1, 0, 2, 3)
    qp = qp.reshape(num_kv_heads, total_rows, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, row_blocks * block_rows - total_rows), (0, 0)))

    # Per block, the rows that may intersect it (by tokens): [first, end) among live rows.
    cu = jnp.clip(cu_q_lens, 0, num_tokens).astype(jnp.int32)
    live = jnp.arange(max_rows) < num_rows[0]
    b = jnp.arange(row_blocks, dtype=jnp.int32)
    tok0 = (b * block_rows) // groups  # first token with a row in the block
    tok1 = ((b + 1) * block_rows + groups - 1) // groups  # end of those tokens
    first_row = jnp.sum(live[None] & (cu[None, 1:] <= tok0[:, None]), axis=1).astype(jnp.int32)
    end_row = jnp.sum(live[None] & (cu[None, :-1] < tok1[:, None]), axis=1).astype(jnp.int32)

    quantized = k_scales is not None
    scales = ()
    if quantized:  # each row's scales in key order: [num_kv_heads, max_rows * key_blocks, block_len]
        table = jnp.pad(page_indices, ((0, 0), (0, key_blocks * pages_per_block - max_pages)))
        scales = tuple(x[:, table].reshape(num_kv_heads, max_rows * key_blocks, block_len)
                       for x in (k_scales, v_scales))
    kernel = functools.partial(_kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, groups=groups,
                               pages_per_block=pages_per_block, max_pages=max_pages,
                               window=window, align=align)
    block = pl.BlockSpec((None, block_rows, head_dim), lambda h, blk, *_: (h, blk, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    scale_bufs = [pltpu.VMEM((2, 1, block_len), jnp.float32)] * 2 if quantized else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_kv_heads, row_blocks),
            in_specs=[block] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(scales)),
            out_specs=block,
            scratch_shapes=[buf, buf, *scale_bufs, pltpu.SemaphoreType.DMA((4, 2)),
                            pltpu.VMEM((block_rows, 128), jnp.float32),
                            pltpu.VMEM((block_rows, 128), jnp.float32),
                            pltpu.VMEM((block_rows, head_dim), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=True if interpret == "generic" else pltpu.InterpretParams() if interpret else False,
    )(kv_lens, cu, page_indices.reshape(-1), first_row, end_row, qp, k_pages, v_pages, *scales)
    out = out[:, :total_rows].reshape(num_kv_heads, num_tokens, groups, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
