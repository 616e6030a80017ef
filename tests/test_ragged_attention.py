"""Ragged paged attention (`pallas_kernels.paged_attention.ragged`): the XLA reference against a
dense float64 attention written here, the TPU kernel (in Pallas' TPU interpreter, and in the generic
interpreter as "cpu_pallas" runs it) and the "cpu" path against the reference on mixed batches, the
GPU kernel's schedule in the Mosaic GPU interpreter, both kernels lowered for their platforms with
jax.export, and input validation.

No test here needs a TPU or a GPU (the ids say mosaic_tpu / mosaic_cuda, not the bare marker words).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.paged_attention import ragged as ragged_mod
from pallas_kernels.paged_attention import ragged_paged_attention, ragged_tpu
from pallas_kernels.paged_attention.common import QUANT_MAX

INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
TOL = {jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
       jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2)}
NUM_KV_HEADS = 2
SM_SCALE = 0.125

# Rows as (new tokens, KV length): decode rows (1 token, short and long contexts, a context of
# exactly one token), prefill chunks of odd lengths from position 0, a chunk continuing a cached
# prefix (13 new tokens at positions 17..29, crossing page boundaries), a row of no new tokens,
# and a speculative-style row of 3 tokens.
MIXED = [(1, 5), (7, 7), (1, 20), (13, 30), (1, 1), (0, 9), (3, 11), (5, 12)]


def make_batch(rng, rows, *, page_size, head_dim=64, groups=2, dtype=jnp.float32, kv_dtype=None,
               max_rows=None, pad_tokens=3, max_pages=None):
    """The ragged inputs for `rows` [(q_len, kv_len)], plus each row's K/V as float64 [kv_heads,
    kv_len, head_dim] (what the pages hold, dequantized) for the dense oracle.

    Pages are a random permutation of 1..num_pages - 1 (page 0 is the null page, random too);
    unused table slots and the rows past len(rows) point at page 0; padding tokens of q are NaN.
    """
    max_rows = max_rows or len(rows)
    max_pages = max_pages or max(-(-kv // page_size) for _, kv in rows) + 1
    num_pages = max_rows * max_pages + 1
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    shape = (NUM_KV_HEADS, num_pages, page_size, head_dim)
    pool = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    scales = None
    if kv_dtype in (INT8, FP8):
        scales, codes = [], []
        for x in pool:
            s = np.abs(x).max(axis=-1) / QUANT_MAX[kv_dtype] + 1e-6
            c = x / s[..., None]
            c = jnp.asarray(np.round(c) if kv_dtype == INT8 else c).astype(kv_dtype)
            codes.append(c)
            scales.append(jnp.asarray(s, jnp.float32))
        pool_f = [np.asarray(c.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[..., None]
                  for c, s in zip(codes, scales)]
        pages = codes
    else:
        pages = [jnp.asarray(x, kv_dtype) for x in pool]
        pool_f = [np.asarray(p.astype(jnp.float32), np.float64) for p in pages]
    table = np.zeros((max_rows, max_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    kv_rows = []
    for r, (_, kv) in enumerate(rows):
        n = -(-kv // page_size)
        table[r, :n] = perm[r * max_pages:r * max_pages + n]
        kv_rows.append([p[:, table[r, :n]].reshape(NUM_KV_HEADS, -1, head_dim)[:, :kv] for p in pool_f])
    q_lens = [ql for ql, _ in rows]
    total = sum(q_lens)
    cu = np.full(max_rows + 1, total, np.int32)
    cu[:len(rows) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens = np.zeros(max_rows, np.int32)
    kv_lens[:len(rows)] = [kv for _, kv in rows]
    q = rng.standard_normal((total + pad_tokens, NUM_KV_HEADS * groups, head_dim)).astype(np.float32)
    q[total:] = np.nan
    args = (jnp.asarray(q, dtype), pages[0], pages[1], jnp.asarray(kv_lens), jnp.asarray(table),
            jnp.asarray(cu), jnp.asarray([len(rows)], jnp.int32))
    kw = {} if scales is None else dict(k_scales=scales[0], v_scales=scales[1])
    return args, kw, kv_rows


def dense(q, rows, kv_rows, *, soft_cap=None, sliding_window=None):
    """float64 oracle over each row's un-paged K/V: token i of row r at position kv_len - q_len + i."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    groups = q.shape[1] // NUM_KV_HEADS
    out = np.zeros_like(q)
    t = 0
    for (q_len, kv_len), (k, v) in zip(rows, kv_rows):
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                s = k[h // groups, lo:pos + 1] @ q[t + i, h] * SM_SCALE
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[t + i, h] = p @ v[h // groups, lo:pos + 1] / p.sum()
        t += q_len
    return out


def as_f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def check_padding_zero(out, rows):
    pad = np.asarray(out[sum(q for q, _ in rows):].astype(jnp.float32))
    assert np.isfinite(pad).all() and not pad.any()


@pytest.mark.parametrize("kv_dtype,soft_cap,sliding_window", [
    (None, None, None), (None, 20.0, 6), (INT8, None, None), (FP8, 5.0, 9)])
def test_reference_matches_dense(kv_dtype, soft_cap, sliding_window):
    rng = np.random.default_rng(1)
    args, kw, kv_rows = make_batch(rng, MIXED, page_size=8, groups=2, kv_dtype=kv_dtype, max_rows=10)
    out = ragged_paged_attention(*args, backend="reference", sm_scale=SM_SCALE, soft_cap=soft_cap,
                                 sliding_window=sliding_window, **kw)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    want = dense(args[0], MIXED, kv_rows, soft_cap=soft_cap, sliding_window=sliding_window)
    np.testing.assert_allclose(as_f64(out), want, atol=1e-5, rtol=1e-5)
    check_padding_zero(out, MIXED)


# (rows, groups, page_size, q dtype, pages dtype, soft cap, sliding window, padded max_rows)
GRID = {
    "mixed-f32-g1-p8": (MIXED, 1, 8, jnp.float32, None, None, None, 10),
    "mixed-bf16-g2-p16-window": (MIXED, 2, 16, jnp.bfloat16, None, None, 7, 8),
    "mixed-bf16-g4-p8-cap": (MIXED, 4, 8, jnp.bfloat16, None, 30.0, None, 12),
    "decode-heavy-f32-g4-p16": ([(1, n) for n in (3, 17, 40, 1, 16, 33, 9, 25, 2, 48)] + [(9, 20)],
                                4, 16, jnp.float32, None, None, None, 16),
    "int8-bf16-g2-p16": (MIXED, 2, 16, jnp.bfloat16, INT8, None, 10, 8),
    "fp8-f32-g4-p8": (MIXED, 4, 8, jnp.float32, FP8, 10.0, 5, 9),
    "one-long-chunk-f32-g2-p8": ([(37, 45), (1, 3)], 2, 8, jnp.float32, None, None, 12, 4),
}


# "tpu_interpreter": the TPU kernel in Pallas' TPU interpreter (simulated DMAs and semaphores,
# NaN-filled VMEM), the strict check; "cpu_pallas" runs the same kernel in the generic interpreter.
@pytest.mark.parametrize("backend", ["cpu_pallas", "tpu_interpreter", "cpu"])
@pytest.mark.parametrize("case", list(GRID))
def test_backends_match_reference(case, backend):
    rows, groups, page_size, dtype, kv_dtype, soft_cap, sliding_window, max_rows = GRID[case]
    rng = np.random.default_rng(len(case))
    args, kw, kv_rows = make_batch(rng, rows, page_size=page_size, groups=groups, dtype=dtype,
                                   kv_dtype=kv_dtype, max_rows=max_rows)
    opts = dict(sm_scale=SM_SCALE, soft_cap=soft_cap, sliding_window=sliding_window, **kw)
    if backend == "tpu_interpreter":
        out = ragged_tpu.ragged_paged_attention_tpu(*args, interpret="tpu", **opts)
    else:
        out = ragged_paged_attention(*args, backend=backend, **opts)
    want = ragged_paged_attention(*args, backend="reference", **opts)
    assert out.shape == args[0].shape and out.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(as_f64(out), as_f64(want), **TOL[jnp.dtype(dtype)])
    check_padding_zero(out, rows)
    # and the reference itself is right on this case (looser in bf16: q is rounded)
    dense_tol = TOL[jnp.dtype(dtype)] if kv_dtype is None or dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(as_f64(want), dense(args[0], rows, kv_rows, soft_cap=soft_cap,
                                                   sliding_window=sliding_window), **dense_tol)


# The TPU kernel with small blocks: q blocks of 16-32 packed rows hold several rows, rows span
# several blocks, blocks start inside a token (groups 3), rows take the small window or the
# whole block, and key blocks of 1-3 pages.
@pytest.mark.parametrize("block_rows,pages_per_block,groups,dtype,kv_dtype,sliding_window", [
    (16, 2, 2, jnp.float32, None, None), (32, 1, 3, jnp.float32, None, 6),
    (32, 3, 4, jnp.float32, INT8, None), (64, 2, 2, jnp.bfloat16, None, 9),
    (32, 2, 1, jnp.bfloat16, FP8, 4),
], ids=["b16-g2", "b32-g3-window", "b32-g4-int8", "b64-g2-bf16-window", "b32-g1-fp8-window"])
def test_tpu_kernel_small_blocks_in_interpret_mode(block_rows, pages_per_block, groups, dtype,
                                                   kv_dtype, sliding_window):
    rng = np.random.default_rng(block_rows + groups)
    args, kw, kv_rows = make_batch(rng, MIXED, page_size=8, groups=groups, dtype=dtype,
                                   kv_dtype=kv_dtype, max_rows=9)
    out = ragged_tpu.ragged_paged_attention_tpu(
        *args, sm_scale=SM_SCALE, soft_cap=None, sliding_window=sliding_window,
        block_rows=block_rows, pages_per_block=pages_per_block, interpret=True, **kw)
    want = ragged_paged_attention(*args, backend="reference", sm_scale=SM_SCALE,
                                  sliding_window=sliding_window, **kw)
    np.testing.assert_allclose(as_f64(out), as_f64(want), **TOL[jnp.dtype(dtype)])
    check_padding_zero(out, MIXED)


def test_padding_rows_and_tokens_are_zeros_and_rows_past_num_rows_ignored():
    """num_rows = 3 of 5 filled rows: the last two rows' tokens are padding too (zeros), even
    with their pages and lengths set; an empty batch (num_rows 0) is all zeros."""
    rng = np.random.default_rng(7)
    rows = [(2, 6), (1, 9), (4, 4), (3, 12), (1, 5)]
    args, kw, kv_rows = make_batch(rng, rows, page_size=8, groups=2, max_rows=6)
    args = list(args)
    q = np.array(args[0])
    q[7:] = rng.standard_normal(q[7:].shape)  # real-looking values in the dropped rows' tokens
    args[0], args[6] = jnp.asarray(q), jnp.asarray([3], jnp.int32)
    want = dense(args[0], rows[:3], kv_rows[:3])
    for backend in ("reference", "cpu", "cpu_pallas"):
        out = np.asarray(ragged_paged_attention(*args, backend=backend, sm_scale=SM_SCALE))
        np.testing.assert_allclose(out[:7], want[:7], atol=2e-5, rtol=2e-5)
        assert not out[7:].any(), backend
        args0 = list(args)
        args0[6] = jnp.asarray([0], jnp.int32)
        empty = np.asarray(ragged_paged_attention(*args0, backend=backend, sm_scale=SM_SCALE))
        assert np.isfinite(empty).all() and not empty.any(), backend


def test_work_list_covers_every_live_token_once():
    rng = np.random.default_rng(3)
    args, _, _ = make_batch(rng, MIXED, page_size=8, max_rows=10, pad_tokens=5)
    q, _, _, kv_lens, _, cu, num_rows = args
    for tile in (1, 4, 16):
        tiles = ragged_mod.tile_rows(kv_lens, cu, num_rows, q.shape[0], tile)
        assert tiles.tokens.shape[0] == ragged_mod.max_items(q.shape[0], 10, tile)
        lens = np.asarray(tiles.q_lens)
        tokens = np.concatenate([np.asarray(tiles.tokens)[i, :n] for i, n in enumerate(lens)])
        assert sorted(tokens.tolist()) == list(range(sum(q for q, _ in MIXED)))
        # a decode row is one item; a chunk of n tokens ceil(n / tile) items
        assert (lens > 0).sum() == sum(-(-ql // tile) for ql, _ in MIXED)
        # each live token's output slot is the item slot that holds it; padding tokens are not live
        live = np.asarray(tiles.live)
        assert live.tolist() == [p < len(tokens) for p in range(q.shape[0])]
        slots = np.asarray(tiles.slot)[live]
        np.testing.assert_array_equal(np.asarray(tiles.tokens).reshape(-1)[slots], np.arange(len(tokens)))


@pytest.mark.parametrize("kv_dtype,sliding_window,soft_cap", [
    (jnp.bfloat16, 40, None), (INT8, None, 30.0)], ids=["bf16-window", "int8-cap"])
def test_gpu_schedule_in_mosaic_gpu_interpret_mode(kv_dtype, sliding_window, soft_cap):
    """The GPU path (work list + gpu.py's kernel) run by the Mosaic GPU interpreter: only the
    matmuls differ from the device (jnp, not wgmma)."""
    rows = [(1, 5), (40, 40), (1, 70), (13, 30), (0, 3), (21, 64)]
    rng = np.random.default_rng(4)
    args, kw, kv_rows = make_batch(rng, rows, page_size=16, groups=4, dtype=jnp.bfloat16,
                                   kv_dtype=kv_dtype, max_rows=8)
    out = ragged_mod.ragged_paged_attention_gpu(*args, sm_scale=SM_SCALE, soft_cap=soft_cap,
                                                sliding_window=sliding_window, interpret=True, **kw)
    assert out.dtype == jnp.bfloat16
    want = dense(args[0], rows, kv_rows, soft_cap=soft_cap, sliding_window=sliding_window)
    np.testing.assert_allclose(as_f64(out), want, atol=3e-2, rtol=3e-2)
    check_padding_zero(out, rows)


def test_gpu_backend_falls_back_to_the_reference_for_float32_pages():
    rng = np.random.default_rng(5)
    args, kw, kv_rows = make_batch(rng, MIXED, page_size=8, groups=2, max_rows=8)
    out = ragged_paged_attention(*args, backend="gpu", sm_scale=SM_SCALE)  # f32: not the kernel's
    np.testing.assert_allclose(as_f64(out), dense(args[0], MIXED, kv_rows), atol=2e-5, rtol=2e-5)


def _export(platform, backend, head_dim, page_size, groups, kv_dtype, tokens=160, max_rows=24,
            width=70):
    sds = jax.ShapeDtypeStruct
    pages = sds((NUM_KV_HEADS, 300, page_size, head_dim), kv_dtype)
    kw = {}
    if jnp.dtype(kv_dtype) in (INT8, FP8):
        kw = dict(k_scales=sds(pages.shape[:3], jnp.float32), v_scales=sds(pages.shape[:3], jnp.float32))
    args = (sds((tokens, NUM_KV_HEADS * groups, head_dim), jnp.bfloat16), pages, pages,
            sds((max_rows,), jnp.int32), sds((max_rows, width), jnp.int32),
            sds((max_rows + 1,), jnp.int32), sds((1,), jnp.int32))

    def f(*a, **k):
        return ragged_paged_attention(*a, backend=backend, sm_scale=0.1, soft_cap=30.0,
                                      sliding_window=50, **k)
    return export.export(jax.jit(f), platforms=(platform,))(*args, **kw).mlir_module()


@pytest.mark.parametrize("head_dim,page_size,groups,kv_dtype", [
    (64, 16, 2, jnp.bfloat16), (128, 64, 4, jnp.bfloat16), (128, 16, 8, INT8), (64, 64, 1, FP8),
    (128, 16, 3, jnp.bfloat16)])
@pytest.mark.parametrize("platform", ["mosaic_tpu", "mosaic_cuda"])
def test_kernels_lower_with_jax_export(platform, head_dim, page_size, groups, kv_dtype):
    """Pallas -> Mosaic (TPU) / Mosaic GPU lowering runs without the device: it catches
    unsupported ops, block shapes and copy shapes (Mosaic's own TPU passes run only on a TPU)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

    target, backend, marker = {"mosaic_tpu": ("tpu", "tpu", "tpu_custom_call"),
                               "mosaic_cuda": ("cuda", "gpu", "mosaic_gpu")}[platform]
    text = _export(target, backend, head_dim, page_size, groups, kv_dtype)
    assert marker in text


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((8, 4), np.float32)), r"q must be a 3-D array, got shape \(8, 4\)"),
    (dict(q=np.zeros((8, 4, 64), np.int32)), r"q must have a float dtype, got int32"),
    (dict(q=np.zeros((8, 5, 64), np.float32)), r"q has 5 heads \(shape \(8, 5, 64\)\)"),
    (dict(q=np.zeros((8, 4, 32), np.float32)), r"q head_dim 32"),
    (dict(kv_lens=np.zeros(4, np.float32)), r"kv_lens must have dtype int32, got float32"),
    (dict(kv_lens=np.zeros(5, np.int32)), r"kv_lens shape \(5,\) must be \(4,\)"),
    (dict(cu_q_lens=np.zeros(4, np.int32)), r"cu_q_lens shape \(4,\) must be \(5,\)"),
    (dict(num_rows=np.zeros(2, np.int32)), r"num_rows shape \(2,\) must be \(1,\)"),
    (dict(num_rows=np.int32(1)), r"num_rows must be a 1-D array"),
    (dict(page_indices=np.zeros((4, 3), np.float32)), r"page_indices must have dtype int32"),
    (dict(v_pages=np.zeros((2, 9, 16, 32), np.float32)), r"v_pages \(2, 9, 16, 32\)"),
    (dict(k_pages=np.zeros((2, 9, 16), np.float32)), r"k_pages must be a 4-D array"),
    (dict(k_scales=np.zeros((2, 9, 16), np.float32)), r"k_scales given for float32 pages"),
    (dict(backend="cuda"), r"backend must be one of"),
    (dict(sm_scale=0.0), r"sm_scale must be > 0"),
    (dict(soft_cap=-1.0), r"soft_cap must be > 0"),
    (dict(sliding_window=0), r"sliding_window must be a positive int"),
])
def test_bad_input_raises_value_error_naming_it(bad, match):
    args = dict(q=np.zeros((8, 4, 64), np.float32), k_pages=np.zeros((2, 9, 16, 64), np.float32),
                v_pages=np.zeros((2, 9, 16, 64), np.float32), kv_lens=np.zeros(4, np.int32),
                page_indices=np.zeros((4, 3), np.int32), cu_q_lens=np.zeros(5, np.int32),
                num_rows=np.ones(1, np.int32), backend="reference", sm_scale=0.1)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**args)


def test_quantized_pages_need_their_scales():
    codes = np.zeros((2, 9, 16, 64), np.int8)
    with pytest.raises(ValueError, match="int8 pages need k_scales and v_scales"):
        ragged_paged_attention(np.zeros((8, 4, 64), np.float32), codes, codes, np.zeros(4, np.int32),
                               np.zeros((4, 3), np.int32), np.zeros(5, np.int32), np.ones(1, np.int32),
                               backend="reference", sm_scale=0.1)
