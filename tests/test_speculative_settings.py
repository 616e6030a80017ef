"""Speculative decoding's settings (`SpeculativeConfig`, EngineConfig's checks) and the n-gram
lookup and proposer against a brute-force reference; the engine with speculation:
tests/test_speculative.py."""

from __future__ import annotations

import numpy as np
import pytest

from jserve.core.request import SamplingParams
from jserve.core.speculative import SpeculativeConfig
from jserve.engine.config import EngineConfig
from jserve.engine.speculative import NgramProposer, ngram_lookup


def test_config_parses_dicts_and_json_and_names_bad_values():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 6, 5, 2)
    assert SpeculativeConfig.parse(None) is None
    for bad, match in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 2}, "needs 'method'"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ({"method": "ngram", "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
                       ({"method": "draft_model"}, "needs 'model'"), ({"method": "ngram", "model": "x"}, "model"),
                       ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
                       ({"method": "ngram", "min_acceptance": 2}, "min_acceptance"),
                       ("{not json", "not valid JSON"), ("[1]", "JSON object")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config.method == "ngram"
    for method in ({"method": "draft_model", "model": "x"}, {"method": "ngram"}):
        with pytest.raises(ValueError, match="runs on one device"):
            EngineConfig(speculative_config=method, mesh="tp=2")
    with pytest.raises(ValueError, match="multi-step decode"):
        EngineConfig(speculative_config={"method": "ngram"}, num_scheduler_steps=4)


def _lookup_reference(tokens, min_n, max_n, k):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_lookup_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        tokens = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        got = ngram_lookup(np.asarray(tokens, np.int32), min_n=min_n, max_n=max_n, k=k)
        assert got == _lookup_reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_ngram_proposer_follows_a_growing_sequence():
    from jserve.core.plan import Request

    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3, num_speculative_tokens=3))
    req = Request("a", [5, 6, 7, 8, 9, 5, 6], SamplingParams(), 0.0)
    assert proposer.propose([req], [3]) == [[7, 8, 9]]
    req.output_token_ids += [7, 8, 1]
    assert proposer.propose([req], [3]) == [[]]
    req.output_token_ids += [5, 6, 7]
    assert proposer.propose([req], [2]) == [[8, 1]]  # the latest occurrence of (5, 6, 7) wins
    assert proposer.propose([req], [0]) == [[]]
