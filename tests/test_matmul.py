"""The native CPU matmul over packed weights against numpy in float64, and the packed
embedding's lookup."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_python
from pallas_kernels.matmul import native


@pytest.mark.parametrize("lead,k,n", [
    ((1,), 576, 576), ((16,), 576, 1536), ((2, 8), 1536, 576), ((5,), 64, 70), ((130,), 100, 48),
    ((3,), 7, 5), ((4,), 0, 24), ((513,), 40, 30)])
def test_packed_matches_numpy(lead, k, n):
    # Rows around the 4-row micro-kernel (tails of 1-3 rows), N around the 24-column panels
    # (padded with zero columns), K across several 128-row blocks, leading batch dims.
    rng = np.random.default_rng(k * 7 + n)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = native.pack(jnp.asarray(w))
    assert packed.shape == (-(-n // native.PANEL), k, native.PANEL)
    np.testing.assert_array_equal(np.asarray(native.unpack(packed, n)), w)
    out = jax.jit(native.matmul_packed, static_argnums=2)(x, packed, n)
    assert out.shape == (*lead, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5,
                               atol=1e-5 * max(k, 1) ** 0.5)


def test_embedding_rows_from_the_packed_transpose():
    # The runner's native head packs the embedding's transpose; the model's lookup reads the panels.
    from jserve.model.llama import embed_rows

    embed = jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), jnp.float32)
    tokens = jnp.array([[0, 23, 24, 49], [7, 7, 48, 1]], jnp.int32)
    packed = native.pack(embed.T)
    np.testing.assert_array_equal(np.asarray(embed_rows(packed, tokens)), np.asarray(embed)[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(embed_rows(embed, tokens)), np.asarray(embed)[np.asarray(tokens)])


def test_packed_refuses_bad_shapes():
    packed = native.pack(jnp.ones((8, 30)))
    with pytest.raises(ValueError, match=r"\(2, 9\) and \(2, 8, 24\)"):
        native.matmul_packed(jnp.ones((2, 9)), packed, 30)
    with pytest.raises(ValueError, match="n=49"):
        native.matmul_packed(jnp.ones((2, 8)), packed, 49)
    with pytest.raises(ValueError, match="2-D"):
        native.pack(jnp.ones((2, 3, 4)))


def test_without_a_compiler_it_says_why_once(tmp_path):
    code = ("from pallas_kernels.matmul import native\n"
            "assert not native.available() and not native.available()\n"
            "print('REASON', native.unavailable_reason())\n")
    done = run_python(code, tmp_path, CXX="/bin/false")
    assert "REASON RuntimeError: /bin/false" in done.stdout
    assert done.stderr.count("native CPU matmul unavailable, using XLA's dot") == 1
