"""The idle time between consecutive device steps (host scheduling, packing, detokenizing):
recorded per call, reported by `stats()` and `/metrics`, and not counted across a wait for work."""

from __future__ import annotations

import time

from jserve.core.request import SamplingParams
from test_engine import make_engine, run, tiny, workload  # noqa: F401 (tiny: a fixture)


def test_idle_time_between_steps(tiny):
    engine = make_engine(tiny)
    prompts, params = workload(12, seed=3)
    run(engine, prompts, params)
    records = list(engine.runner.records)
    assert len(records) > 10 and records[0].idle_before == 0.0
    assert all(r.idle_before >= 0 for r in records) and any(r.idle_before > 0 for r in records)
    stats = engine.stats()
    assert 0 < stats["step_idle_fraction"] < 1 and stats["step_idle_seconds"] > 0
    # Idle between runs: the wait is not a gap between steps.
    time.sleep(0.5)
    run(engine, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    new = list(engine.runner.records)[len(records):]
    assert new[0].idle_before == 0.0 and max(r.idle_before for r in new) < 0.5
