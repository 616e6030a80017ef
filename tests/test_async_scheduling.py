"""Async scheduling (`EngineConfig.async_scheduling`): step N+1 is dispatched before step N's
samples are read, its decode rows fed from them on the device. Nothing a request sees may change:
every test runs the same workload with and without it and compares token ids, text, logprobs and
finish reasons.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig
from jserve.engine.llm_engine import PLACEHOLDER
from jserve.runtime.steps import StepRow
from test_engine import assert_clean, make_engine, run_outputs, tiny, workload  # noqa: F401 (fixture)


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@pytest.fixture(scope="module")
def engines(tiny):  # noqa: F811
    """Warmed up (once for the module): assert_clean checks that nothing compiles after it."""
    return make_engine(tiny, warmup=True), make_engine(tiny, async_scheduling=True, warmup=True)


def _both(engines, prompts, params):
    sync, overlapped = engines
    return run_outputs(sync, prompts, params), run_outputs(overlapped, prompts, params)


def test_greedy_outputs_are_those_of_single_steps(engines):
    prompts, params = workload(n=32, seed=5)
    a, b = _both(engines, prompts, params)
    _same(a, b)
    stats = assert_clean(engines[1])
    assert stats["launched_steps"] > 0 and stats["sync_steps"] == 0
    # Every step after the first of a busy period was planned and dispatched before the one
    # before it was read; whether the device was still running it depends on the host's speed.
    assert 0 <= stats["overlapped_steps"] <= stats["launched_steps"]


def test_stops_eos_and_strings_end_where_single_steps_end(engines, tiny):  # noqa: F811
    prompts, _ = workload(n=16, seed=7)
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    outs = run_outputs(engines[0], prompts, free)
    # A token the tiny model samples often, past the first position: the EOS of a second run.
    counts = collections.Counter(t for o in outs for t in o.token_ids[1:])
    eos = counts.most_common(1)[0][0]
    texts = [o.text for o in outs if len(o.text) > 6]
    stop = texts[0][3:5]
    sync, overlapped = make_engine(tiny, eos=(eos,)), make_engine(tiny, eos=(eos,), async_scheduling=True)
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[stop] if i % 3 == 0 else None,
                             logprobs=2 if i % 4 == 0 else None) for i in range(len(prompts))]
    a, b = run_outputs(sync, prompts, params), run_outputs(overlapped, prompts, params)
    _same(a, b)
    assert {o.finish_reason for o in b} >= {"stop", "length"}
    for x, y in zip(a, b):  # logprobs come with the tokens read one step later
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
            np.testing.assert_allclose([d[t].logprob for d, t in zip(x.logprobs, x.token_ids)],
                                       [d[t].logprob for d, t in zip(y.logprobs, y.token_ids)], rtol=1e-5)
    assert_clean(overlapped)


def test_seeded_sampling_with_preemption_and_prefix_caching(tiny):  # noqa: F811
    system = list(range(10, 30))
    prompts, _ = workload(n=24, seed=9, shared_prefix=system)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=12 + i % 9, ignore_eos=True)
              for i in range(len(prompts))]
    settings = dict(num_pages=48, enable_prefix_caching=True)
    sync, overlapped = make_engine(tiny, **settings), make_engine(tiny, async_scheduling=True, **settings)
    _same(run_outputs(sync, prompts, params), run_outputs(overlapped, prompts, params))
    stats = assert_clean(overlapped)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_penalties_and_grammars_wait_for_the_step_before(engines):
    prompts, params = workload(n=8, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(prompts))]
    before = engines[1].step_fn.num_sync_steps
    a, b = _both(engines, prompts, params)
    _same(a, b)
    assert engines[1].step_fn.num_sync_steps > before  # the penalized request's steps ran in order
    assert_clean(engines[1])


def test_abort_while_a_step_is_in_flight_gives_every_page_back(tiny):  # noqa: F811
    engine = make_engine(tiny, async_scheduling=True)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.step_fn.inflight is not None
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].request_id == "b" and len(outs[0].outputs[0].token_ids) == 50
    engine.step()  # reads what was still in flight for nobody
    assert_clean(engine)


def test_a_fed_row_takes_the_sample_on_the_device(tiny):  # noqa: F811
    """Runner level: a decode row fed from a launched step equals the row given its token."""
    engine = make_engine(tiny, async_scheduling=True, warmup=True)
    runner = engine.runner
    pages = list(range(1, 9))
    first = runner.launch([StepRow(0, [5, 6, 7], pages), StepRow(0, [9], pages[4:])])
    fed = runner.launch([StepRow(3, [-1], pages)], after=first, feed=[first.slots[0]])
    token = int(runner.collect(first).tokens[0])
    got = runner.collect(fed)
    again = runner.execute([StepRow(3, [token], pages)])  # recomputes position 3 with the token known
    assert int(got.tokens[0]) == int(again.tokens[0])
    np.testing.assert_allclose(got.logprob, again.logprob, rtol=1e-5)
    assert engine.stats()["compilations_after_warmup"] == 0
    with pytest.raises(ValueError, match="fed row"):
        runner.launch([StepRow(3, [-1], pages, penalty_tokens=([1], []))], after=first, feed=[0])


def test_settings_that_do_not_combine_are_refused():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_none_overlaps_wherever_it_applies_and_serve_defaults_to_it(tiny):  # noqa: F811
    """async_scheduling None (`jserve serve`'s default, as vLLM's): overlapped single steps, and plain
    multi-step decode or speculation where it does not apply, where True refuses them."""
    from jserve.cli import build_parser
    from jserve.engine.speculative import SpeculativeStep
    from jserve.engine.step_functions import MultiStep, OverlappedStep

    auto = make_engine(tiny, async_scheduling=None)
    assert auto.async_scheduling is True and isinstance(auto.step_fn, OverlappedStep)
    multi = make_engine(tiny, async_scheduling=None, num_scheduler_steps=4)
    assert multi.async_scheduling is False and isinstance(multi.step_fn, MultiStep)
    spec = make_engine(tiny, async_scheduling=None, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert spec.async_scheduling is False and isinstance(spec.step_fn, SpeculativeStep)
    assert make_engine(tiny).async_scheduling is False  # the offline engine's default
    prompts, params = workload(n=6, seed=3)
    _same(run_outputs(auto, prompts, params), run_outputs(make_engine(tiny), prompts, params))
    assert auto.runner.overlap.num_launched > 0
    parse = build_parser().parse_args
    assert parse(["serve"]).async_scheduling is None
    assert parse(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert parse(["serve", "--async-scheduling"]).async_scheduling is True


def test_serve_runs_two_decode_steps_a_call_on_a_cpu(tiny):  # noqa: F811
    """`jserve serve`'s defaults on a CPU (num_scheduler_steps and async_scheduling None): multi-step
    decode, two steps a call, and no overlap; single steps overlap where async scheduling is asked."""
    from jserve.cli import build_parser
    from jserve.engine.step_functions import MultiStep, OverlappedStep

    parse = build_parser().parse_args
    assert parse(["serve"]).num_scheduler_steps is None
    assert parse(["serve", "--num-scheduler-steps", "1"]).num_scheduler_steps == 1
    served = make_engine(tiny, async_scheduling=None, num_scheduler_steps=None)
    assert served.config.num_scheduler_steps == 2 and served.runner.max_decode_steps == 2
    assert served.async_scheduling is False and isinstance(served.step_fn, MultiStep)
    asked = make_engine(tiny, async_scheduling=True, num_scheduler_steps=None)
    assert asked.config.num_scheduler_steps == 1 and isinstance(asked.step_fn, OverlappedStep)
    prompts, params = workload(n=6, seed=3)
    _same(run_outputs(served, prompts, params), run_outputs(make_engine(tiny), prompts, params))
    assert any(record.steps == 2 for record in served.runner.step_log.records)


def test_metrics_report_the_overlap(engines):
    from prometheus_client import CollectorRegistry

    from jserve.server.metrics import ServerMetrics

    overlapped = engines[1]
    run_outputs(overlapped, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    metrics = ServerMetrics(CollectorRegistry())
    metrics.update_engine(overlapped.stats(), overlapped.runner.records)
    text = metrics.render().decode()
    launched = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("jserve_launched_steps ")))
    assert launched == overlapped.runner.overlap.num_launched > 0
    assert "jserve_overlapped_steps " in text and "jserve_num_recomputes 0.0" in text


def test_requests_ending_at_the_context_length(tiny):  # noqa: F811
    """The scheduler ends a request at max_model_len when it records the sample (a placeholder
    here): its output still ends with the real last token, once read."""
    prompts, _ = workload(n=10, seed=13)
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True) for _ in prompts]
    settings = dict(max_model_len=72)
    sync, overlapped = make_engine(tiny, **settings), make_engine(tiny, async_scheduling=True, **settings)
    a, b = run_outputs(sync, prompts, params), run_outputs(overlapped, prompts, params)
    _same(a, b)
    assert all(o.finish_reason == "length" and PLACEHOLDER not in o.token_ids for o in b)
    assert all(len(p) + len(o.token_ids) == 72 for p, o in zip(prompts, b))
    assert_clean(overlapped)
