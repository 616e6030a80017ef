"""Token-level sampling controls: logit_bias and allowed_token_ids, in the sampler, through the
engine on each backend the tests use, and as the server reads them (400s naming bad values)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.core.request import MAX_LOGIT_ENTRIES, SamplingParams
from jserve.runtime.sampler import SamplingArrays, sample
from jserve.server.errors import APIError
from jserve.server.limits import Limits
from jserve.server.protocol import Context, parse_chat, parse_completion
from test_engine import make_engine, run, tiny  # noqa: F401 (tiny: the tiny model's fixture)

V = 16


def _sample(logits, params, steps=None):
    rows = [(p, s) for p, s in zip(params, steps or [0] * len(params))]
    arrays = SamplingArrays.build(rows, len(rows))
    return sample(jnp.asarray(logits, jnp.float32), arrays, num_logprobs=2)


def test_bias_is_added_before_temperature_and_logprobs_stay_the_models():
    logits = np.random.RandomState(0).randn(4, V).astype(np.float32)
    top = int(np.argmax(logits[0]))
    rows = [SamplingParams(temperature=0, logit_bias={5: 100}),  # forces 5
            SamplingParams(temperature=0, logit_bias={top: -100}),  # bans the argmax
            SamplingParams(temperature=5.0, seed=1, logit_bias={9: 100}),  # a hot row still gets 9
            SamplingParams(temperature=0)]  # a free row beside them
    out = _sample(logits, rows)
    second = int(np.argsort(-logits[1])[0]) if int(np.argmax(logits[1])) != top else int(np.argsort(-logits[1])[1])
    assert [int(t) for t in out["tokens"]] == [5, second, 9, int(np.argmax(logits[3]))]
    # logprobs are of the model's raw distribution, as for every other processing
    rows = [dataclasses.replace(r, logprobs=1) for r in rows]
    out = _sample(logits, rows)
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out["logprob"]), raw[np.arange(4), np.asarray(out["tokens"])], rtol=1e-5)


def test_bias_shifts_sampling_by_its_value():
    logits = np.zeros((2000, V), np.float32)
    rows = [SamplingParams(temperature=1.0, seed=i, logit_bias={3: float(np.log(V - 1))}) for i in range(2000)]
    tokens = np.asarray(_sample(logits, rows)["tokens"])
    assert 0.45 < np.mean(tokens == 3) < 0.55  # e^b = V - 1: token 3 is as likely as all the others


def test_allowed_tokens_with_bias_inside_and_outside():
    logits = np.random.RandomState(1).randn(3, V).astype(np.float32)
    rows = [SamplingParams(temperature=0, allowed_token_ids=[2, 7]),
            SamplingParams(temperature=0, allowed_token_ids=[2, 7], logit_bias={7: 100, 11: 100}),
            SamplingParams(temperature=3.0, seed=3, allowed_token_ids=[4])]
    out = [int(t) for t in _sample(logits, rows)["tokens"]]
    assert out == [2 if logits[0, 2] >= logits[0, 7] else 7, 7, 4]
    hot = [SamplingParams(temperature=2.0, seed=s, allowed_token_ids=[1, 6, 13]) for s in range(200)]
    assert set(np.asarray(_sample(np.zeros((200, V)), hot)["tokens"]).tolist()) == {1, 6, 13}


def test_sampling_params_check_their_controls():
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"1": 1})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-3])
    with pytest.raises(ValueError, match=f"at most {MAX_LOGIT_ENTRIES}"):
        SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_ENTRIES + 1)})
    with pytest.raises(ValueError, match="token id 300 .* outside the vocabulary"):
        SamplingParams(logit_bias={3: 1}, allowed_token_ids=[5, 300]).check_token_ids(256)
    with pytest.raises(ValueError, match="token id 256 "):
        SamplingParams(allowed_token_ids=[5], logit_bias={256: -1}).check_token_ids(256)
    SamplingParams(logit_bias={255: 1}, allowed_token_ids=[0]).check_token_ids(256)
    # every allowed token is listed; a bias outside them is dropped (the token is banned anyway)
    p = SamplingParams(allowed_token_ids=[4, 2], logit_bias={2: 3.0, 9: 1.0})
    assert p.logit_entries == ((4, 2), (0.0, 3.0))


# ------------------------------------------------------------------------------ the engine

def _engine(tiny, backend, warmup=False):
    return make_engine(tiny, backend=backend, warmup=warmup)


PROMPTS = [[5, 17, 99, 3, 250], [8, 8, 41], list(range(30, 52))]


@pytest.mark.parametrize("backend", ["cpu", "reference", "cpu_pallas"])
def test_engine_honours_the_controls_on_every_backend(tiny, backend):
    engine = _engine(tiny, backend)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = run(engine, PROMPTS, [SamplingParams(**greedy)] * 3)
    banned = free[0][0]
    allowed = [(free[1][0] + 1) % 256, 200, 201]  # the tiny model's vocabulary: 256
    params = [SamplingParams(**greedy, logit_bias={banned: -100}),  # bans the free first token
              SamplingParams(**greedy, allowed_token_ids=allowed),
              SamplingParams(**greedy, logit_bias={177: 100})]  # forces 177
    out = run(engine, PROMPTS + PROMPTS[:1], params + [SamplingParams(**greedy)])
    assert banned not in out[0] and len(out[0]) == 6
    assert set(out[1]) <= set(allowed)
    assert out[2] == [177] * 6
    assert out[3] == free[0]  # a free request in the same batches is untouched


def test_nothing_compiles_after_warmup_mixing_biased_and_free_requests(tiny):
    engine = _engine(tiny, "cpu", warmup=True)
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    params = [SamplingParams(**greedy, logit_bias={12: 5.0}), SamplingParams(**greedy),
              SamplingParams(temperature=0.8, seed=2, max_tokens=5, allowed_token_ids=[3, 4, 5]),
              SamplingParams(**greedy, repetition_penalty=1.3, logit_bias={40: -100})]
    run(engine, PROMPTS + [[9, 9]], params)
    run(engine, PROMPTS, [SamplingParams(**greedy)] * 3)
    assert engine.runner.num_compilations_after_warmup == 0, engine.runner.compiles.seen


# ------------------------------------------------------------------------------ the server's reading

CTX = Context(("m",), 128, 1000, Limits().resolve(max_model_len=128, num_kv_tokens=4096, max_num_seqs=8))


def _completion(**body):
    return parse_completion({"prompt": [1, 2], **body}, CTX)


def test_server_reads_the_controls():
    params = _completion(logit_bias={"13": 5, "7": -100.0}, allowed_token_ids=[7, 13, 99]).params
    assert params.logit_bias == {13: 5.0, 7: -100.0} and params.allowed_token_ids == (7, 13, 99)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4": 1}}, CTX)
    assert chat.params.logit_bias == {4: 1.0}
    assert _completion(logit_bias={}).params.logit_bias is None


@pytest.mark.parametrize("body, param, named", [
    ({"logit_bias": {"1000": 5}}, "logit_bias", "1000"),  # outside the vocabulary
    ({"logit_bias": {"-1": 5}}, "logit_bias", "-1"),
    ({"logit_bias": {"abc": 5}}, "logit_bias", "abc"),
    ({"logit_bias": {"3": 100.5}}, "logit_bias", "100.5"),
    ({"logit_bias": {"3": "up"}}, "logit_bias", "up"),
    ({"logit_bias": {"3": True}}, "logit_bias", "True"),
    ({"logit_bias": [3]}, "logit_bias", "[3]"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_ENTRIES + 1)}}, "logit_bias", str(MAX_LOGIT_ENTRIES + 1)),
    ({"allowed_token_ids": [5, 1000]}, "allowed_token_ids", "1000"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "[]"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids", "'5'"),
    ({"allowed_token_ids": 5}, "allowed_token_ids", "5"),
])
def test_server_refuses_bad_controls_naming_them(body, param, named):
    with pytest.raises(APIError) as e:
        _completion(**body)
    assert e.value.status == 400 and e.value.param == param and named in e.value.message, e.value.message
