"""Multi-step decode (`num_scheduler_steps` > 1): several decode steps per device call give exactly
the outputs of single steps.

Three levels: the page table's lookahead pages; the scheduler driven by test_scheduler's fake
device (which reads each token's history back from the pages, so a missing or shared lookahead
page fails); and the engine on the tiny random SmolLM2-shaped model against the same engine
scheduling one step at a time (stops, penalties, seeds and logprobs included).
"""

from __future__ import annotations

import numpy as np
import pytest

from jserve.core.page_table import PageTable
from jserve.core.request import SamplingParams
from jserve.core.scheduler import RequestStatus, SchedulerConfig, StepPlan
from jserve.runtime.steps import StepRow
from test_engine import make_engine, tiny  # noqa: F401 (tiny: the module-scoped fixture)
from test_engine import run_outputs as run_all
from test_scheduler import (
    FakeDevice,
    assert_reference_outputs,
    check_plan,
    fake_next_token,
    make_request,
    make_scheduler,
    mixed_requests,
)

# ------------------------------------------------------------------------------ page table

def test_lookahead_pages_are_taken_up_front_and_filled_later():
    table = PageTable(12, page_size=4)
    table.allocate_prompt("a", list(range(6)))  # 2 pages, 6 slots
    table.mark_computed("a", 6)
    table.append_tokens("a", [7])
    assert table.num_fresh_pages("a", 1, num_lookahead=5) == 1  # slots 6..11: one more page
    assert table.allocate_slots("a", 1, num_lookahead=5) is True
    pages = table.page_ids("a")
    assert len(pages) == 3 and table.num_allocated_tokens("a") == 7
    table.check_invariants()
    for token in range(8, 13):  # the later steps find their slots in the lookahead pages
        table.mark_computed("a", 1)
        table.append_tokens("a", [token])
        free = table.pool.num_free_pages
        assert table.allocate_slots("a", 1) is True
        assert table.pool.num_free_pages == free and table.page_ids("a") == pages
        table.check_invariants()
    with pytest.raises(ValueError, match="num_lookahead"):
        table.allocate_slots("a", 0, num_lookahead=-1)
    table.free("a")
    assert table.pool.num_free_pages == 11
    table.check_invariants()


def test_lookahead_is_all_or_nothing():
    table = PageTable(4, page_size=4)  # 3 usable pages
    table.allocate_prompt("a", list(range(4)))
    table.mark_computed("a", 4)
    table.append_tokens("a", [9])
    assert not table.can_allocate_slots("a", 1, num_lookahead=8)  # slots 5..13: 3 more pages
    assert table.allocate_slots("a", 1, num_lookahead=8) is False
    assert len(table.page_ids("a")) == 1 and table.pool.num_free_pages == 2
    assert table.allocate_slots("a", 1, num_lookahead=4) is True
    table.mark_computed("a", 1)
    table.check_invariants()


# ------------------------------------------------------------------------------ scheduler

def run_decode_steps(device: FakeDevice, plan: StepPlan) -> list[list[int]]:
    """The fake device's multi-step call: per chunk, up to decode_steps tokens, each fed back (its K/V
    written into the chunk's pages, lookahead ones included) before the next is sampled; a row
    stops at its stop ids as the real device does."""
    out = []
    for chunk in plan.chunks:
        token, pos, tokens = chunk.token_ids[0], chunk.start, []
        for _ in range(chunk.decode_steps):
            page, i = device.slot(chunk.page_ids, pos)
            page[i] = (pos, token)
            history = []
            for p in range(pos + 1):
                page, i = device.slot(chunk.page_ids, p)
                assert page[i] is not None and page[i][0] == p, (chunk.request.request_id, p)
                history.append(page[i][1])
            token = fake_next_token(history)
            tokens.append(token)
            pos += 1
            if token in chunk.request.params.stop_token_ids:
                break
        out.append(tokens)
    return out


def finish_if_done(sched, request) -> None:
    params = request.params
    if request.output_token_ids[-1] in params.stop_token_ids:
        sched.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
    elif params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
        sched.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)


def drive_multi_step(sched, arrivals, *, aborts=(), max_steps=5000):
    """test_scheduler.drive for a multi-step scheduler: a multi-step plan's tokens are handed back
    one step at a time (`next_decode_step`, `update`), with the stop checks after each. The
    requests named in `aborts` are aborted inside the first multi-step call that runs them, after
    its first step's tokens were taken."""
    aborts = set(aborts)
    arrivals = {k: list(v) for k, v in arrivals.items()}
    device = FakeDevice(sched.page_table.page_size)
    plans, requests, step = [], [], 0
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            sched.add_request(request)
            requests.append(request)
        running_before = list(sched.running)
        plan = sched.schedule()
        plans.append(plan)
        if plan.decode_steps == 1:
            check_plan(sched, plan, running_before)
            sampled = device.run(plan)
            for request in sched.update(plan, sampled):
                finish_if_done(sched, request)
        else:
            assert not plan.preempted and all(len(c.token_ids) == 1 for c in plan.chunks)
            assert {c.request.request_id for c in plan.chunks} == {r.request_id for r in running_before}
            tokens = run_decode_steps(device, plan)
            live = list(zip(plan.chunks, tokens))
            for j in range(plan.decode_steps):
                if j:
                    live = [(nxt, toks) for c, toks in live
                            if j < len(toks) and (nxt := sched.next_decode_step(c)) is not None]
                if j == 1:
                    for rid in aborts & {c.request.request_id for c in plan.chunks}:
                        sched.abort_request(rid)  # mid-call: its later tokens must be dropped
                        aborts.discard(rid)
                    live = [(c, toks) for c, toks in live if not c.request.is_finished]
                sub = StepPlan([c for c, _ in live], [], len(live))
                for request in sched.update(sub, {c.request.request_id: toks[j] for c, toks in live}):
                    finish_if_done(sched, request)
        sched.check_invariants()
        step += 1
        assert step < max_steps, "no progress"
    table = sched.page_table
    assert table.num_requests == 0 and table.pool.num_used_pages == 0
    assert all(r.is_finished for r in requests)
    return plans


@pytest.mark.parametrize("steps", [2, 4, 7])
def test_multi_step_scheduling_matches_requests_run_alone(steps):
    sched = make_scheduler(num_pages=200, max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=steps)
    requests = mixed_requests(24)
    plans = drive_multi_step(sched, {0: requests[:10], 3: requests[10:18], 30: requests[18:]})
    assert_reference_outputs(sched, requests)
    multi = [p for p in plans if p.decode_steps > 1]
    assert multi and max(p.decode_steps for p in multi) == steps
    # Capped by what each request has left to sample.
    assert all(c.decode_steps <= c.request.params.max_tokens - (c.start + 1 - len(c.request.prompt_token_ids))
               for p in multi for c in p.chunks)


def test_multi_step_with_preemption_prefix_cache_and_aborts():
    # Three seats, so that waiting requests do not keep every step single.
    sched = make_scheduler(num_pages=20, page_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                           enable_prefix_caching=True, num_scheduler_steps=5)
    prefix = [(5 * j + 1) % 61 for j in range(9)]
    requests = mixed_requests(16, prefix=prefix, seed=3)
    long = [make_request(f"l{i}", prefix + [i, i + 1], max_tokens=30) for i in range(3)]
    plans = drive_multi_step(sched, {0: requests[:8] + long, 5: requests[8:]}, aborts=["l2"])
    assert sched.num_preemptions > 0 and any(p.decode_steps > 1 for p in plans)
    assert sched.page_table.num_prefix_hit_tokens > 0
    assert long[2].status is RequestStatus.FINISHED_ABORTED and 0 < len(long[2].output_token_ids) < 30
    assert_reference_outputs(sched, requests + long[:2])


def test_when_a_multi_step_plan_is_made():
    device = FakeDevice(4)

    def step(sched):
        plan = sched.schedule()
        for request in sched.update(plan, device.run(plan)):
            finish_if_done(sched, request)
        return plan

    sched = make_scheduler(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                           num_scheduler_steps=4)
    a = make_request("a", range(1, 6), max_tokens=4)
    b = make_request("b", range(2, 30), max_tokens=20)
    sched.add_request(a)
    assert step(sched).decode_steps == 1  # a's prompt
    sched.add_request(b)
    plan = step(sched)  # a seat is free: b is admitted (a single step)
    assert plan.decode_steps == 1 and len(plan.chunks) == 2
    assert step(sched).decode_steps == 1  # b's prompt is still in chunks
    plan = sched.schedule()
    assert [c.decode_steps for c in plan.chunks] == [1, 4]  # a has 1 token left to sample, b 19
    assert plan.decode_steps == 4 and plan.num_batched_tokens == 2

    # Seats all taken: a waiting request does not stop a multi-step plan, but the call ends when
    # the first seat frees by max_tokens (x: 2 more tokens), so that it is admitted then.
    sched = make_scheduler(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                           num_scheduler_steps=4)
    sched.add_request(make_request("x", range(1, 6), max_tokens=3))
    sched.add_request(make_request("v", range(1, 6), max_tokens=10))
    step(sched)
    assert [c.decode_steps for c in sched.schedule().chunks] == [2, 4]  # nobody waits
    sched = make_scheduler(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                           num_scheduler_steps=4)
    sched.add_request(make_request("x", range(1, 6), max_tokens=3))
    sched.add_request(make_request("v", range(1, 6), max_tokens=10))
    step(sched)
    sched.add_request(make_request("y", range(1, 6), max_tokens=10))
    plan = sched.schedule()
    assert [c.decode_steps for c in plan.chunks] == [2, 2] and plan.decode_steps == 2

    # The pool cannot hold the lookahead: one step (nobody is preempted for lookahead).
    sched = make_scheduler(num_pages=5, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                           num_scheduler_steps=8)
    sched.add_request(make_request("z", range(1, 8), max_tokens=10))
    sched.add_request(make_request("w", range(2, 9), max_tokens=10))
    step(sched)  # both prompts: all 4 pages taken, the next slot of each is in its last page
    plan = sched.schedule()
    assert plan.decode_steps == 1 and not plan.preempted and len(plan.chunks) == 2
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)


# ------------------------------------------------------------------------------ engine

def summary(output):
    logprob_ids = None if output.logprobs is None else [sorted(entry) for entry in output.logprobs]
    return output.token_ids, output.finish_reason, output.stop_reason, output.text, logprob_ids


def logprob_values(outputs):
    return [lp.logprob for o in outputs for entry in o.logprobs or () for _, lp in sorted(entry.items())]


@pytest.fixture(scope="module")
def engines(tiny):
    """Single-step and 4-step engines with an EOS id the tiny model does sample."""
    single = make_engine(tiny, eos=[17], warmup=True)
    multi = make_engine(tiny, eos=[17], num_scheduler_steps=4, warmup=True)
    return single, multi


def assert_clean(engine):
    stats = engine.stats()
    assert stats["pages_in_use"] == 0 and stats["compilations_after_warmup"] == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["num_pages"] - 1
    engine.scheduler.check_invariants()


def test_engine_multi_step_equals_single_steps_with_stops_penalties_seeds_logprobs(engines):
    single, multi = engines
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, rng.integers(2, 40)).tolist() for _ in range(24)]
    # Where the greedy single-step outputs go, to put stop ids and stop strings inside the calls.
    probe = run_all(single, prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 24)
    params = []
    for i, out in enumerate(probe):
        kind = i % 8
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[out.token_ids[5]])
        elif kind == 1:  # the stop id counts only from the 7th token on
            sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[out.token_ids[2]], min_tokens=7)
        elif kind == 2:
            sp = SamplingParams(temperature=0, max_tokens=12, stop=[out.text[len(out.text) // 2:][:3] or "x"])
        elif kind == 3:
            sp = SamplingParams(temperature=0, max_tokens=21, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.2)
        elif kind == 4:
            sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=15, logprobs=3)
        elif kind == 5:
            sp = SamplingParams(temperature=1.0, min_p=0.05, seed=i, max_tokens=9, repetition_penalty=1.2)
        elif kind == 6:
            sp = SamplingParams(temperature=0, max_tokens=30)  # EOS (17) may stop it
        else:
            sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 6)), ignore_eos=True, logprobs=1)
        params.append(sp)
    want = run_all(single, prompts, params)
    got = run_all(multi, prompts, params)
    assert [summary(o) for o in got] == [summary(o) for o in want]
    np.testing.assert_allclose(logprob_values(got), logprob_values(want), atol=1e-4)
    assert {o.finish_reason for o in want} == {"stop", "length"}
    assert any(isinstance(o.stop_reason, str) for o in want) and any(isinstance(o.stop_reason, int) for o in want)
    assert max(r.steps for r in multi.runner.records) == 4
    assert_clean(single)
    assert_clean(multi)


def test_engine_multi_step_under_preemption_and_prefix_cache(tiny):
    rng = np.random.default_rng(3)
    system = list(range(10, 42))
    prompts = [system + rng.integers(3, 256, rng.integers(1, 30)).tolist() for _ in range(20)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(5, 40)), ignore_eos=True) for _ in prompts]
    want = run_all(make_engine(tiny, enable_prefix_caching=False), prompts, params)
    engine = make_engine(tiny, num_pages=40, num_scheduler_steps=6)
    got = run_all(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert max(r.steps for r in engine.runner.records) == 6
    assert_clean(engine)


def test_runner_loop_ends_when_every_row_stopped(engines):
    _, multi = engines
    runner = multi.runner
    assert not multi.has_unfinished_requests()
    multi.page_table.pool.evict()  # pages 1..4 hold nothing the prefix cache could hand out later
    def rows(steps, stops=((), ()), min_new=(0, 0)):
        return [StepRow(3, [5], [1, 2], decode_steps=steps[0], stop_ids=tuple(stops[0]), min_new=min_new[0]),
                StepRow(0, [6], [3, 4], decode_steps=steps[1], stop_ids=tuple(stops[1]), min_new=min_new[1])]

    first = runner.execute_decode_steps(rows([4, 2]))
    assert list(first.num_valid) == [4, 2] and first.tokens.shape == (4, 2)
    assert runner.records[-1].steps == 4 and runner.records[-1].real_tokens == 6
    # Each row's first sample is a stop id: one step, and the loop ends there.
    stops = ([int(first.tokens[0, 0])], [int(first.tokens[0, 1])])
    again = runner.execute_decode_steps(rows([4, 4], stops))
    assert list(again.num_valid) == [1, 1] and runner.records[-1].steps == 1
    assert list(again.tokens[0]) == list(first.tokens[0])
    # min_new: the stop counts from the row's 2nd sample on (min_tokens still 1 sample away).
    later = runner.execute_decode_steps(rows([4, 2], (stops[0], ()), (2, 0)))
    column = list(first.tokens[:, 0])
    n = next((j + 1 for j in range(1, 4) if column[j] == column[0]), 4)
    assert later.num_valid[0] == n and list(later.tokens[:n, 0]) == column[:n]
    with pytest.raises(ValueError, match="decode_steps"):
        runner.execute_decode_steps(rows([5, 1]))
    with pytest.raises(ValueError, match="needs 3 pages"):
        runner.execute_decode_steps([StepRow(7, [5], [1, 2], decode_steps=2)])
    with pytest.raises(ValueError, match="one token"):
        runner.execute_decode_steps([StepRow(3, [5, 6], [1, 2])])
    assert multi.stats()["compilations_after_warmup"] == 0


def test_bad_num_scheduler_steps_is_refused(tiny):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_engine(tiny, num_scheduler_steps=0, warmup=False)
    with pytest.raises(ValueError, match="one data-parallel group"):
        make_engine(tiny, num_scheduler_steps=2, mesh="dp=2", warmup=False)


def test_streams_from_a_multi_step_engine_equal_single_steps(engines):
    import asyncio

    from jserve.engine.async_engine import AsyncLLMEngine

    single, multi = engines
    prompts = [list(range(20, 45)), list(range(50, 60))]
    params = [SamplingParams(temperature=0, max_tokens=13, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=11, ignore_eos=True)]
    want = run_all(single, prompts, params)
    aengine = AsyncLLMEngine(multi)

    async def stream(rid, prompt, sp):
        return [out async for out in aengine.generate(rid, prompt, sp)]

    async def main():
        streams = await asyncio.gather(*(stream(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))))
        # A consumer that leaves after its first delta: its request is aborted, its pages freed.
        gen = aengine.generate("gone", list(range(3, 30)), SamplingParams(max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        return streams, await aengine.stats()

    try:
        streams, stats = asyncio.run(main())
    finally:
        assert aengine.shutdown(timeout=30)
    for outs, ref in zip(streams, want):
        deltas = [c for o in outs for c in o.outputs]
        assert "".join(c.text for c in deltas) == ref.text
        assert [t for c in deltas for t in c.token_ids] == ref.token_ids
        assert deltas[-1].finish_reason == "length" and outs[-1].finished
        # Several tokens arrive per delta: one delta per device call, not per token.
        assert len(outs) < len(ref.token_ids)
    got_logprobs = [lp for c in (c for o in streams[0] for c in o.outputs) for lp in c.logprobs]
    assert [sorted(e) for e in got_logprobs] == [sorted(e) for e in want[0].logprobs]
    assert stats["pages_in_use"] == 0 and stats["num_running"] == 0
    assert_clean(multi)


def test_the_cli_flag_reaches_the_engine_config():
    from jserve.cli import build_parser, engine_kwargs

    for command, default in ((["serve"], None), (["generate", "--prompt", "hi"], 1)):  # serve's: per device
        assert engine_kwargs(build_parser().parse_args(command))["num_scheduler_steps"] == default
        args = build_parser().parse_args(command + ["--num-scheduler-steps", "4"])
        assert engine_kwargs(args)["num_scheduler_steps"] == 4
