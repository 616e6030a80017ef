"""best_of: the engine draws best_of samples and returns the n of highest cumulative logprob, at the end."""

from __future__ import annotations

import pytest

from jserve.core.request import SamplingParams
from test_engine import make_engine, tiny  # noqa: F401 (tiny: the tiny model's fixture)

PROMPTS = [[5, 17, 99, 3, 250], [8, 8, 41]]


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(tiny):
    engine = make_engine(tiny)
    hot = dict(temperature=1.5, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("all", PROMPTS[1], SamplingParams(**hot, n=4, logprobs=0))
    engine.add_request("best", PROMPTS[1], SamplingParams(**hot, n=2, best_of=4))
    done, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out.request_id, len(out.outputs)))
            done[out.request_id] = out
    samples = done["all"].outputs
    score = [sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)) for c in samples]
    order = sorted(range(4), key=lambda i: -score[i])[:2]
    best = done["best"].outputs
    assert [c.token_ids for c in best] == [samples[i].token_ids for i in order]
    assert [c.index for c in best] == [0, 1] and all(c.logprobs is None for c in best)
    assert all(k == 0 for rid, k in seen[:-1] if rid == "best")  # nothing before the end
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(best_of=2, max_tokens=0)
