"""Batch-invariant mode (`EngineConfig.batch_invariant`): a request's tokens and logprobs are
bitwise the same alone, in any batch, chunked or not, with or without prefix-cache hits.

The engine tests run the real default model: at its sizes XLA:CPU's reductions and FMA
contractions do follow the step's shape (a token's norm at 8 rows differs from its norm at 4),
which the tiny test models' sizes hide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve.core.request import SamplingParams
from jserve.model.norms import fixed_order_sum, log_softmax, rms_norm, softmax
from pallas_kernels.native import paged_attention as native_attention


@pytest.mark.parametrize("n", [1, 2, 3, 64, 576, 1000, 49152])
def test_fixed_order_sum_is_the_sum_and_the_same_in_any_batch(n):
    x = np.random.default_rng(n).standard_normal((16, n)).astype(np.float32)
    got = np.asarray(jax.jit(fixed_order_sum)(jnp.asarray(x)))
    assert got.shape == (16, 1)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-3)
    for rows in (1, 3, 8):  # row 0 alone and among others, as a 2-D and a 3-D array
        np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order_sum)(jnp.asarray(x[:rows])))[0], got[0])
        np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order_sum)(jnp.asarray(x[None, :rows])))[0, 0],
                                      got[0])


def test_invariant_norm_and_softmaxes_agree_with_the_default_ones():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 576)).astype(np.float32) * 3)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(576).astype(np.float32))
    np.testing.assert_allclose(rms_norm(x, w, 1e-5, invariant=True), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log_softmax(x, True), jax.nn.log_softmax(x), atol=1e-5)
    np.testing.assert_allclose(softmax(x, True), jax.nn.softmax(x), atol=1e-6)


@pytest.mark.skipif(not native_attention.available(), reason="no C++ compiler for the native kernel")
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_attention_gives_a_token_the_same_output_in_any_call(window, dtype):
    """A decode query alone, among other rows, and as token t of a prefill chunk: bitwise one
    output in batch-invariant mode (the default mode differs here: split keys past 512, the
    decode path's order against the tiles', unaligned window blocks)."""
    rng = np.random.default_rng(0)
    kv_heads, groups, dim, pages, page = 3, 3, 64, 40, 64
    k = jnp.asarray(rng.standard_normal((kv_heads, pages, page, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, pages, page, dim)), dtype)
    table = jnp.asarray(np.arange(1, 17, dtype=np.int32)[None].repeat(4, 0))
    attend = jax.jit(lambda q, start, lens, t: native_attention.paged_attention_rows(
        q, k, v, start, lens, t, groups=groups, sm_scale=0.125, soft_cap=None, sliding_window=window,
        batch_invariant=True))
    for pos in (150, 700, 1000):
        q = rng.standard_normal((4, kv_heads, groups, dim)).astype(np.float32)
        alone = attend(q[:1], jnp.asarray([pos], jnp.int32), jnp.asarray([1], jnp.int32), table[:1])
        batch = attend(q, jnp.asarray([pos, 10, 300, 900], jnp.int32), jnp.ones(4, jnp.int32), table)
        np.testing.assert_array_equal(batch[:1], alone)
        for t in (0, 17, 39):  # token t of a 40-token chunk
            chunk = rng.standard_normal((1, kv_heads, 40 * groups, dim)).astype(np.float32)
            chunk[:, :, t * groups:(t + 1) * groups] = q[:1]
            out = attend(chunk, jnp.asarray([pos - t], jnp.int32), jnp.asarray([40], jnp.int32), table[:1])
            np.testing.assert_array_equal(out[:, :, t * groups:(t + 1) * groups], alone, err_msg=f"pos {pos} t {t}")


def test_refused_where_it_cannot_hold():
    from jserve.engine.config import EngineConfig
    from jserve.runtime import backends

    with pytest.raises(ValueError, match="XLA backends do not have a batch-invariant mode"):
        backends.create("xla-reference", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs the native matmuls"):
        backends.create("native", batch_invariant=True, native_matmuls=False)
    with pytest.raises(ValueError, match="batch_invariant and enable_lora"):
        EngineConfig(batch_invariant=True, enable_lora=True)


# ------------------------------------------------------------------------------ the engine

PROMPT_RNG = np.random.default_rng(7)
TARGET = [int(t) for t in PROMPT_RNG.integers(100, 40000, 150)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint):
    from jserve import LLM

    # 64 tokens a step: a 150-token prompt is chunked, more or less finely as other rows take
    # their share of the budget; prefix caching on: later prompts hit earlier ones' pages.
    with LLM(str(smollm2_checkpoint), dtype="float32", backend="native", batch_invariant=True, max_model_len=512,
             max_num_seqs=8, max_num_batched_tokens=64, warmup=False) as llm:
        yield llm


def _run(engine, target_params, others, delay):
    """The target request with `others` (prompt, max_tokens) added first; the target joins after
    `delay` steps. Its (token ids, logprobs, prompt logprobs)."""
    for i, (prompt, n) in enumerate(others):
        engine.add_request(f"o{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for _ in range(delay):
        engine.step()
    engine.add_request("target", TARGET, target_params)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                result = out
    c = result.outputs[0]
    logprobs = [next(iter(d.values())).logprob for d in c.logprobs]
    prompt = [next(iter(d.values())).logprob for d in (result.prompt_logprobs or [None])[1:]]
    return c.token_ids, logprobs, prompt


@pytest.fixture(scope="module")
def alone(llm):
    return {name: _run(llm.engine, params, [], 0) for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def test_the_invariant_model_is_the_model(llm, alone):
    """Bitwise invariance is only worth having on the right numbers: the target's prompt
    logprobs against the model's plain XLA forward over dense attention."""
    from flax import nnx

    from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
    from jserve.model.checkpoint import load_checkpoint

    config, params, *_ = load_checkpoint(llm.path, dtype="float32")
    model = nnx.merge(model_graphdef(config), model_params(config, params))
    positions = jnp.arange(len(TARGET), dtype=jnp.int32)[None]
    cache = init_cache(config.num_layers, 1, config.num_kv_heads, len(TARGET), config.head_dim)
    logits, _ = model(jnp.asarray([TARGET], jnp.int32), positions, cache, positions,
                      XlaOps(DenseAttention(config.sliding_window)))
    want = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))[np.arange(len(TARGET) - 1), TARGET[1:]]
    np.testing.assert_allclose(alone["greedy"][2], want, atol=2e-4)


def test_scored_sequences_are_bitwise_the_same_in_any_batch(llm, alone):
    """`LLM.token_logprobs` (the trainer's side of an RL loop) in invariant mode: the same bits
    alone, among other sequences, and as a generating request's prompt logprobs."""
    rng = np.random.default_rng(5)
    others = [[int(t) for t in rng.integers(100, 40000, n)] for n in (30, 90, 7)]
    single = llm.token_logprobs([TARGET])[0].logprobs
    batch = llm.token_logprobs([others[0], TARGET, *others[1:]])[1].logprobs
    np.testing.assert_array_equal(single, batch)
    np.testing.assert_array_equal(single, np.float32(alone["greedy"][2]))


others_strategy = st.lists(
    st.tuples(st.one_of(st.integers(1, 120), st.sampled_from([128, 140])),  # 128 / 140: the target's prefix
              st.integers(1, 16)),
    max_size=6)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(others=others_strategy, delay=st.integers(0, 3), seeded=st.booleans(), salt=st.integers(0, 10 ** 6))
def test_a_request_is_bitwise_the_same_in_any_batch(llm, alone, others, delay, seeded, salt):
    rng = np.random.default_rng(salt)
    prompts = [(TARGET[:n] if n in (128, 140) else [int(t) for t in rng.integers(100, 40000, n)], m)
               for n, m in others]
    got = _run(llm.engine, SEEDED if seeded else GREEDY, prompts, delay)
    want = alone["seeded" if seeded else "greedy"]
    assert got[0] == want[0]
    np.testing.assert_array_equal(np.float32(got[1]), np.float32(want[1]))
    np.testing.assert_array_equal(np.float32(got[2]), np.float32(want[2]))
