"""Paged attention kernels vs the jnp reference vs dense float64 attention over un-paged K/V."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import run_python
from pallas_kernels.native import paged_attention as native
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference, paged_prefill_attention

# "cpu" decodes with the native kernel (native/paged_attention.py), "cpu_pallas" with the Pallas
# interpret one.
CPU_BACKENDS = ("cpu", "cpu_pallas")

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
NUM_KV_HEADS = 2
MAX_PAGES = 4  # per sequence


def make_cache(rng, kv_lens, *, page_size, head_dim, dtype, num_kv_heads=NUM_KV_HEADS,
               max_pages=MAX_PAGES):
    """Contiguous K/V [batch, kv_heads, max_len, head_dim] and the same scattered into pages.

    Pages are a random permutation of 1..num_pages-1 (page 0 is the null page); slots past a
    row's length point at page 0, as the engine pads them.
    """
    batch = len(kv_lens)
    num_pages = batch * max_pages + 1
    shape = (batch, num_kv_heads, max_pages * page_size, head_dim)
    k = np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    v = np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, max_pages).astype(np.int32)
    for b, n in enumerate(kv_lens):
        table[b, -(-n // page_size):] = 0
    pool = rng.standard_normal((2, num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    for b in range(batch):
        for i, page in enumerate(table[b]):
            if page:
                pool[0, :, page] = k[b, :, i * page_size:(i + 1) * page_size]
                pool[1, :, page] = v[b, :, i * page_size:(i + 1) * page_size]
    k_pages, v_pages = (jnp.asarray(p, dtype) for p in pool)
    return k, v, k_pages, v_pages, jnp.asarray(table)


def dense_attention(q, k, v, q_start, q_lens, *, sm_scale, soft_cap=None, sliding_window=None):
    """float64 oracle. q [batch, tokens, heads, head_dim]; k, v [batch, kv_heads, len, head_dim]."""
    q, k, v = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (q, k, v))
    batch, tokens, num_heads, _ = q.shape
    groups = num_heads // k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(q_lens[b]):
            pos = q_start[b] + t
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                keys, vals = k[b, h // groups, lo:pos + 1], v[b, h // groups, lo:pos + 1]
                s = keys @ q[b, t, h] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[b, t, h] = p @ vals / p.sum()
    return out


def check(out, want, dtype):
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, **TOL[dtype])


# Each decode case runs one batch holding every interesting length: 0 (padded row), 1, exactly
# a page, a page plus one, a full table, and one random length.
DECODE_GRID = [  # head_dim, query heads per KV head, page_size, dtype
    (64, 1, 16, jnp.float32), (64, 3, 32, jnp.bfloat16), (128, 4, 16, jnp.bfloat16),
    (128, 8, 32, jnp.float32), (64, 8, 16, jnp.bfloat16), (128, 1, 32, jnp.bfloat16),
    (64, 4, 32, jnp.float32), (128, 3, 16, jnp.float32),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("head_dim,groups,page_size,dtype", DECODE_GRID)
def test_decode_matches_reference_and_dense(head_dim, groups, page_size, dtype, backend):
    rng = np.random.default_rng(head_dim * groups + page_size)
    full = MAX_PAGES * page_size
    lengths = np.array([0, 1, page_size, page_size + 1, full, rng.integers(2, full)], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=page_size,
                                               head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), NUM_KV_HEADS * groups, head_dim)), dtype)
    args = (q, k_pages, v_pages, jnp.asarray(lengths), table)
    sm_scale = head_dim ** -0.5
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           sm_scale=sm_scale)[:, 0]
    ref = paged_attention(*args, backend="reference", sm_scale=sm_scale)
    out = paged_attention(*args, backend=backend, sm_scale=sm_scale, pages_per_block=2)
    check(ref, want, dtype)
    check(out, want, dtype)
    assert not np.asarray(out[0].astype(jnp.float32)).any()  # length 0 -> zeros


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (20, 3.0), (None, 2.0)])
def test_decode_sliding_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(7)
    lengths = np.array([0, 1, 4, 16, 17, 40, 64], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=16, head_dim=64,
                                               dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 2 * NUM_KV_HEADS, 64)), jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           **kw)[:, 0]
    for backend in ("reference", *CPU_BACKENDS):
        check(paged_attention(q, k_pages, v_pages, jnp.asarray(lengths), table, backend=backend,
                              **kw), want, jnp.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_decode_work_list_spans_several_chunks(sliding_window, backend):
    # The CPU decode kernel walks (row, block) items `batch` at a time: with one page per block,
    # ragged lengths make many items, a partial last step and rows split across steps.
    rng = np.random.default_rng(11)
    lengths = np.array([0, 1, 64, 17, 33, 2, 0, 50, 16, 63], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=16, head_dim=64,
                                               dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 3 * NUM_KV_HEADS, 64)), jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window)
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           **kw)[:, 0]
    for pages_per_block in (1, 3):
        check(paged_attention(q, k_pages, v_pages, jnp.asarray(lengths), table, backend=backend,
                              pages_per_block=pages_per_block, **kw), want, jnp.float32)


PREFILL_CASES = {  # name: (q_start, q_lens) per row; kv length = q_start + q_lens
    "from_zero": ([0, 0], [9, 7]),
    "mid_way": ([16, 21, 5], [9, 3, 1]),  # prefix-cache hit / later chunk, and a decode-like row
    "padding": ([0, 30, 0], [4, 9, 0]),    # short chunk, full page table, padded row
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("groups,dtype,sliding_window,soft_cap",
                         [(1, jnp.float32, None, None), (4, jnp.bfloat16, None, None),
                          (3, jnp.float32, 6, 5.0)])
def test_prefill_matches_reference_and_dense(case, groups, dtype, sliding_window, soft_cap,
                                             backend):
    q_start, q_lens = (np.array(x, np.int32) for x in PREFILL_CASES[case])
    tokens, page_size, head_dim = 9, 8, 64
    rng = np.random.default_rng(len(case) + groups)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=page_size,
                                               head_dim=head_dim, dtype=dtype, max_pages=5)
    q = jnp.asarray(rng.standard_normal((len(q_lens), tokens, NUM_KV_HEADS * groups, head_dim)),
                    dtype)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(q, k, v, q_start, q_lens, **kw)
    args = (q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens), table)
    check(paged_prefill_attention(*args, backend="reference", **kw), want, dtype)
    check(paged_prefill_attention(*args, backend=backend, pages_per_block=2, **kw), want, dtype)


@pytest.mark.parametrize("head_dim,groups,dtype,sliding_window,soft_cap", [
    (64, 3, jnp.float32, None, None), (64, 3, jnp.float32, 40, None),
    (128, 1, jnp.bfloat16, None, 4.0), (80, 16, jnp.float32, 25, None),
    (36, 2, jnp.float32, None, None)])
def test_native_prefill_chunk_spans_several_tiles(head_dim, groups, dtype, sliding_window,
                                                  soft_cap):
    # The native kernel cuts a row's chunk into tiles of 64 // groups tokens against blocks of 64
    # keys: 70 tokens make 4 tiles at 3 groups, 2 at 1 group, 18 at 16. One row starts after a
    # cached prefix, one is cut short by q_lens. head_dim 80 takes the tiles' 8-wide tail, 36 is
    # no multiple of 8 and walks each token's keys alone.
    q_start, q_lens = np.array([0, 37, 5], np.int32), np.array([70, 70, 33], np.int32)
    rng = np.random.default_rng(head_dim + groups)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=16,
                                               head_dim=head_dim, dtype=dtype, max_pages=7)
    q = jnp.asarray(rng.standard_normal((3, 70, NUM_KV_HEADS * groups, head_dim)), dtype)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(q, k, v, q_start, q_lens, **kw)
    args = (q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens), table)
    check(paged_prefill_attention(*args, backend="cpu", **kw), want, dtype)
    assert native.TARGET in paged_prefill_attention.trace(*args, backend="cpu", **kw).lower().as_text()


@pytest.mark.parametrize("groups,dtype", [(1, jnp.float32), (2, jnp.float32), (1, jnp.bfloat16)])
def test_native_prefill_every_row_count_over_several_key_blocks(groups, dtype):
    # A tile's rows go through the key blocks 3, 2 or 1 at a time: chunks of 1 .. 9 tokens give
    # every row count modulo 3, and contexts past 64 keys give each a second key block, where a
    # row's sums are rescaled (a row accumulated twice is wrong only from there on).
    q_lens = np.arange(1, 10, dtype=np.int32)
    q_start = 150 - 7 * q_lens
    rng = np.random.default_rng(groups)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=16, head_dim=64,
                                               dtype=dtype, max_pages=10)
    q = jnp.asarray(rng.standard_normal((9, 9, NUM_KV_HEADS * groups, 64)), dtype)
    want = dense_attention(q, k, v, q_start, q_lens, sm_scale=0.125)
    check(paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens), table,
                                  backend="cpu", sm_scale=0.125), want, dtype)


def test_cpu_backend_runs_every_chunk_length_natively():
    pages = jax.ShapeDtypeStruct((2, 9, 16, 64), jnp.float32)
    per_row = jax.ShapeDtypeStruct((2,), jnp.int32)
    for tokens, heads, used in ((1, 4, True), (32, 4, True), (512, 4, True), (16, 34, False)):
        q = jax.ShapeDtypeStruct((2, tokens, heads, 64), jnp.float32)  # 34 heads: 17 groups
        hlo = paged_prefill_attention.trace(q, pages, pages, per_row, per_row,
                                            jax.ShapeDtypeStruct((2, 4), jnp.int32),
                                            backend="cpu", sm_scale=0.1).lower().as_text()
        assert (native.TARGET in hlo) == used, (tokens, heads)


def test_decode_is_one_token_prefill():
    rng = np.random.default_rng(3)
    lengths = np.array([5, 0, 33], np.int32)
    _, _, k_pages, v_pages, table = make_cache(rng, lengths, page_size=16, head_dim=64,
                                               dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    dec = paged_attention_reference(q, k_pages, v_pages, jnp.asarray(lengths), table, sm_scale=0.1)
    pre = paged_prefill_attention(q[:, None], k_pages, v_pages, jnp.asarray(np.maximum(lengths - 1, 0)),
                                  jnp.asarray(np.minimum(lengths, 1)), table, backend="cpu",
                                  sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(pre[:, 0]), np.asarray(dec), atol=1e-6)


def test_native_decode_kernel_builds_and_is_what_cpu_decode_runs():
    assert native.available(), native.unavailable_reason()
    k_pages = jax.ShapeDtypeStruct((2, 9, 16, 64), jnp.float32)
    args = (jax.ShapeDtypeStruct((4, 6, 64), jnp.float32), k_pages, k_pages,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 3), jnp.int32))
    for backend, used in (("cpu", True), ("cpu_pallas", False)):
        hlo = paged_attention.trace(*args, backend=backend, sm_scale=0.1).lower().as_text()
        assert (native.TARGET in hlo) == used, backend


@pytest.mark.parametrize("head_dim,groups", [(32, 16), (80, 2), (64, 17)])
def test_native_decode_other_head_dims_and_groups(head_dim, groups):
    # 32 and 80 take the kernel's generic head_dim loop; 17 groups exceed it (Pallas fallback).
    rng = np.random.default_rng(head_dim + groups)
    lengths = np.array([3, 0, 64, 17], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=16, head_dim=head_dim,
                                               dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, NUM_KV_HEADS * groups, head_dim)), jnp.float32)
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           sm_scale=0.2, soft_cap=5.0)[:, 0]
    assert native.supports(groups, head_dim) == (groups <= 16)
    check(paged_attention(q, k_pages, v_pages, jnp.asarray(lengths), table, backend="cpu",
                          sm_scale=0.2, soft_cap=5.0), want, jnp.float32)


@pytest.mark.parametrize("dtype,sliding_window,soft_cap", [
    (jnp.float32, None, None), (jnp.bfloat16, None, 4.0), (jnp.float32, 700, None)])
def test_native_decode_splits_long_rows(dtype, sliding_window, soft_cap):
    # Few rows x KV heads with long contexts split their keys over tasks (4 per pool thread, at
    # least 256 keys each) and merge the parts: one row of 1500 keys splits on any machine. The
    # other row is short (one part) and the third padded (zeros).
    rng = np.random.default_rng(5)
    lengths = np.array([1500, 40, 0], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=32, head_dim=64, dtype=dtype,
                                               max_pages=48)
    q = jnp.asarray(rng.standard_normal((3, 3 * NUM_KV_HEADS, 64)), dtype)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           **kw)[:, 0]
    out = paged_attention(q, k_pages, v_pages, jnp.asarray(lengths), table, backend="cpu", **kw)
    check(out, want, dtype)
    assert not np.asarray(out[2].astype(jnp.float32)).any()


def test_native_kernel_stays_inside_the_table_and_the_pool():
    # Out-of-contract inputs (a length past the table, page ids outside the pool) must not make
    # the C++ kernel read out of bounds: it stops at the table's end and reads page 0 instead.
    pages = jnp.ones((2, 5, 16, 64), jnp.float32)
    table = jnp.array([[1, 2], [10**6, -3]], jnp.int32)
    out = paged_attention(jnp.ones((2, 4, 64)), pages, pages, jnp.array([10**5, 20], jnp.int32), table,
                          backend="cpu", sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)
    out = paged_prefill_attention(jnp.ones((2, 40, 4, 64)), pages, pages,
                                  jnp.array([10**5, 3], jnp.int32), jnp.array([40, 40], jnp.int32),
                                  table, backend="cpu", sm_scale=0.1)  # tiles past the table too
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


def test_loading_the_native_kernel_keeps_subnormal_floats():
    # Linking with -ffast-math once pulled in crtfastmath.o, which set flush-to-zero process-wide
    # on load (hypothesis then refused to run in the same process).
    code = ("import sys\n"
            "from pallas_kernels.native import paged_attention as native\n"
            "assert native.available(), native.unavailable_reason()\n"
            "assert sys.float_info.min / 2 > 0, 'flush-to-zero is on'\n")
    run_python(code, os.environ["JSERVE_KERNEL_CACHE"])  # (the library as this run built it)


def test_without_a_compiler_the_cpu_backend_falls_back_to_pallas(tmp_path):
    code = (
        "import numpy as np, jax.numpy as jnp\n"
        "from pallas_kernels.native import paged_attention as native\n"
        "from pallas_kernels.paged_attention import paged_attention\n"
        "q = jnp.ones((2, 4, 64)); pages = jnp.ones((2, 5, 16, 64))\n"
        "out = paged_attention(q, pages, pages, jnp.array([3, 0], jnp.int32),\n"
        "                      jnp.array([[1, 2], [0, 0]], jnp.int32), backend='cpu', sm_scale=0.1)\n"
        "assert np.allclose(out[0], 1.0) and not np.asarray(out[1]).any()\n"
        "assert not native.available()\n"
        "print('REASON', native.unavailable_reason())\n")
    done = run_python(code, tmp_path, CXX="/bin/false")
    assert "REASON RuntimeError: /bin/false" in done.stdout
    assert done.stderr.count("native CPU attention kernel unavailable") == 1  # once, in the log


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_kernel_does_not_copy_the_page_pool(backend):
    k_pages = jax.ShapeDtypeStruct((2, 97, 16, 64), jnp.float32)
    args = (jax.ShapeDtypeStruct((4, 4, 64), jnp.float32), k_pages, k_pages,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 24), jnp.int32))
    hlo = paged_attention.trace(*args, backend=backend, sm_scale=0.1).lower().compile().as_text()
    copies = [line for line in hlo.splitlines() if "f32[2,97,16,64]" in line and " copy(" in line]
    assert not copies, copies


def test_tpu_kernel_in_tpu_interpret_mode():
    """One small case of the Mosaic kernel, run by the TPU interpreter (DMAs, semaphores)."""
    q_start, q_lens = np.array([0, 13, 40, 0], np.int32), np.array([6, 6, 1, 0], np.int32)
    rng = np.random.default_rng(11)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=8, head_dim=64,
                                               dtype=jnp.float32, max_pages=6)
    q = jnp.asarray(rng.standard_normal((4, 6, 2 * NUM_KV_HEADS, 64)), jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=10)
    want = dense_attention(q, k, v, q_start, q_lens, **kw)
    with pltpu.force_tpu_interpret_mode():
        out = paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(q_start),
                                      jnp.asarray(q_lens), table, backend="tpu",
                                      pages_per_block=2, **kw)
    check(out, want, jnp.float32)


@pytest.mark.parametrize("head_dim,groups,page_size,dtype,tokens", [
    (128, 1, 16, jnp.bfloat16, 1), (64, 3, 16, jnp.float32, 1), (128, 8, 32, jnp.bfloat16, 1),
    (64, 3, 16, jnp.bfloat16, 300),  # 900 rows: two row blocks of 512, rows padded
])
def test_tpu_kernel_lowers_for_tpu(head_dim, groups, page_size, dtype, tokens):
    """Pallas -> Mosaic lowering runs without a TPU; it catches unsupported ops and block shapes."""
    lowered = _lower("tpu", "tpu", head_dim, groups, page_size, dtype, tokens, table_width=8)
    assert "tpu_custom_call" in lowered


def _lower(backend, platform, head_dim, groups, page_size, dtype, tokens, table_width):
    """The text of `paged_prefill_attention` lowered for `platform` (soft cap and window on)."""
    sds = jax.ShapeDtypeStruct
    pages = sds((NUM_KV_HEADS, 33, page_size, head_dim), dtype)
    per_row, table = sds((4,), jnp.int32), sds((4, table_width), jnp.int32)
    q = sds((4, tokens, NUM_KV_HEADS * groups, head_dim), dtype)
    return paged_prefill_attention.trace(
        q, pages, pages, per_row, per_row, table, backend=backend, sm_scale=0.1, soft_cap=30.0,
        sliding_window=40).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((3, 4, 64), np.float32)), r"page_indices shape \(2, 4\) must have batch 3"),
    (dict(q=np.zeros((2, 5, 64), np.float32)), r"q has 5 heads \(shape \(2, 5, 64\)\)"),
    (dict(q=np.zeros((2, 4, 32), np.float32)), r"q head_dim 32"),
    (dict(q=np.zeros((2, 4), np.float32)), r"q must be a 3-D array, got shape \(2, 4\)"),
    (dict(lengths=np.zeros(2, np.float32)), r"lengths must have dtype int32, got float32"),
    (dict(lengths=np.zeros(3, np.int32)), r"lengths shape \(3,\) must be \(2,\)"),
    (dict(page_indices=np.zeros((2, 4), np.float32)), r"page_indices must have dtype int32"),
    (dict(v_pages=np.zeros((2, 9, 16, 32), np.float32)), r"v_pages \(2, 9, 16, 32\)"),
    (dict(k_pages=np.zeros((2, 9, 16), np.float32)), r"k_pages must be a 4-D array"),
    (dict(backend="cuda"), r"backend must be one of"),
    (dict(sliding_window=0), r"sliding_window must be a positive int"),
    (dict(pages_per_block=0), r"pages_per_block must be a positive int"),
])
def test_bad_input_raises_value_error_naming_it(bad, match):
    args = dict(q=np.zeros((2, 4, 64), np.float32), k_pages=np.zeros((2, 9, 16, 64), np.float32),
                v_pages=np.zeros((2, 9, 16, 64), np.float32), lengths=np.zeros(2, np.int32),
                page_indices=np.zeros((2, 4), np.int32), backend="reference", sm_scale=0.1)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)
