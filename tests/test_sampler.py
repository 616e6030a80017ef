"""The on-device sampler: filters, seeds, penalties, against numpy arithmetic."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.core.request import SamplingParams
from jserve.runtime.sampler import SamplingArrays, apply_penalties, argmax, penalty_history, sample, token_counts

V = 8


def _row(temperature, top_k, top_p, min_p, seed, step, repetition=1.0, presence=0.0, frequency=0.0, logprobs=0):
    """A row's `(SamplingParams, step)` from its settings in a line."""
    return (SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                           repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                           logprobs=logprobs or None), step)


def _sample(logits, rows, penalties=None):
    arrays = SamplingArrays.build([_row(*r) for r in rows], len(rows))
    return sample(jnp.asarray(logits, jnp.float32), arrays, penalties=penalties, num_logprobs=3)


def test_argmax_is_numpys_first_maximum():
    rng = np.random.RandomState(0)
    x = rng.randint(-3, 4, (64, 37)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    b = rng.rand(16, 50) > 0.8
    b[3] = False  # no True: index 0, as argmax
    np.testing.assert_array_equal(argmax(jnp.asarray(b)), np.argmax(b, axis=-1))
    x = rng.randn(4, 49152).astype(np.float32)
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    # widths that are not a multiple of the 512-wide pieces: padded; ties across pieces
    x = rng.randint(-3, 4, (32, 5000)).astype(np.float32)
    x[5, 4999] = 9.0  # the maximum in the padded last piece
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    b = rng.rand(16, 5000) > 0.999
    b[3] = False
    np.testing.assert_array_equal(argmax(jnp.asarray(b)), np.argmax(b, axis=-1))
    assert all(0 <= i < 5000 for i in argmax(jnp.full((2, 5000), np.nan, np.float32)).tolist())


def test_filters_reduce_to_argmax_at_their_limits():
    logits = np.random.default_rng(0).normal(size=(4, V)).astype(np.float32)
    rows = [(1.0, 1, 1.0, 0.0, s, 0) for s in range(4)]  # top_k=1
    assert np.asarray(_sample(logits, rows)["tokens"]).tolist() == logits.argmax(-1).tolist()
    rows = [(1.0, 0, 1e-6, 0.0, s, 0) for s in range(4)]  # tiny top_p
    assert np.asarray(_sample(logits, rows)["tokens"]).tolist() == logits.argmax(-1).tolist()
    rows = [(1.0, 0, 1.0, 1.0, s, 0) for s in range(4)]  # min_p = 1
    assert np.asarray(_sample(logits, rows)["tokens"]).tolist() == logits.argmax(-1).tolist()


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]) + 1e-12).astype(np.float32)
    n = 2000
    rows = [(1.0, 3, 1.0, 0.0, 7, step) for step in range(n)]  # top_k=3 renormalises 0.4/0.3/0.2
    tokens = np.asarray(_sample(np.tile(logits, (n, 1)), rows)["tokens"])
    freq = np.bincount(tokens, minlength=V) / n
    np.testing.assert_allclose(freq[:3], np.array([4, 3, 2]) / 9, atol=0.04)
    assert freq[3:].sum() == 0
    rows = [(1.0, 0, 0.65, 0.0, 7, step) for step in range(n)]  # top_p 0.65 keeps 0.4 and 0.3
    tokens = np.asarray(_sample(np.tile(logits, (n, 1)), rows)["tokens"])
    assert set(tokens.tolist()) == {0, 1}


def test_same_seed_and_step_give_the_same_token_whatever_the_row():
    logits = np.zeros((3, V), np.float32)
    a = _sample(logits, [(1.0, 0, 1.0, 0.0, 11, 5), (1.0, 0, 1.0, 0.0, 3, 0), (1.0, 0, 1.0, 0.0, 11, 5)])
    b = _sample(logits[:1], [(1.0, 0, 1.0, 0.0, 11, 5)])
    assert int(a["tokens"][0]) == int(a["tokens"][2]) == int(b["tokens"][0])


def test_penalties_match_vllm_arithmetic():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    history, num_prompt = penalty_history([([1, 2], [2, 3, 3]), None], 2, 10, V)
    counts, in_prompt = (np.asarray(a) for a in token_counts(jnp.asarray(history), jnp.asarray(num_prompt), V))
    np.testing.assert_array_equal(counts[0], [0, 0, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(in_prompt[0], [0, 1, 1, 0, 0, 0, 0, 0])
    assert counts[1].sum() == 0 and in_prompt[1].sum() == 0
    rep, pres = np.array([1.5, 1.5], np.float32), np.array([0.5, 0.5], np.float32)
    freq = np.array([0.25, 0.25], np.float32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), counts, in_prompt, rep, pres, freq))
    want = logits.copy()
    for t in (1, 2, 3):
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    want[0] -= 0.25 * counts[0] + 0.5 * (counts[0] > 0)
    np.testing.assert_allclose(got, np.stack([want[0], logits[1]]), rtol=1e-6)


def test_logprobs_are_of_the_raw_distribution_even_with_penalties():
    logits = np.array([[2.0, 1.0, 0.0, -1.0, -2, -3, -4, -5]], np.float32)
    history, num_prompt = penalty_history([([0], [0])], 1, 4, V)
    out = _sample(logits, [(0.0, 0, 1.0, 0.0, 0, 1, 10.0, 2.0, 2.0, 1)],
                  (jnp.asarray(history), jnp.asarray(num_prompt)))
    assert int(out["tokens"][0]) == 1  # token 0 penalised away
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    np.testing.assert_allclose(float(out["logprob"][0]), raw[1], rtol=1e-5)
    assert int(out["rank"][0]) == 2


def test_logprobs_are_computed_only_when_a_row_wants_them():
    logits = np.random.default_rng(2).normal(size=(3, V)).astype(np.float32)
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    none = _sample(logits, [(0.0, 0, 1.0, 0.0, 0, 0)] * 3)  # no row asks: zeros, same tokens
    one = _sample(logits, [(0.0, 0, 1.0, 0.0, 0, 0)] * 2 + [(0.0, 0, 1.0, 0.0, 0, 0, 1.0, 0.0, 0.0, 1)])
    assert np.asarray(none["tokens"]).tolist() == np.asarray(one["tokens"]).tolist() == logits.argmax(-1).tolist()
    for key in ("logprob", "rank", "top_ids", "top_logprobs"):
        assert not np.asarray(none[key]).any(), key
    # One row asking computes them for the whole batch (the rows that did not ask ignore them).
    np.testing.assert_allclose(np.asarray(one["logprob"]), raw.max(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(one["top_logprobs"]), -np.sort(-raw, -1)[:, :3], rtol=1e-5)
    assert np.asarray(one["rank"]).tolist() == [1, 1, 1]


def test_sampling_params_validate_penalties():
    from jserve.core.request import SamplingParams

    for kw in ({"repetition_penalty": 0}, {"presence_penalty": 3}, {"frequency_penalty": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
