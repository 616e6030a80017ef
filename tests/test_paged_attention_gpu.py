"""The Mosaic GPU paged-attention kernel: its schedule in the GPU interpreter, its lowering for
CUDA (neither needs a GPU), and the `gpu` backend against dense attention on a GPU (marked `gpu`).
Shared helpers: tests/test_paged_attention.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention
from test_paged_attention import NUM_KV_HEADS, _lower, check, dense_attention, make_cache


def _gpu_case(tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_start, q_lens) of the GPU-interpreter cases: decode rows of lengths 0, 1, 16, 17, the
    full context and any, or (tokens > 1) chunks, a decode row and an empty row."""
    if tokens == 1:
        return np.array([0, 0, 15, 16, 127, 57], np.int32), np.array([0, 1, 1, 1, 1, 1], np.int32)
    return np.array([0, 13, 100, 0], np.int32), np.array([11, 8, 1, 0], np.int32)


def _gpu_rows(q, k_pages, v_pages, q_start, q_lens, table, **kw):
    """The Mosaic GPU kernel in the GPU interpreter (its matmuls in jnp: no wgmma there)."""
    from pallas_kernels.paged_attention import gpu
    from pallas_kernels.paged_attention.common import pack_rows, unpack_rows

    num_kv_heads = k_pages.shape[0]
    out = gpu.paged_attention_rows(pack_rows(q, num_kv_heads), k_pages, v_pages, q_start, q_lens,
                                   table, groups=q.shape[2] // num_kv_heads, interpret=True, **kw)
    return unpack_rows(out, q.shape[1])


@pytest.mark.parametrize("tokens,splits,stages,sliding_window,soft_cap", [
    (1, 1, 2, 40, None), (1, 3, 2, None, None), (1, 1, 3, None, 30.0), (11, 2, 2, None, None)])
def test_gpu_kernel_in_gpu_interpret_mode(tokens, splits, stages, sliding_window, soft_cap):
    """The Mosaic GPU kernel's paging, TMA pipeline, masks and key splits, run by the GPU
    interpreter on CPU; only the two matmuls differ from what the GPU runs (jnp, not wgmma)."""
    rng = np.random.default_rng(tokens * 10 + splits)
    q_start, q_lens = _gpu_case(tokens)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=16, head_dim=64,
                                               dtype=jnp.bfloat16, max_pages=8)
    q = jnp.asarray(rng.standard_normal((len(q_start), tokens, NUM_KV_HEADS * 3, 64)),
                    jnp.bfloat16)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(q, k, v, q_start, q_lens, **kw)
    out = _gpu_rows(q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens), table,
                    pages_per_block=4, stages=stages, splits=splits, **kw)
    check(out, want, jnp.bfloat16)
    assert not np.asarray(out[q_lens == 0].astype(jnp.float32)).any()


@pytest.mark.parametrize("head_dim,groups,page_size,dtype,tokens", [
    (128, 8, 16, jnp.bfloat16, 1), (64, 3, 32, jnp.float16, 1), (128, 4, 16, jnp.bfloat16, 300)])
def test_gpu_kernel_lowers_for_cuda(head_dim, groups, page_size, dtype, tokens):
    """Pallas -> Mosaic GPU lowering runs without a GPU; it catches unsupported ops, layouts and
    copy shapes (a 600-slot table: longer than one TMA box)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

    lowered = _lower("gpu", "cuda", head_dim, groups, page_size, dtype, tokens, table_width=600)
    assert "mosaic_gpu" in lowered


@pytest.mark.gpu
@pytest.mark.parametrize("max_pages", [4, 32])  # 32: 512 keys, split over several blocks
def test_gpu_backend_matches_reference(max_pages):
    rng = np.random.default_rng(5)
    lengths = np.array([0, 1, 16, 17, 64, max_pages * 16], np.int32)
    k, v, k_pages, v_pages, table = make_cache(rng, lengths, page_size=16, head_dim=128,
                                               dtype=jnp.bfloat16, max_pages=max_pages)
    q = jnp.asarray(rng.standard_normal((6, 8, 128)), jnp.bfloat16)
    want = dense_attention(q[:, None], k, v, np.maximum(lengths - 1, 0), np.minimum(lengths, 1),
                           sm_scale=0.1)[:, 0]
    out = paged_attention(q, k_pages, v_pages, jnp.asarray(lengths), table, backend="gpu",
                          sm_scale=0.1)
    check(out, want, jnp.bfloat16)
    assert not np.asarray(out[0].astype(jnp.float32)).any()


@pytest.mark.gpu
def test_gpu_backend_prefill_matches_dense():
    q_start, q_lens = np.array([0, 13, 100, 0], np.int32), np.array([40, 37, 1, 0], np.int32)
    rng = np.random.default_rng(6)
    k, v, k_pages, v_pages, table = make_cache(rng, q_start + q_lens, page_size=16, head_dim=64,
                                               dtype=jnp.bfloat16, max_pages=16)
    q = jnp.asarray(rng.standard_normal((4, 40, NUM_KV_HEADS * 3, 64)), jnp.bfloat16)
    kw = dict(sm_scale=0.125, sliding_window=50)
    out = paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(q_start), jnp.asarray(q_lens),
                                  table, backend="gpu", **kw)
    check(out, dense_attention(q, k, v, q_start, q_lens, **kw), jnp.bfloat16)
