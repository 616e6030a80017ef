"""jserve.core.scheduler driven by a fake engine: a fake device keeps token ids in its KV pages and a fake
model samples from what it reads there, so a correct scheduler gives every request the output it
would have alone, whatever the batching, chunking, prefix reuse or preemption."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve.core.page_pool import NULL_PAGE
from jserve.core.page_table import PageTable
from jserve.core.request import SamplingParams
from jserve.core.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, StepPlan

VOCAB = 61


def fake_next_token(token_ids: list[int]) -> int:
    """Deterministic from the history alone; depends on position and on the first token too."""
    return (sum(token_ids[-4:]) * 31 + len(token_ids) * 7 + token_ids[0]) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, max_len: int) -> list[int]:
    """The request run alone: stop token (kept), max_tokens, or the scheduler's length cap."""
    tokens, output = list(prompt), []
    while len(tokens) < max_len and (params.max_tokens is None or len(output) < params.max_tokens):
        token = fake_next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token in params.stop_token_ids:
            break
    return output


class FakeDevice:
    """KV pages holding (position, token id) per slot; the model reads its history from them."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: dict[int, list] = {}

    def slot(self, page_ids, pos):
        page = self.pages.setdefault(page_ids[pos // self.page_size], [None] * self.page_size)
        return page, pos % self.page_size

    def run(self, plan: StepPlan) -> dict[str, int]:
        for chunk in plan.chunks:  # all writes, then all reads, as one batched step
            for pos, token in enumerate(chunk.token_ids, chunk.start):
                page, i = self.slot(chunk.page_ids, pos)
                page[i] = (pos, token)
        sampled = {}
        for chunk in plan.chunks:
            if chunk.emits_token:
                history = []
                for pos in range(chunk.start + len(chunk.token_ids)):
                    page, i = self.slot(chunk.page_ids, pos)
                    assert page[i] is not None and page[i][0] == pos, (chunk.request.request_id, pos, page[i])
                    history.append(page[i][1])
                sampled[chunk.request.request_id] = fake_next_token(history)
        return sampled


def check_plan(sched: Scheduler, plan: StepPlan, running_before: list[Request]) -> None:
    cfg, pt = sched.config, sched.page_table
    size = pt.page_size
    assert plan.num_batched_tokens == sum(len(c.token_ids) for c in plan.chunks) <= cfg.max_num_batched_tokens
    assert len(plan.chunks) <= cfg.max_num_seqs
    ids = [c.request.request_id for c in plan.chunks]
    assert len(set(ids)) == len(ids)
    # No running request waits a step: it is served or preempted.
    assert {r.request_id for r in running_before} <= set(ids) | {r.request_id for r in plan.preempted}
    assert not set(ids) & {r.request_id for r in plan.preempted}
    pages_of = {}
    for c in plan.chunks:
        r, stop = c.request, c.start + len(c.token_ids)
        assert r.status is RequestStatus.RUNNING and c.start == r.num_computed_tokens
        assert len(c.token_ids) >= 1 and c.token_ids == r.all_token_ids[c.start:stop]
        assert c.emits_token == (stop == r.num_tokens)
        assert c.page_ids == pt.page_ids(r.request_id) and NULL_PAGE not in c.page_ids
        assert len(c.page_ids) == -(-stop // size)
        pages_of[r.request_id] = set(c.page_ids)
    for c in plan.chunks:  # pages written this step belong to this request alone
        written = {c.page_ids[pos // size] for pos in range(c.start, c.start + len(c.token_ids))}
        assert all(pt.pool.refcount(p) == 1 and pt.pool.page_hash(p) is None for p in written)
        for other, pages in pages_of.items():
            assert other == c.request.request_id or not written & pages


@dataclasses.dataclass
class Trace:
    plans: list[StepPlan]
    finished: list[Request]


def drive(sched: Scheduler, arrivals: dict[int, list[Request]], *,
          aborts: dict[int, list[str]] | None = None, max_steps: int = 5000) -> Trace:
    """Plays the engine: adds requests at their step, runs the fake device, stops at max_tokens or
    stop tokens, aborts at the given steps (after schedule: mid-step)."""
    arrivals = {k: list(v) for k, v in arrivals.items()}
    device = FakeDevice(sched.page_table.page_size)
    trace = Trace([], [])
    step = 0
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            sched.add_request(request)
            trace.finished.append(request)
        running_before = list(sched.running)
        plan = sched.schedule()
        check_plan(sched, plan, running_before)
        trace.plans.append(plan)
        sampled = device.run(plan)
        for rid in (aborts or {}).get(step, []):
            sched.abort_request(rid)
        for request in sched.update(plan, sampled):
            params = request.params
            if request.output_token_ids[-1] in params.stop_token_ids:
                sched.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            elif params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
                sched.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        sched.check_invariants()
        step += 1
        assert step < max_steps, "no progress"
    pt = sched.page_table
    assert pt.num_requests == 0 and pt.pool.num_used_pages == 0
    assert all(r.is_finished for r in trace.finished)
    return trace


def make_request(rid, prompt, max_tokens=8, *, priority=0, arrival_time=0.0, stop=(), salt=None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=list(stop))
    return Request(rid, list(prompt), params, arrival_time, priority=priority, cache_salt=salt)


def mixed_requests(num: int, *, prefix=(), seed=0) -> list[Request]:
    requests = []
    for i in range(num):
        length = 1 + (i * 7 + seed) % 37
        prompt = list(prefix) + [(i * 13 + j * 5 + seed) % VOCAB for j in range(length)]
        stop = (i % VOCAB,) if i % 4 == 0 else ()
        requests.append(make_request(f"r{i}", prompt, max_tokens=1 + (i * 5) % 17, stop=stop))
    return requests


def assert_reference_outputs(sched: Scheduler, requests: list[Request]) -> None:
    for r in requests:
        expected = reference_output(r.prompt_token_ids, r.params, sched.max_len)
        assert r.output_token_ids == expected, r.request_id


def make_scheduler(num_pages=64, page_size=4, **config) -> Scheduler:
    cfg = SchedulerConfig(**config)
    return Scheduler(cfg, PageTable(num_pages, page_size, enable_prefix_caching=cfg.enable_prefix_caching))


# Whole runs against requests run alone.

def test_mixed_batch_matches_requests_run_alone():
    sched = make_scheduler(num_pages=200, max_num_seqs=8, max_num_batched_tokens=64)
    requests = mixed_requests(24)
    trace = drive(sched, {0: requests[:10], 3: requests[10:18], 9: requests[18:]})
    assert_reference_outputs(sched, requests)
    assert sched.num_preemptions == 0
    assert max(len(p.chunks) for p in trace.plans) == 8
    assert any(r.status is RequestStatus.FINISHED_STOPPED for r in requests)


def test_tiny_pool_preempts_and_outputs_stay_identical():
    sched = make_scheduler(num_pages=16, page_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    requests = mixed_requests(16, seed=3)
    trace = drive(sched, {0: requests})
    assert sched.num_preemptions > 0 and any(p.preempted for p in trace.plans)
    assert sum(r.num_preemptions for r in requests) == sched.num_preemptions
    assert_reference_outputs(sched, requests)


def test_preemption_recomputes_mid_decode_without_losing_a_token():
    # Two requests that each outgrow half the pool: the later one is preempted mid-decode.
    sched = make_scheduler(num_pages=9, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = make_request("a", range(1, 10), max_tokens=20), make_request("b", range(2, 11), max_tokens=20)
    trace = drive(sched, {0: [a, b]})
    assert b.num_preemptions > 0 and a.num_preemptions == 0
    assert [r.request_id for p in trace.plans for r in p.preempted][0] == "b"
    assert_reference_outputs(sched, [a, b])


def test_prefix_cache_hits_and_outputs_stay_identical():
    sched = make_scheduler(num_pages=128, page_size=4, enable_prefix_caching=True, max_num_batched_tokens=64)
    prefix = [(5 * j + 1) % VOCAB for j in range(13)]
    requests = mixed_requests(12, prefix=prefix, seed=1)
    drive(sched, {0: requests[:1], 4: requests[1:]})
    assert sched.page_table.num_prefix_hit_tokens > 0
    assert all(r.num_cached_tokens == 12 for r in requests[1:])
    assert_reference_outputs(sched, requests)


def test_prefix_cache_with_preemption_and_salts():
    sched = make_scheduler(num_pages=14, page_size=4, enable_prefix_caching=True, max_num_seqs=4,
                           max_num_batched_tokens=16)
    prefix = list(range(20, 32))
    requests = mixed_requests(10, prefix=prefix, seed=2)
    for i, r in enumerate(requests):
        r.cache_salt = "x" if i % 2 else None
    drive(sched, {0: requests[:2], 5: requests[2:]})
    assert sched.num_preemptions > 0 and sched.page_table.num_prefix_hit_tokens > 0
    assert_reference_outputs(sched, requests)


def test_small_budget_chunks_prompts_and_decodes_never_wait():
    budget = 8
    sched = make_scheduler(num_pages=200, max_num_seqs=4, max_num_batched_tokens=budget)
    short = [make_request(f"s{i}", [i + 1, 2, 3], max_tokens=30) for i in range(3)]
    long = make_request("long", range(3, 60), max_tokens=5)
    trace = drive(sched, {0: short, 2: [long]})
    long_chunks = [c for p in trace.plans for c in p.chunks if c.request is long]
    assert len(long_chunks) > 1 and not long_chunks[0].emits_token
    assert all(len(c.token_ids) < len(long.prompt_token_ids) for c in long_chunks)
    # While the long prompt is chunked, the three decodes run every step (check_plan asserts it).
    prefill_plans = [p for p in trace.plans if any(c.request is long and not c.emits_token for c in p.chunks)]
    assert prefill_plans and all(len(p.chunks) == 4 for p in prefill_plans)
    assert_reference_outputs(sched, short + [long])


def test_high_priority_long_prompt_does_not_stall_running_decodes():
    sched = make_scheduler(num_pages=200, max_num_seqs=4, max_num_batched_tokens=6)
    low = [make_request(f"low{i}", [i + 1, 7], max_tokens=25, priority=5) for i in range(3)]
    urgent = make_request("urgent", range(1, 40), max_tokens=3, priority=0)
    trace = drive(sched, {0: low, 3: [urgent]})
    first = next(i for i, p in enumerate(trace.plans) if any(c.request is urgent for c in p.chunks))
    after = trace.plans[first + 1]
    assert after.chunks[0].request is urgent  # served first once running...
    assert len(after.chunks[0].token_ids) == 3  # ...but leaves a token to each decode
    assert_reference_outputs(sched, low + [urgent])


# Ordering.

def test_priority_then_fcfs_admission():
    sched = make_scheduler(num_pages=64, max_num_seqs=1, max_num_batched_tokens=16)
    reqs = [make_request("late-p1", [1], 2, priority=1, arrival_time=0.0),
            make_request("p2", [2], 2, priority=2, arrival_time=1.0),
            make_request("early-p1", [3], 2, priority=1, arrival_time=-1.0),
            make_request("p0", [4], 2, priority=0, arrival_time=5.0),
            make_request("late-p1b", [5], 2, priority=1, arrival_time=0.0)]
    trace = drive(sched, {0: reqs})
    order = []
    for p in trace.plans:
        order += [c.request.request_id for c in p.chunks if c.request.request_id not in order]
    assert order == ["p0", "early-p1", "late-p1", "late-p1b", "p2"]


def test_preempted_request_goes_to_the_front():
    sched = make_scheduler(num_pages=7, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    a, b, c = (make_request(n, [i] * 8, max_tokens=12) for i, n in enumerate("abc", 1))
    sched.add_request(a), sched.add_request(b)
    device = FakeDevice(4)
    while not b.num_preemptions:
        plan = sched.schedule()
        sched.update(plan, device.run(plan))
        if len(sched.running) == 2 and not sched.waiting:
            sched.add_request(c)
    assert sched.waiting[0] is b and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[1] is c and b.output_token_ids


# Aborts, finishes, capacity.

def test_abort_frees_pages_at_once():
    sched = make_scheduler(num_pages=32, max_num_seqs=2, max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", range(1, 11), max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    device = FakeDevice(4)
    plan = sched.schedule()
    sched.update(plan, device.run(plan))
    used = sched.page_table.pool.num_used_pages
    assert sched.abort_request("r0") is reqs[0]
    assert reqs[0].status is RequestStatus.FINISHED_ABORTED and reqs[0].finished_time is not None
    assert "r0" not in sched.page_table and sched.page_table.pool.num_used_pages == used - 3
    assert sched.abort_request("r2") is reqs[2] and sched.num_waiting == 0  # a waiting one
    assert sched.abort_request("r0") is None and sched.abort_request("nope") is None
    plan = sched.schedule()
    sched.abort_request("r1")  # mid-step: update ignores its chunk
    assert sched.update(plan, device.run(plan)) == []
    assert not sched.has_unfinished() and sched.page_table.pool.num_used_pages == 0
    sched.check_invariants()


def test_finish_request_and_timestamps():
    now = [0.0]
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8)
    sched = Scheduler(cfg, PageTable(32, 4), clock=lambda: now[0])
    r = make_request("r", [1, 2, 3], max_tokens=None, arrival_time=0.0)
    sched.add_request(r)
    now[0] = 1.0
    plan = sched.schedule()
    now[0] = 2.0
    assert sched.update(plan, FakeDevice(4).run(plan)) == [r]
    assert (r.first_scheduled_time, r.first_token_time) == (1.0, 2.0)
    with pytest.raises(ValueError, match="RUNNING"):
        sched.finish_request("r", RequestStatus.RUNNING)
    now[0] = 3.0
    sched.finish_request("r", RequestStatus.FINISHED_STOPPED)
    sched.finish_request("r", RequestStatus.FINISHED_LENGTH)  # already finished: no-op
    assert r.status.finish_reason == "stop" and r.finished_time == 3.0 and not sched.has_unfinished()


def test_model_length_and_pool_cap_finish_as_length():
    sched = make_scheduler(num_pages=64, max_model_len=20)
    a = make_request("a", range(1, 16), max_tokens=None)
    drive(sched, {0: [a]})
    assert a.status is RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 5
    # A pool of 4 usable pages of 4 holds 16 tokens: the 17th (sampled) token can never be computed.
    sched = make_scheduler(num_pages=5, page_size=4)
    b, c = make_request("b", range(1, 11), max_tokens=None), make_request("c", range(5, 12), max_tokens=None)
    drive(sched, {0: [b, c]})
    assert sched.max_len == 17 and b.num_tokens == c.num_tokens == 17
    assert_reference_outputs(sched, [b, c])


def test_add_request_rejects_bad_requests():
    sched = make_scheduler(num_pages=5, page_size=4, max_model_len=12)
    with pytest.raises(ValueError, match="12 tokens"):
        sched.add_request(make_request("long", range(12)))
    sched = make_scheduler(num_pages=5, page_size=4)
    with pytest.raises(ValueError, match="17 tokens.*16 tokens"):
        sched.add_request(make_request("huge", range(17)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(SchedulerConfig(enable_prefix_caching=True), PageTable(8, 4))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"), ({"max_num_seqs": 1.5}, "max_num_seqs"),
    ({"max_num_seqs": 32, "max_num_batched_tokens": 16}, "max_num_batched_tokens=16"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching")])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


# Random arrivals, aborts and configurations.

@st.composite
def scenarios(draw):
    page_size = draw(st.integers(1, 5))
    max_num_seqs = draw(st.integers(1, 5))
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=draw(st.integers(max_num_seqs, 16)),
                             max_model_len=draw(st.integers(2, 64)),
                             enable_prefix_caching=draw(st.booleans()))
    num_pages = draw(st.integers(2, 8)) * draw(st.integers(1, 3))
    prefixes = [[], [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]]
    arrivals, aborts = {}, {}
    for i in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
        prompt = prompt or [i]
        request = make_request(f"r{i}", prompt, max_tokens=draw(st.integers(1, 12)),
                               priority=draw(st.integers(0, 2)), salt=draw(st.sampled_from([None, "t"])))
        arrivals.setdefault(draw(st.integers(0, 12)), []).append(request)
        if draw(st.integers(0, 4)) == 0:
            aborts.setdefault(draw(st.integers(0, 20)), []).append(request.request_id)
    return config, num_pages, page_size, arrivals, aborts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_arrivals_and_aborts(scenario):
    config, num_pages, page_size, arrivals, aborts = scenario
    page_table = PageTable(num_pages, page_size, enable_prefix_caching=config.enable_prefix_caching)
    sched = Scheduler(config, page_table)
    accepted = {}
    for step, requests in arrivals.items():
        accepted[step] = [r for r in requests if r.num_tokens < sched.max_len]
        for r in requests:
            if r.num_tokens >= sched.max_len:
                with pytest.raises(ValueError):
                    sched.add_request(r)
    trace = drive(sched, accepted, aborts=aborts)
    for r in trace.finished:
        expected = reference_output(r.prompt_token_ids, r.params, sched.max_len)
        if r.status is RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == expected[:len(r.output_token_ids)]
        else:
            assert r.output_token_ids == expected, r.request_id
