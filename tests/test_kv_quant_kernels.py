"""The kernels over a quantized KV cache (int8, fp8 codes with a float32 scale per token and KV
head): every CPU-runnable kernel against the float reference over the dequantized cache and
against attention over the unquantized K/V, the TPU and GPU lowerings, the GPU interpreter and
(marked gpu) the Mosaic GPU kernel; quantization itself and the cache are tests/test_kv_quant.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jserve.runtime.kv_cache import quantize_kv
from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention
from test_kv_quant import FP8, INT8, QUANT, SAME_CODES, dequantized
from test_paged_attention import NUM_KV_HEADS, dense_attention, make_cache

BACKENDS = ("reference", "cpu_pallas", "cpu")  # "cpu": the native kernel

# Against attention over the unquantized K/V (standard normal K/V and q, head_dim ** -0.5
# logits scale): the largest difference measured on this grid was 0.020 for int8 (each element
# within amax / 254) and 0.11 for fp8 (3 mantissa bits: within |x| / 16); the bounds leave 2x.
UNQUANTIZED = {INT8: dict(atol=0.04, rtol=0), FP8: dict(atol=0.2, rtol=0)}


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
    from test_paged_attention_gpu import _gpu_case, _gpu_rows

    rng = np.random.default_rng(tokens * 10 + splits)
    q_start, q_lens = _gpu_case(tokens)
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
