"""Sampling through the public API on the real model: seeds, filters, stops, logprobs, n."""

from __future__ import annotations

import math

import pytest

from jserve import SamplingParams

PROMPT = "Once upon a time"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(smollm2_llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = smollm2_llm.generate(PROMPT, p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=5)
    batch = smollm2_llm.generate(["Hello", PROMPT, "def f(x):", "1, 2, 3"], [others, p, others, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                             max_tokens=12, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(smollm2_llm):
    greedy = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0]
    topk = smollm2_llm.generate(PROMPT, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10))[0]
    assert topk.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_logprobs_are_normalised_and_include_the_chosen_token(smollm2_llm):
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=5, max_tokens=6, logprobs=3,
                                                      prompt_logprobs=2))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert token in entry
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda l: l.rank)
        assert [l.rank for l in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert sum(math.exp(l.logprob) for l in top) <= 1.0 + 1e-5
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry


def test_prompt_logprobs_are_complete_for_a_reused_request_id(smollm2_llm):
    """A prompt-logprobs prefill never hits the prefix cache, not even the pages of an earlier
    request that had the same id (an offline caller may reuse ids)."""
    engine, params = smollm2_llm.engine, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = smollm2_llm.tokenizer.encode(PROMPT * 20)
    outs = []
    for _ in range(2):
        engine.add_request("same-id", ids, params)
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    assert [len(o.prompt_logprobs) for o in outs] == [len(ids)] * 2
    assert outs[0].prompt_logprobs[1:] == outs[1].prompt_logprobs[1:]


def test_greedy_logprob_is_rank_one(smollm2_llm):
    comp = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0].outputs[0]
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert entry[token].rank == 1


def test_stop_string_truncates_text(smollm2_llm):
    full = smollm2_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert " 8," in full.text
    out = smollm2_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12, stop=[" 8"]))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == " 8"
    assert comp.text == full.text[:full.text.index(" 8")]
    kept = smollm2_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12, stop=" 8",
                                                                include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text.endswith(" 8")


def test_stop_token_ids_and_eos(smollm2_llm):
    full = smollm2_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    stop_id = full.token_ids[1]
    cut = full.token_ids.index(stop_id) + 1
    out = smollm2_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=8,
                                                               stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id
    chat = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                            SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in chat.text and "Paris" in chat.text


def test_n_samples_differ_and_respect_max_tokens(smollm2_llm):
    out = smollm2_llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                      ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_bad_requests_name_the_value(smollm2_llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="512"):
        smollm2_llm.generate([[1] * 600], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="99999"):
        smollm2_llm.generate([[1, 99999]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        smollm2_llm.generate([[]], SamplingParams(max_tokens=4))


def test_max_model_len_caps_output(smollm2_llm):
    out = smollm2_llm.generate([[1] * 505], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
