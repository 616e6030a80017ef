"""The stop policy (`jserve.core.stop`): one set of rules for the host, the device and the stream."""

from __future__ import annotations

import pytest

from jserve.core.request import SamplingParams
from jserve.core.stop import MAX_DEVICE_STOP_IDS, Stop, StopPolicy, holdback, tokens_left

POLICY = StopPolicy(frozenset({2}), vocab_size=100)


def test_eos_and_stop_ids_count_from_min_tokens():
    p = SamplingParams(stop_token_ids=[7], min_tokens=3)
    assert POLICY.check_token(p, 2, 2) is None  # EOS before min_tokens
    assert POLICY.check_token(p, 2, 3) == Stop("stop")
    assert POLICY.check_token(p, 7, 3) == Stop("stop", 7)
    assert POLICY.check_token(SamplingParams(ignore_eos=True), 2, 5) is None


def test_stop_strings_across_steps_and_their_cut():
    p = SamplingParams(stop=["END"], max_tokens=50)
    assert POLICY.check_text(p, 1, "xxEN", 2) is None
    assert POLICY.check_text(p, 2, "xxEND tail", 4) == Stop("stop", "END", "xx")  # completed by the new text
    kept = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    assert POLICY.check_text(kept, 2, "xxEND tail", 4).text == "xxEND"
    assert POLICY.check_text(p, 2, "END earlier", 8) is None  # only where the new text could complete it
    assert POLICY.check_text(SamplingParams(stop=["E"], min_tokens=3), 2, "E", 0) is None  # before min_tokens


def test_lengths():
    # max_tokens is a weak stop: a stop string the same token completes ends the sequence instead.
    assert POLICY.check_token(SamplingParams(max_tokens=3), 5, 3) == Stop("length", weak=True)
    assert POLICY.check_token(SamplingParams(max_tokens=3), 5, 2) is None
    p = SamplingParams(max_tokens=10)
    assert tokens_left(p, 4, 20, max_len=100) == 6
    assert tokens_left(p, 4, 98, max_len=100) == 2
    assert tokens_left(SamplingParams(max_tokens=None), 0, 100, max_len=100) == 0


def test_device_stops_and_holdback():
    p = SamplingParams(stop_token_ids=list(range(3, 3 + 20)), min_tokens=4)
    ids, min_new = POLICY.device_stops(p, 1)
    assert len(ids) == MAX_DEVICE_STOP_IDS and ids[0] == 3 and min_new == 3
    assert POLICY.stop_ids(SamplingParams(stop_token_ids=[2, 9])) == (2, 9)  # EOS not twice
    assert POLICY.stop_ids(SamplingParams(ignore_eos=True)) == ()
    assert holdback(SamplingParams(stop=["a", "abcd"])) == 3
    assert holdback(SamplingParams(stop=["abcd"], include_stop_str_in_output=True)) == 0


@pytest.mark.parametrize("token", [100, 2**31, 2**40])
def test_stop_ids_outside_the_vocabulary_are_refused_by_name(token):
    with pytest.raises(ValueError, match=f"stop_token_ids: {token} is outside the vocabulary"):
        POLICY.validate(SamplingParams(stop_token_ids=[5, token]))
