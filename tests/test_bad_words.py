"""vLLM's bad_words: the token sequences of each word, the bans after an output, the sampler's -inf
entries, the engine on each backend and with multi-step decode, overlapped steps and speculative
drafts (each falling back to what needs the tokens on the host), and no compilation after warm-up."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.core.bad_words import banned_ids, token_sequences
from jserve.core.request import MAX_LOGIT_ENTRIES, SamplingParams
from jserve.runtime.sampler import SamplingArrays, sample
from test_engine import make_engine, run, tiny  # noqa: F401 (tiny: the tiny model's fixture)

PROMPTS = [[5, 17, 99, 3, 250], [8, 8, 41], list(range(30, 52))]
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def test_token_sequences_follow_vllms_rule():
    vocab = {"bad": [7], " bad": [8], "two words": [3, 4], " two words": [9, 4], "x": [5], " x": [5],
             "ab": [1, 2], " ab": [6]}
    assert token_sequences(["bad", "  two words"], vocab.__getitem__) == ((7,), (8,), (3, 4), (9, 4))
    # the spaced form is kept only where it starts with another token and has the same length
    assert token_sequences(["x", "ab"], vocab.__getitem__) == ((5,), (1, 2))


def test_banned_ids_after_the_output():
    seqs = ((7,), (3, 4), (1, 2, 9))
    assert banned_ids(seqs, []) == (7,)
    assert banned_ids(seqs, [5, 3]) == (7, 4)
    assert banned_ids(seqs, [1, 2]) == (7, 9)
    assert banned_ids(seqs, [2, 1, 3, 2]) == (7,)


def test_sampling_params_check_bad_words():
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words="word")
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[1], []])
    with pytest.raises(ValueError, match="at most 28 fit"):
        SamplingParams(logit_bias={i: 1.0 for i in range(100)}, bad_words_token_ids=[[i] for i in range(29)])
    with pytest.raises(ValueError, match="token id 300 of bad_words"):
        SamplingParams(bad_words_token_ids=[[3, 300]]).check_token_ids(256)
    p = SamplingParams(bad_words_token_ids=[[1], [2, 3]])
    assert p.bad_words_token_ids == ((1,), (2, 3)) and p.bans_depend_on_output
    assert not SamplingParams(bad_words_token_ids=[[1]]).bans_depend_on_output


def test_sampler_bans_beside_bias_and_allowed_tokens():
    V = 16
    logits = np.random.RandomState(0).randn(4, V).astype(np.float32)
    order = np.argsort(-logits, axis=-1)
    rows = [(SamplingParams(temperature=0), 0, (int(order[0, 0]),)),
            (SamplingParams(temperature=0, logit_bias={int(order[1, 1]): 100}), 0, (int(order[1, 1]),)),
            (SamplingParams(temperature=0, allowed_token_ids=[2, 5]), 0, (2,)),
            (SamplingParams(temperature=0), 0, ())]
    out = sample(jnp.asarray(logits), SamplingArrays.build(rows, 4), num_logprobs=1)
    assert [int(t) for t in out["tokens"]] == [int(order[0, 1]), int(order[1, 0]), 5, int(order[3, 0])]
    hot = [(SamplingParams(temperature=3.0, seed=s), 0, tuple(range(1, V))) for s in range(50)]
    assert set(np.asarray(sample(jnp.zeros((50, V)), SamplingArrays.build(hot, 50))["tokens"]).tolist()) == {0}
    full = SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_ENTRIES - 1)})
    arrays = SamplingArrays.build([(full, 0, (200,))], 1)
    assert arrays.bias_ids[0, -1] == 200 and arrays.bias_values[0, -1] == -np.inf


def _banned_runs(engine, free):
    """Requests banning: the free first token; a pair (first, second) of the free output (so its
    first token is still sampled and the second is not); a pair that never occurs (no change)."""
    a, b = free[0][0], free[0][1]
    params = [SamplingParams(**GREEDY, bad_words_token_ids=[[a]]),
              SamplingParams(**GREEDY, bad_words_token_ids=[[a, b]]),
              SamplingParams(**GREEDY, bad_words_token_ids=[[(a + 1) % 256, free[2][1]]])]
    out = run(engine, [PROMPTS[0], PROMPTS[0], PROMPTS[2]], params)
    assert a not in out[0] and len(out[0]) == 8
    assert out[1][0] == a and out[1][1] != b
    assert all(out[1][i:i + 2] != [a, b] for i in range(7))
    assert out[2] == free[2] or free[2][0] == (a + 1) % 256
    return out


@pytest.mark.parametrize("backend", ["cpu", "reference", "cpu_pallas"])
def test_engine_honours_bad_words_on_every_backend(tiny, backend):
    engine = make_engine(tiny, backend=backend)
    _banned_runs(engine, run(engine, PROMPTS, [SamplingParams(**GREEDY)] * 3))


@pytest.mark.parametrize("settings", [dict(num_scheduler_steps=4), dict(async_scheduling=True),
                                      dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                              '"prompt_lookup_max": 2, "prompt_lookup_min": 1}')])
def test_bad_words_with_steps_that_run_ahead(tiny, settings):
    """Multi-step decode, overlapped steps and drafts all give the same tokens as plain steps."""
    plain = make_engine(tiny)
    free = run(plain, PROMPTS, [SamplingParams(**GREEDY)] * 3)
    want = _banned_runs(plain, free)
    engine = make_engine(tiny, **settings)
    assert run(engine, PROMPTS, [SamplingParams(**GREEDY)] * 3) == free
    assert _banned_runs(engine, free) == want


def test_bad_words_are_tokenized_by_the_engine(tiny):
    engine = make_engine(tiny)
    tok = engine.tokenizer
    word = next(w for w in ("a", "b", "c", "d", "e") if max(tok.encode(w, add_special_tokens=False)) < 256)
    seqs = token_sequences([word], lambda t: tok.encode(t, add_special_tokens=False))
    outs = run(engine, PROMPTS[:1] * 2, [SamplingParams(**GREEDY, bad_words=[word]),
                                          SamplingParams(**GREEDY, bad_words_token_ids=seqs)])
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="of bad_words is outside the vocabulary"):
        engine.add_request("big", [1, 2], SamplingParams(bad_words=["Paris is lovely"]))


def test_nothing_compiles_after_warmup_with_bad_words(tiny):
    engine = make_engine(tiny, warmup=True)
    params = [SamplingParams(**GREEDY, bad_words_token_ids=[[12], [40, 41]]), SamplingParams(**GREEDY),
              SamplingParams(temperature=0.8, seed=2, max_tokens=5, bad_words_token_ids=[[3, 4, 5]],
                             allowed_token_ids=[3, 4, 5, 6]),
              SamplingParams(**GREEDY, repetition_penalty=1.3, logit_bias={40: -100}, bad_words_token_ids=[[9]])]
    run(engine, PROMPTS + [[9, 9]], params)
    run(engine, PROMPTS, [SamplingParams(**GREEDY)] * 3)
    assert engine.runner.num_compilations_after_warmup == 0, engine.runner.compiles.seen


def test_no_drafts_for_a_bad_word_of_several_tokens(tiny):
    """A draft's bans would depend on the drafts before it: such a request gets none; one whose
    words are all single tokens is drafted as any other."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    repetitive = [5, 6, 7, 8] * 6
    for words, drafted in (([[9]], True), ([[9, 10]], False)):
        engine = make_engine(tiny, speculative_config=spec)
        run(engine, [repetitive], [SamplingParams(**GREEDY, bad_words_token_ids=words)])
        assert (engine.speculator.num_verify_rows > 0) == drafted, words

