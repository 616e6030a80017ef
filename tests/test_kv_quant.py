"""Quantized KV cache (int8, fp8 = float8_e4m3fn codes with a float32 scale per token and KV head):
quantization bounds, writes, every CPU-runnable kernel against the float reference over the
dequantized cache and against attention over the unquantized K/V, the layouts, the engine, the plan."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jserve.model.config import ModelConfig
from jserve.runtime.kv_cache import init_kv_pages, plan_memory, quantize_kv, slot_mapping, write_kv
from jserve.runtime.paged_attention import PagedAttention, PagedMeta
from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention
from test_paged_attention import NUM_KV_HEADS, dense_attention, make_cache

INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
QUANT = (INT8, FP8)
BACKENDS = ("reference", "cpu_pallas", "cpu")  # "cpu": the native kernel

# Kernel vs the float reference over the same codes (dequantized): float32 arithmetic in a
# different order, as test_paged_attention's float32 tolerance.
SAME_CODES = dict(atol=2e-5, rtol=2e-5)
# Against attention over the unquantized K/V (standard normal K/V and q, head_dim ** -0.5
# logits scale): the largest difference measured on this grid was 0.020 for int8 (each element
# within amax / 254) and 0.11 for fp8 (3 mantissa bits: within |x| / 16); the bounds leave 2x.
UNQUANTIZED = {INT8: dict(atol=0.04, rtol=0), FP8: dict(atol=0.2, rtol=0)}

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)


def dequantized(codes, scales):
    return np.asarray(codes.astype(jnp.float32)) * np.asarray(scales)[..., None]


@pytest.mark.parametrize("dtype", QUANT)
def test_quantize_round_trip_stays_within_the_dtype_bound(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 128)).astype(np.float32) * rng.uniform(1e-3, 30, (64, 3, 1))
    x[5, 1] = 0.0  # an all-zero row: scale 0, codes 0
    x[6, 0, 7] = 1e4  # one outlier: every other element of the row falls to few codes
    codes, scales = quantize_kv(jnp.asarray(x), dtype)
    assert codes.dtype == dtype and scales.dtype == jnp.float32 and scales.shape == (64, 3)
    back = dequantized(codes, scales)
    amax = np.abs(x).max(-1)
    qmax = 127.0 if dtype == INT8 else 448.0
    np.testing.assert_allclose(np.asarray(scales), amax / qmax, rtol=1e-6)
    assert scales[5, 1] == 0 and not np.asarray(codes[5, 1].astype(jnp.float32)).any()
    assert not np.isnan(back).any()
    # Every nonzero row uses the full code range: its largest element maps to +-qmax.
    live = amax > 0
    np.testing.assert_allclose(np.abs(np.asarray(codes.astype(jnp.float32))).max(-1)[live], qmax)
    scale = np.asarray(scales)[..., None]
    if dtype == INT8:
        bound = scale / 2 * (1 + 1e-5)  # round to nearest
    else:  # 3 mantissa bits: half an ulp is |x| / 16; subnormal codes: scale * 2**-10
        bound = np.maximum(np.abs(x) / 16, scale * 2.0 ** -10) * (1 + 1e-5)
    assert (np.abs(back - x) <= bound).all(), np.abs(back - x - bound).max()


@pytest.mark.parametrize("dtype", QUANT)
def test_write_kv_quantizes_each_token_and_head_into_its_slot(dtype):
    entry = init_kv_pages(TINY, 6, 4, dtype)[0]
    assert [a.dtype for a in entry] == [dtype, dtype, jnp.float32, jnp.float32]
    assert entry[2].shape == entry[0].shape[:3] == (2, 6, 4)
    page_ids = [5, 2, 3]
    slots = jnp.asarray(slot_mapping(page_ids, 2, 7, 4))  # tokens 2..8
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((7, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((7, 2, 16)) * 5, jnp.float32)
    k_pages, v_pages, k_scales, v_scales = jax.jit(write_kv)(*entry[:2], k, v, slots, *entry[2:])
    for new, pages, scales in ((k, k_pages, k_scales), (v, v_pages, v_scales)):
        want_codes, want_scales = quantize_kv(new, dtype)
        for t in range(7):
            page, off = page_ids[(2 + t) // 4], (2 + t) % 4
            np.testing.assert_array_equal(np.asarray(pages[:, page, off].astype(jnp.float32)),
                                          np.asarray(want_codes[t].astype(jnp.float32)))
            np.testing.assert_array_equal(scales[:, page, off], want_scales[t])
        assert float(jnp.abs(scales[:, [0, 1, 4]]).sum()) == 0.0
    with pytest.raises(ValueError, match="need k_scales"):
        write_kv(k_pages, v_pages, k, v, slots)
    with pytest.raises(ValueError, match="take no k_scales"):
        write_kv(k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), k, v, slots, k_scales, v_scales)
    folded = init_kv_pages(TINY, 6, 4, "fp8" if dtype == FP8 else "int8", layout="folded")
    assert len(folded) == 4 and folded[2].shape == (2, 12, 4)


def quantized_cache(rng, kv_lens, *, page_size, head_dim, dtype, max_pages=4):
    """make_cache's float K/V and pages, and the pages quantized: (k, v) unquantized contiguous,
    (kq, vq) the dequantized codes laid out as k and v, the table, and the quantized entry."""
    k, v, k_pages, v_pages, table = make_cache(rng, kv_lens, page_size=page_size, head_dim=head_dim,
                                               dtype=jnp.float32, max_pages=max_pages)
    k_codes, k_scales = quantize_kv(k_pages, dtype)
    v_codes, v_scales = quantize_kv(v_pages, dtype)
    gather = lambda pages: np.concatenate(  # noqa: E731 [kv_heads, pages..] -> [batch, kv_heads, len, D]
        [pages[:, np.asarray(table[b])].reshape(pages.shape[0], -1, head_dim)[None] for b in range(len(kv_lens))])
    kq, vq = gather(dequantized(k_codes, k_scales)), gather(dequantized(v_codes, v_scales))
    # Keys past a row's length come from page 0 in the gathered view, never attended: the same.
    return k, v, kq, vq, table, (k_codes, v_codes, k_scales, v_scales)


def check_both(out, want_dequantized, want_float, dtype):
    out = np.asarray(out, np.float64)
    np.testing.assert_allclose(out, want_dequantized, **SAME_CODES)
    np.testing.assert_allclose(out, want_float, **UNQUANTIZED[dtype])
    return np.abs(out - want_float).max()


DECODE_GRID = [  # head_dim, query heads per KV head, page_size, sliding window
    (64, 1, 16, None), (64, 4, 32, 20), (128, 3, 16, None), (128, 8, 32, None), (36, 2, 16, 9),
]


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("head_dim,groups,page_size,window", DECODE_GRID)
def test_decode_reads_quantized_pages(head_dim, groups, page_size, window, dtype):
    # head_dim 36: not a multiple of 8, the native kernel's one-token path (AttendOne).
    rng = np.random.default_rng(head_dim + groups + page_size)
    full = 4 * page_size
    lengths = np.array([0, 1, page_size, page_size + 1, full, rng.integers(2, full)], np.int32)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, lengths, page_size=page_size,
                                                            head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), NUM_KV_HEADS * groups, head_dim)), jnp.float32)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    q_start, q_lens = np.maximum(lengths - 1, 0), np.minimum(lengths, 1)
    want_q = dense_attention(q[:, None], kq, vq, q_start, q_lens, **kw)[:, 0]
    want_f = dense_attention(q[:, None], k, v, q_start, q_lens, **kw)[:, 0]
    for backend in BACKENDS:
        out = paged_attention(q, kc, vc, jnp.asarray(lengths), table, backend=backend, pages_per_block=2,
                              k_scales=ks, v_scales=vs, **kw)
        assert out.dtype == jnp.float32
        check_both(out, want_q, want_f, dtype)
        assert not np.asarray(out[0]).any()  # length 0 -> zeros


PREFILL_CASES = [  # q_start, q_lens, head_dim, groups, page_size, window
    ([0, 0], [9, 7], 64, 2, 16, None),
    ([16, 21, 5], [9, 3, 1], 128, 4, 16, 6),  # later chunks, a decode-like row
    ([0, 30, 0], [4, 9, 0], 64, 3, 8, None),  # full table, padded row
    ([3, 0], [40, 70], 128, 1, 32, 33),       # chunks past one native tile (64 rows)
]


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("q_start,q_lens,head_dim,groups,page_size,window", PREFILL_CASES)
def test_prefill_chunks_read_quantized_pages(q_start, q_lens, head_dim, groups, page_size, window, dtype):
    q_start, q_lens = np.array(q_start, np.int32), np.array(q_lens, np.int32)
    rng = np.random.default_rng(int(q_start.sum() + q_lens.sum()))
    max_pages = -(-int((q_start + q_lens).max()) // page_size)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, q_start + q_lens, page_size=page_size,
                                                            head_dim=head_dim, dtype=dtype, max_pages=max_pages)
    tokens = int(q_lens.max())
    q = jnp.asarray(rng.standard_normal((len(q_start), tokens, NUM_KV_HEADS * groups, head_dim)), jnp.float32)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    want_q = dense_attention(q, kq, vq, q_start, q_lens, **kw)
    want_f = dense_attention(q, k, v, q_start, q_lens, **kw)
    for backend in BACKENDS:
        out = paged_prefill_attention(q, kc, vc, jnp.asarray(q_start), jnp.asarray(q_lens), table,
                                      backend=backend, pages_per_block=2, k_scales=ks, v_scales=vs, **kw)
        check_both(out, want_q, want_f, dtype)


@pytest.mark.parametrize("dtype", QUANT)
def test_tpu_kernel_reads_quantized_pages_in_tpu_interpret_mode(dtype):
    q_start, q_lens = np.array([0, 13, 40, 0], np.int32), np.array([6, 6, 1, 0], np.int32)
    rng = np.random.default_rng(11)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, q_start + q_lens, page_size=8, head_dim=64,
                                                            dtype=dtype, max_pages=6)
    q = jnp.asarray(rng.standard_normal((4, 6, 2 * NUM_KV_HEADS, 64)), jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=10)
    with pltpu.force_tpu_interpret_mode():
        out = paged_prefill_attention(q, kc, vc, jnp.asarray(q_start), jnp.asarray(q_lens), table,
                                      backend="tpu", pages_per_block=2, k_scales=ks, v_scales=vs, **kw)
    check_both(out, dense_attention(q, kq, vq, q_start, q_lens, **kw),
               dense_attention(q, k, v, q_start, q_lens, **kw), dtype)


@pytest.mark.parametrize("dtype,q_dtype,tokens", [(INT8, jnp.bfloat16, 1), (FP8, jnp.float32, 1),
                                                  (INT8, jnp.bfloat16, 300)])
def test_tpu_kernel_with_quantized_pages_lowers_for_tpu(dtype, q_dtype, tokens):
    """Pallas -> Mosaic lowering (no TPU needed): the scale DMAs and buffers are well formed."""
    sds = jax.ShapeDtypeStruct
    pages, scales = sds((NUM_KV_HEADS, 33, 16, 128), dtype), sds((NUM_KV_HEADS, 33, 16), jnp.float32)
    per_row, table = sds((4,), jnp.int32), sds((4, 8), jnp.int32)
    q = sds((4, tokens, NUM_KV_HEADS * 4, 128), q_dtype)
    lowered = paged_prefill_attention.trace(
        q, pages, pages, per_row, per_row, table, backend="tpu", sm_scale=0.1, sliding_window=40,
        k_scales=scales, v_scales=scales).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in lowered


GPU_LOWER_CASES = [  # head_dim, groups, page_size, tokens, q dtype
    (128, 8, 16, 1, jnp.bfloat16), (64, 3, 32, 1, jnp.bfloat16), (256, 1, 8, 1, jnp.float16),
    (128, 4, 16, 300, jnp.bfloat16),  # 1200 rows: 19 row blocks of 64
    (64, 2, 8, 40, jnp.float32),      # float32 queries: the kernel computes in bfloat16
]


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("head_dim,groups,page_size,tokens,q_dtype", GPU_LOWER_CASES)
def test_gpu_kernel_with_quantized_pages_lowers_for_cuda(head_dim, groups, page_size, tokens, q_dtype, dtype):
    """Pallas -> Mosaic GPU lowering (no GPU needed): the one-byte TMA copies and tiles, the
    codes widened in registers, the scales' copies and column layout are well formed, and the
    gpu backend runs the Mosaic kernel for int8 / fp8 pages, not the XLA gather (a 600-slot
    table: longer than one TMA box)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

    sds = jax.ShapeDtypeStruct
    pages, scales = sds((NUM_KV_HEADS, 33, page_size, head_dim), dtype), sds((NUM_KV_HEADS, 33, page_size), jnp.float32)
    per_row, table = sds((4,), jnp.int32), sds((4, 600), jnp.int32)
    q = sds((4, tokens, NUM_KV_HEADS * groups, head_dim), q_dtype)
    kw = dict(backend="gpu", sm_scale=0.1, soft_cap=30.0, sliding_window=40, k_scales=scales, v_scales=scales)
    if tokens == 1:
        lowered = paged_attention.trace(q.update(shape=(4, NUM_KV_HEADS * groups, head_dim)), pages, pages, per_row,
                                        table, **kw)
    else:
        lowered = paged_prefill_attention.trace(q, pages, pages, per_row, per_row, table, **kw)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert lowered.out_info.dtype == q_dtype


def test_gpu_backend_sends_unsupported_quantized_pages_to_the_xla_reference_path():
    """head_dim 36 (not a multiple of 64): int8 pages run the reference's gather, which lowers
    for CUDA with no Mosaic call and computes the reference's result."""
    rng = np.random.default_rng(3)
    lengths = np.array([0, 5, 33], np.int32)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, lengths, page_size=16, head_dim=36, dtype=INT8)
    q = jnp.asarray(rng.standard_normal((3, 4 * NUM_KV_HEADS, 36)), jnp.float32)
    args = (q, kc, vc, jnp.asarray(lengths), table)
    kw = dict(sm_scale=0.125, k_scales=ks, v_scales=vs)
    lowered = paged_attention.trace(*args, backend="gpu", **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in lowered
    np.testing.assert_array_equal(paged_attention(*args, backend="gpu", **kw),
                                  paged_attention(*args, backend="reference", **kw))


BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # test_paged_attention's bfloat16 tolerance (the kernel's output is bf16)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("tokens,splits,sliding_window,soft_cap", [(1, 1, None, None), (1, 3, 40, None),
                                                                   (11, 2, None, 30.0)])
def test_gpu_kernel_reads_quantized_pages_in_gpu_interpret_mode(tokens, splits, sliding_window, soft_cap, dtype):
    """The Mosaic GPU kernel with int8 / fp8 pages in the GPU interpreter on CPU: the scale
    gather, its per-stage copies and where the scales apply (key scales on the scores, value
    scales on the probabilities); only the widening and the matmuls differ on a GPU (jnp there)."""
    from test_paged_attention import _gpu_rows

    rng = np.random.default_rng(tokens * 10 + splits)
    if tokens == 1:
        q_start = np.array([0, 0, 15, 16, 127, 57], np.int32)  # lengths 0, 1, 16, 17, full, any
        q_lens = np.array([0, 1, 1, 1, 1, 1], np.int32)
    else:
        q_start, q_lens = np.array([0, 13, 100, 0], np.int32), np.array([11, 8, 1, 0], np.int32)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, q_start + q_lens, page_size=16, head_dim=64,
                                                            dtype=dtype, max_pages=8)
    q = jnp.asarray(rng.standard_normal((len(q_start), tokens, NUM_KV_HEADS * 3, 64)), jnp.bfloat16)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    out = _gpu_rows(q, kc, vc, jnp.asarray(q_start), jnp.asarray(q_lens), table, pages_per_block=4,
                    splits=splits, k_scales=ks, v_scales=vs, **kw)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, dense_attention(q, kq, vq, q_start, q_lens, **kw), **BF16_TOL)
    np.testing.assert_allclose(out, dense_attention(q, k, v, q_start, q_lens, **kw), **UNQUANTIZED[dtype])
    assert not out[q_lens == 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("head_dim,groups,page_size,max_pages", [(128, 4, 16, 4), (128, 8, 16, 32), (64, 3, 32, 8),
                                                                 (256, 1, 16, 8)])
def test_gpu_kernel_with_quantized_pages_matches_reference_on_gpu(head_dim, groups, page_size, max_pages, dtype):
    """On a GPU: the Mosaic kernel over int8 / fp8 pages (decode, bf16 queries) against the
    reference over the same codes, at the bfloat16 kernel's tolerance."""
    rng = np.random.default_rng(head_dim + max_pages)
    lengths = np.array([0, 1, page_size, page_size + 1, 64, max_pages * page_size], np.int32)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, lengths, page_size=page_size, head_dim=head_dim,
                                                            dtype=dtype, max_pages=max_pages)
    q = jnp.asarray(rng.standard_normal((len(lengths), NUM_KV_HEADS * groups, head_dim)), jnp.bfloat16)
    kw = dict(sm_scale=head_dim ** -0.5, k_scales=ks, v_scales=vs)
    args = (q, kc, vc, jnp.asarray(lengths), table)
    assert "mosaic_gpu" in paged_attention.lower(*args, backend="gpu", **kw).as_text()
    out = paged_attention(*args, backend="gpu", **kw)
    assert out.dtype == jnp.bfloat16
    want = paged_attention(*args, backend="reference", **kw)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), **BF16_TOL)
    assert not np.asarray(out[0].astype(jnp.float32)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT)
def test_gpu_kernel_prefill_with_quantized_pages_matches_reference_on_gpu(dtype):
    q_start, q_lens = np.array([0, 13, 100, 0], np.int32), np.array([40, 37, 1, 0], np.int32)
    rng = np.random.default_rng(6)
    k, v, kq, vq, table, (kc, vc, ks, vs) = quantized_cache(rng, q_start + q_lens, page_size=16, head_dim=64,
                                                            dtype=dtype, max_pages=16)
    q = jnp.asarray(rng.standard_normal((4, 40, NUM_KV_HEADS * 3, 64)), jnp.bfloat16)
    kw = dict(sm_scale=0.125, sliding_window=50, soft_cap=30.0, k_scales=ks, v_scales=vs)
    args = (q, kc, vc, jnp.asarray(q_start), jnp.asarray(q_lens), table)
    out = paged_prefill_attention(*args, backend="gpu", **kw)
    want = paged_prefill_attention(*args, backend="reference", **kw)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), **BF16_TOL)


@pytest.mark.parametrize("bad,match", [
    (dict(k_scales=None), r"int8 pages need k_scales and v_scales"),
    (dict(v_scales=np.zeros((2, 9, 16), np.float16)), r"v_scales must have dtype float32"),
    (dict(k_scales=np.zeros((2, 9, 8), np.float32)), r"k_scales shape \(2, 9, 8\) must be k_pages' first three"),
    (dict(k_pages=np.zeros((2, 9, 16, 64), np.float32), v_pages=np.zeros((2, 9, 16, 64), np.float32)),
     r"k_scales given for float32 pages"),
    (dict(v_pages=np.zeros((2, 9, 16, 64), jnp.float8_e4m3fn)), r"v_pages .* must match"),
])
def test_bad_scales_raise_value_error_naming_them(bad, match):
    args = dict(q=np.zeros((2, 4, 64), np.float32), k_pages=np.zeros((2, 9, 16, 64), np.int8),
                v_pages=np.zeros((2, 9, 16, 64), np.int8), lengths=np.zeros(2, np.int32),
                page_indices=np.zeros((2, 4), np.int32), backend="reference", sm_scale=0.1,
                k_scales=np.zeros((2, 9, 16), np.float32), v_scales=np.zeros((2, 9, 16), np.float32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)


@pytest.mark.parametrize("kernel", ["reference", "cpu"])
def test_paged_attention_layouts_write_and_read_scales_alike(kernel):
    """Layer 1 of a 2-layer cache, per_layer and folded: the same output, the same codes and scales
    in layer 1's pages (the folded offset applies to the scales' page axis), layer 0 untouched."""
    num_pages, page = 5, 4
    rng = np.random.default_rng(2)
    B, T, K, H, D = 2, 3, TINY.num_kv_heads, TINY.num_heads, TINY.head_dim
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, D)), jnp.float32) for n in (H, K, K))
    table = np.array([[1, 2, 0], [3, 4, 0]], np.int32)
    slots = np.concatenate([slot_mapping(list(table[b]), 2, T, page) for b in range(B)])
    meta = PagedMeta(jnp.asarray(slots), jnp.asarray([2, 2], jnp.int32), jnp.asarray([T, T], jnp.int32),
                     jnp.asarray(table))
    outs = {}
    for layout in ("per_layer", "folded"):
        cache = init_kv_pages(TINY, num_pages, page, jnp.int8, layout=layout)
        attn = PagedAttention(kernel=kernel, kv_layout=layout, num_layers=2)
        out, cache = jax.jit(attn, static_argnums=0)(1, q, k, v, cache, meta)
        layer1 = cache[1] if layout == "per_layer" else tuple(a[:, num_pages:] for a in cache)
        layer0 = cache[0] if layout == "per_layer" else tuple(a[:, :num_pages] for a in cache)
        assert not any(np.asarray(a.astype(jnp.float32)).any() for a in layer0)
        outs[layout] = out, layer1
    (out_a, pages_a), (out_b, pages_b) = outs["per_layer"], outs["folded"]
    np.testing.assert_allclose(out_a, out_b, atol=1e-6)
    for a, b in zip(pages_a, pages_b):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    assert float(jnp.abs(pages_a[2]).sum()) > 0  # the scales were written
    # The queries attend K/V as written: dense attention over this step's dequantized K/V.
    kq = dequantized(*quantize_kv(k, jnp.int8)).transpose(0, 2, 1, 3)  # [B, K, T, D]
    vq = dequantized(*quantize_kv(v, jnp.int8)).transpose(0, 2, 1, 3)
    pad = np.zeros((B, K, 2, D), np.float32)  # positions 0, 1: never written, zeros in the pages
    want = dense_attention(q, np.concatenate([pad, kq], 2), np.concatenate([pad, vq], 2), [2, 2], [T, T],
                           sm_scale=D ** -0.5)
    np.testing.assert_allclose(np.asarray(out_a), want, **SAME_CODES)


def test_folded_int8_cache_is_written_in_place_by_the_scanned_step():
    """The XLA backend's decode step over an int8 cache: codes and scales carried through the
    layer loop, donated and aliased to the output (4 buffers), never copied."""
    from arch_helpers import load_arch
    from jserve.runtime.runner import Runner
    from test_backends import _decode_hlo

    config, params = load_arch("llama3")
    num_pages, page, K, L, D = 64, 4, config.num_kv_heads, config.num_layers, config.head_dim
    runner = Runner(config, params, num_pages=num_pages, page_size=page, max_model_len=32, backend="reference",
                    batch_buckets=(4,), token_buckets=(8,), max_num_batched_tokens=8, kv_dtype=jnp.int8)
    assert [a.shape for a in runner.kv] == [(K, L * num_pages, page, D)] * 2 + [(K, L * num_pages, page)] * 2
    hlo = _decode_hlo(runner, 4)
    for shape in (rf"s8\[{K},{L * num_pages},{page},{D}\]", rf"s8\[{K},{L * num_pages * page},{D}\]",
                  rf"f32\[{K},{L * num_pages},{page}\]", rf"f32\[{K},{L * num_pages * page}\]"):
        assert not [line for line in hlo.splitlines() if re.search(shape + r"\S* copy\(", line)], shape
    header = hlo.splitlines()[0]
    assert len(re.findall(r"\{\d+\}: \(\d+, \{\}, (?:may|must)-alias\)", header)) == 4, header


LLAMA31_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)


def test_plan_counts_codes_and_scales():
    # Per token: 2 (K, V) x 32 layers x 8 heads x (128 codes + a 4-byte scale).
    assert LLAMA31_8B.kv_bytes_per_token(1, 4) == 2 * 32 * 8 * 132
    kw = dict(weight_dtype_bytes=2, device_bytes=80 * 2**30, context=8192)
    bf16 = plan_memory(LLAMA31_8B, kv_dtype="bfloat16", **kw)
    for name in ("int8", "fp8", "float8_e4m3fn"):
        plan = plan_memory(LLAMA31_8B, kv_dtype=name, **kw)
        assert plan.kv_bytes_per_token == 2 * 32 * 8 * 132
        assert 1.9 < plan.num_pages / bf16.num_pages < 2.0  # 256 / 132 bytes per head and token


def test_plan_cli_with_int8_kv_shows_twice_the_pages(tmp_path, capsys):
    from jserve import cli

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}))
    pages = {}
    for kv in ("bfloat16", "int8", "fp8"):
        assert cli.main(["plan", "--model", str(tmp_path), "--device-memory", "80GiB", "--context", "8192",
                         "--kv-dtype", kv]) == 0
        out = capsys.readouterr().out
        pages[kv] = int(re.search(r"KV pages\D*([\d,]+)", out).group(1).replace(",", ""))
        if kv != "bfloat16":
            assert re.search(rf"KV per token \({kv}\)\s+66 KiB", out), out  # 67584 bytes
    assert 1.9 < pages["int8"] / pages["bfloat16"] < 2.0 and pages["fp8"] == pages["int8"]


def test_engine_with_int8_kv_follows_float32_greedy_and_fits_more_pages(smollm2_checkpoint):
    """The tiny smollm2-shaped model (random weights: logits std ~0.85 over 256 tokens, so close
    calls are common) with an int8 cache tracks float32's greedy tokens (measured: all 4 x 16 here
    equal; 78% of 16 x 24 on prompts of mixed lengths, every first token) in 3.2x the pages of
    float32 for the same bytes; the native backend (per-layer pages, the unfused layers with the
    native kernel) gives the XLA backend's tokens (folded pages)."""
    from conftest import DATA
    from jserve.core.request import SamplingParams
    from jserve.engine import EngineConfig, build_engine
    from jserve.model.checkpoint import read_params
    from jserve.text.tokenizer import Tokenizer

    config, params = read_params(DATA / "arch" / "smollm2")
    params = {k: jnp.asarray(v) for k, v in params.items()}
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    rng = np.random.default_rng(0)
    # Equal lengths: one prefill step and one decode shape, so each engine compiles two steps.
    prompts = [rng.integers(3, 256, 12).tolist() for _ in range(4)]
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**kw):
        settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=4,
                        kv_cache_bytes=2**20, backend="reference", warmup=False)
        engine = build_engine(config, params, tokenizer, [], EngineConfig(**{**settings, **kw}))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sampling)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return engine, [done[str(i)] for i in range(len(prompts))]

    f32_engine, f32 = run(kv_cache_dtype="float32")
    int8_engine, int8 = run(kv_cache_dtype="int8")
    assert [a.dtype for a in int8_engine.runner.kv] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    # 2 x 2 layers x 2 KV heads x (16 codes + a 4-byte scale) per token vs 16 float32s.
    assert int8_engine.runner.num_pages == 2**20 // (160 * 4)
    assert f32_engine.runner.num_pages == 2**20 // (512 * 4)
    assert [t[0] for t in int8] == [t[0] for t in f32]
    agree = sum(a == b for x, y in zip(int8, f32) for a, b in zip(x, y)) / sum(map(len, f32))
    assert agree >= 0.75, (agree, int8, f32)
    native_engine, native = run(kv_cache_dtype="int8", backend="cpu")
    assert [a.dtype for a in native_engine.runner.kv[1]] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    assert native == int8


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_int8_kv_on_a_mesh_gives_one_devices_tokens(smollm2_checkpoint):
    """dp=2, tp=2 over the XLA folded layout: the scales are sharded as their pages (KV heads over
    tp, pages over dp) and the tokens are one device's."""
    from conftest import DATA
    from jserve.core.request import SamplingParams
    from jserve.engine import EngineConfig, build_engine
    from jserve.model.checkpoint import read_params
    from jserve.text.tokenizer import Tokenizer

    config, params = read_params(DATA / "arch" / "smollm2")
    params = {k: jnp.asarray(v) for k, v in params.items()}
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, rng.integers(1, 40)).tolist() for _ in range(4)]

    def run(**kw):
        settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=4, num_pages=64,
                        backend="reference", kv_cache_dtype="int8", warmup=False)
        engine = build_engine(config, params, tokenizer, [], EngineConfig(**{**settings, **kw}))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return engine, [done[str(i)] for i in range(len(prompts))]

    engine, sharded = run(mesh="dp=2,tp=2")
    k_scales = engine.runner.kv[2]
    assert k_scales.ndim == 3 and tuple(k_scales.sharding.spec) == ("tp", "dp", None)
    assert sharded == run()[1]
