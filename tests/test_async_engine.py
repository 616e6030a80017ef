"""AsyncLLMEngine: streams equal the engine's output, cancellation frees pages, errors reach callers.

The real engine runs the tiny random SmolLM2-shaped model (as in test_engine.py), built once; a fake
engine with hand-checkable output (request with prompt [..., p] emits p+1, p+2, ...; text one letter
per token) drives the failure, stop-string and shutdown cases in milliseconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.core.request import CompletionOutput, RequestOutput, SamplingParams
from jserve.core.scheduler import Request, RequestStatus
from jserve.engine import EngineConfig, build_engine
from jserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jserve.model.checkpoint import read_params
from jserve.text.tokenizer import Tokenizer

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint):
    config, params = read_params(DATA / "arch" / "smollm2")
    # The same knobs as test_engine.py: its compiled shapes come from the persistent cache.
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=4, num_pages=200,
                       backend="cpu", warmup=True)
    return build_engine(config, {k: jnp.asarray(v) for k, v in params.items()}, Tokenizer.load(smollm2_checkpoint),
                        [], cfg)


@pytest.fixture
def aengine(engine):
    """A fresh loop thread around the shared engine; afterwards the engine must be clean."""
    a = AsyncLLMEngine(engine)
    yield a
    assert a.shutdown(timeout=30)
    assert not engine.has_unfinished_requests()
    assert engine.stats()["pages_in_use"] == 0 and engine.stats()["compilations_after_warmup"] == 0


def run_sync(engine, prompts, params):
    """Final outputs of running the prompts together on the plain LLMEngine."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"sync-{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[f"sync-{i}"].outputs[0] for i in range(len(prompts))]


async def collect(aengine, rid, prompt, params, **kw):
    """All outputs of one stream."""
    return [out async for out in aengine.generate(rid, prompt, params, **kw)]


def joined(outs):
    """Concatenated deltas of a single-sample stream: (text, token_ids, logprobs, finish_reason)."""
    cs = [c for o in outs for c in o.outputs]
    lps = None if cs[-1].logprobs is None else [lp for c in cs for lp in c.logprobs]
    return "".join(c.text for c in cs), [t for c in cs for t in c.token_ids], lps, cs[-1].finish_reason


def assert_close(logprobs, expected):
    """Same tokens; values within float noise (a prefix-cache hit computes the prompt in other chunks)."""
    assert [list(e) for e in logprobs] == [list(e) for e in expected]
    got = [lp.logprob for e in logprobs for lp in e.values()]
    assert np.allclose(got, [lp.logprob for e in expected for lp in e.values()], atol=1e-4)


def test_deltas_concatenate_to_the_engine_output(engine, aengine):
    prompt = list(range(20, 45))
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    (ref,) = run_sync(engine, [prompt], [params])
    outs = asyncio.run(collect(aengine, "d", prompt, params))
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    text, ids, logprobs, reason = joined(outs)
    assert (text, ids, reason) == (ref.text, ref.token_ids, "length")
    assert_close(logprobs, ref.logprobs)
    cumulative = asyncio.run(collect(aengine, "c", prompt, params, delta=False))
    last = cumulative[-1].outputs[0]
    assert (last.text, last.token_ids, last.finish_reason) == (ref.text, ref.token_ids, "length")
    assert_close(last.logprobs, ref.logprobs)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == sorted({len(o.outputs[0].token_ids)
                                                                        for o in cumulative})
    t = aengine.request_timings("d")
    assert t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.finished_time
    assert t.queue_time >= 0 and t.prefill_time > 0 and t.decode_time > 0 and t.finish_reason == "length"
    assert (t.num_prompt_tokens, t.num_output_tokens) == (25, 12)


def test_the_servers_surface_reads_the_built_engine(engine, aengine):
    """What the server reads through AsyncLLMEngine (it never reaches into the LLMEngine): the
    limits, the model's vocabulary, the recent step records, the constraint compiler."""
    from jserve.core.request import StructuredOutputsParams
    from jserve.structured.grammar import GrammarError

    assert (aengine.max_model_len, aengine.max_num_seqs, aengine.num_kv_tokens) == (128, 8, 200 * 4)
    assert aengine.vocab_size == engine.runner.config.vocab_size > 0
    assert aengine.tokenizer is engine.tokenizer and aengine.quantization is None
    before = aengine.step_records()
    asyncio.run(collect(aengine, "surface", list(range(20, 30)), SamplingParams(max_tokens=3, **GREEDY)))
    after = aengine.step_records()
    assert isinstance(after, list) and after[-1] is engine.runner.records[-1] and after != before
    assert after[-1].real_tokens >= 1
    # The tiny model's 256 ids are too few for the real tokenizer's grammars: a stand-in compiler,
    # to see the call run in a worker thread (never the event loop's) and its errors come through.
    threads = []

    class Grammars:
        def compile(self, spec):
            threads.append(threading.get_ident())
            if spec.regex == "(a":
                raise GrammarError("structured_outputs.regex: bad")
            return ("compiled", spec.regex)

    outer = AsyncLLMEngine(types.SimpleNamespace(grammars=Grammars()), start=False)
    loop_thread = threading.get_ident()
    assert asyncio.run(outer.compile_constraint(StructuredOutputsParams(regex="[a-c]"))) == ("compiled", "[a-c]")
    with pytest.raises(GrammarError, match="regex: bad"):
        asyncio.run(outer.compile_constraint(StructuredOutputsParams(regex="(a")))
    assert len(threads) == 2 and loop_thread not in threads


def test_20_concurrent_streams_complete_correctly(engine, aengine):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, rng.integers(1, 40)).tolist() for _ in range(20)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 10)), **GREEDY) for _ in range(20)]
    refs = run_sync(engine, prompts, params)

    async def main():
        return await asyncio.gather(*(collect(aengine, f"r{i}", p, sp) for i, (p, sp) in
                                      enumerate(zip(prompts, params))))

    results = asyncio.run(main())
    for outs, ref in zip(results, refs):
        assert joined(outs) == (ref.text, ref.token_ids, None, "length")
    stats = asyncio.run(aengine.stats())
    assert stats["pages_in_use"] == 0 and stats["num_running"] == stats["num_waiting"] == stats["num_streams"] == 0


def test_cancelled_consumers_free_their_pages(aengine):
    params = SamplingParams(max_tokens=100, **GREEDY)

    async def main():
        # Alone: the abort lands before the next step, so the next command sees its pages free.
        gen = aengine.generate("x", list(range(3, 30)), params)
        await gen.__anext__()
        assert (await aengine.stats())["pages_in_use"] > 0
        await gen.aclose()
        stats = await aengine.stats()
        assert stats["pages_in_use"] == 0 and stats["num_running"] == 0

        # Among others: a task cancelled in its loop body (the stream is left unclosed, so its
        # finalizer aborts), one cancelled while waiting on the stream, an explicit abort, and a
        # short request that runs to the end.
        reached = asyncio.Event()

        async def consume(rid, hold_after=None):
            n = 0
            async for out in aengine.generate(rid, list(range(5, 25)), params):
                n += 1
                if n == hold_after:
                    reached.set()
                    await asyncio.Event().wait()  # forever
            return out

        held = asyncio.create_task(consume("a", hold_after=3))
        waiting = asyncio.create_task(consume("a2"))
        aborted = asyncio.create_task(consume("b"))
        short = asyncio.create_task(collect(aengine, "c", [7, 8, 9], SamplingParams(max_tokens=20, **GREEDY)))
        await reached.wait()
        held.cancel()
        waiting.cancel()
        assert await aengine.abort("b")
        assert not await aengine.abort("b") and not await aengine.abort("nope")
        for task in (held, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        last_b = await aborted
        assert last_b.finished and last_b.outputs[0].finish_reason == "abort"
        assert len(joined(await short)[1]) == 20
        for _ in range(500):  # the unclosed stream is finalized in a task of its own
            if getattr(aengine.request_timings("a"), "finish_reason", None) == "abort":
                break
            await asyncio.sleep(0.01)
        return await aengine.stats()

    stats = asyncio.run(main())
    assert stats["pages_in_use"] == 0 and stats["num_streams"] == 0 and stats["num_running"] == 0
    for rid in ("a", "a2", "b", "x"):
        t = aengine.request_timings(rid)
        assert t.finish_reason == "abort" and t.num_output_tokens < 100 and t.finished_time is not None


def test_bad_requests_raise_to_their_caller_only(engine, aengine):
    params = SamplingParams(max_tokens=16, **GREEDY)
    (ref,) = run_sync(engine, [[11, 12, 13]], [params])

    async def main():
        good = asyncio.create_task(collect(aengine, "good", [11, 12, 13], params))
        await asyncio.sleep(0)  # let "good" submit first
        with pytest.raises(ValueError, match="256"):
            await collect(aengine, "bad", [5, 256], params)
        with pytest.raises(ValueError, match="128"):
            await collect(aengine, "long", [5] * 200, params)
        with pytest.raises(ValueError, match="already in use"):  # must not abort the live "good"
            await collect(aengine, "good", [5], params)
        with pytest.raises(ValueError, match="SamplingParams"):
            await collect(aengine, "p", [5], {"max_tokens": 3})
        return await good

    assert joined(asyncio.run(main())) == (ref.text, ref.token_ids, None, "length")
    assert aengine.is_running and not aengine.errored


def test_the_thread_sleeps_while_idle(aengine):
    async def main():
        await collect(aengine, "w", [3, 4], SamplingParams(max_tokens=4, **GREEDY))
        before = await aengine.stats()
        await asyncio.sleep(0.3)
        after = await aengine.stats()
        assert after["num_steps"] == before["num_steps"]
        assert after["num_loop_iterations"] == before["num_loop_iterations"] + 1  # woken by the stats call only
        outs = await collect(aengine, "w2", [3, 4], SamplingParams(max_tokens=4, **GREEDY))  # wakes on a request
        assert outs[-1].finished

    asyncio.run(main())


class Paced:
    """An engine whose steps each take a permit of `gate`: the test decides when steps happen."""

    def __init__(self, engine, gate: threading.Semaphore):
        self.engine, self.gate = engine, gate

    def step(self):
        assert self.gate.acquire(timeout=10)
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_shutdown_aborts_or_drains_and_joins(engine):
    params = SamplingParams(max_tokens=40, **GREEDY)
    for abort in (True, False):
        gate = threading.Semaphore(1)
        a = AsyncLLMEngine(Paced(engine, gate))

        async def main():
            gen = a.generate(f"s{abort}", [9, 10, 11], params)
            outs = [await gen.__anext__()]  # one step ran; the thread now waits for a permit
            # Asks to stop without waiting. (Its return value, "has the thread ended", raced the thread
            # once in a cold-cache CI run on Python 3.13: the thread was not in step() at that moment.)
            a.shutdown(timeout=0, abort=abort)
            gate.release(1000)
            assert await asyncio.to_thread(a.shutdown, 30, abort=abort)
            assert not a.is_running and not a.errored
            outs += [o async for o in gen]
            with pytest.raises(EngineDeadError, match="shut down"):
                await collect(a, "late", [5], params)
            return outs

        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == ("abort" if abort else "length")
        # Aborted before or right after the step the thread was in: at most one more token.
        assert len(joined(outs)[1]) in ((1, 2) if abort else (40,))
        assert engine.stats()["pages_in_use"] == 0 and not engine.has_unfinished_requests()


# ------------------------------------------------------------------------------ fake engine


class FakeEngine:
    """Emits p+1, p+2, ... after a prompt ending in p, one letter of text per token; stops as LLMEngine."""

    def __init__(self, fail_at_step: int | None = None, gate: threading.Semaphore | None = None):
        self.scheduler = self
        self.gate = gate  # if given, each step takes a permit (a test paces the steps with it)
        self.fail_at_step = fail_at_step
        self.requests: dict[str, Request] = {}
        self.texts: dict[str, str] = {}
        self.num_steps = 0
        self.num_running = self.num_waiting = 0
        self.thread_ids: set[int] = set()

    def get_request(self, rid):
        return self.requests.get(rid)

    def add_request(self, rid, ids, params, *, prompt=None, arrival_time=None, priority=0, cache_salt=None):
        self.thread_ids.add(threading.get_ident())
        if rid in self.requests or not ids:
            raise ValueError(f"bad request {rid!r}")
        self.requests[rid] = Request(rid, list(ids), params, arrival_time)
        self.texts[rid] = ""

    def abort_request(self, rid):
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        req.status, req.finished_time = RequestStatus.FINISHED_ABORTED, time.monotonic()
        return self._output(req)

    def has_unfinished_requests(self):
        self.thread_ids.add(threading.get_ident())
        return bool(self.requests)

    def step(self):
        if self.gate is not None:
            assert self.gate.acquire(timeout=10)
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("the device fell over")
        self.num_steps += 1
        now = time.monotonic()
        outputs = []
        for rid, req in list(self.requests.items()):
            req.first_scheduled_time = req.first_scheduled_time or now
            req.first_token_time = req.first_token_time or now
            token = req.all_token_ids[-1] + 1
            req.output_token_ids.append(token)
            text = self.texts[rid] = self.texts[rid] + "abcdefghij"[token % 10]
            p = req.params
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                self.texts[rid] = text[:min(hits)]
                req.status = RequestStatus.FINISHED_STOPPED
            elif len(req.output_token_ids) >= p.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
            if req.is_finished:
                req.finished_time = now
                del self.requests[rid]
            outputs.append(self._output(req))
        return outputs

    def _output(self, req):
        c = CompletionOutput(0, self.texts[req.request_id], list(req.output_token_ids), None,
                             req.status.finish_reason)
        return RequestOutput(req.request_id, None, req.prompt_token_ids, [c], finished=req.is_finished)

    def stats(self):
        return {"num_steps": self.num_steps, "pages_in_use": 0}


def test_stop_strings_never_stream_text_they_later_cut():
    gate = threading.Semaphore(0)
    fake = FakeEngine(gate=gate)
    a = AsyncLLMEngine(fake)

    async def paced(rid, params, **kw):  # one step per output: nothing is coalesced
        outs = []
        gate.release()
        async for out in a.generate(rid, [0], params, **kw):
            outs.append(out)
            if not out.finished:
                gate.release()
        return outs

    outs = asyncio.run(paced("s", SamplingParams(max_tokens=50, stop=["def", "xyz"])))
    # The fake's text grows b, bc, bcd, bcde, bcdef -> cut to "bc"; 2 characters are held back.
    assert [o.outputs[0].text for o in outs] == ["", "", "b", "c", ""]
    assert joined(outs)[::3] == ("bc", "stop") and joined(outs)[1] == [1, 2, 3, 4, 5]
    cumulative = asyncio.run(paced("t", SamplingParams(max_tokens=50, stop=["def"]), delta=False))
    assert [o.outputs[0].text for o in cumulative] == ["", "", "b", "bc", "bc"]
    assert a.shutdown(5)
    assert fake.thread_ids == {a._thread.ident}  # the engine is only ever called on its thread


def test_a_failing_step_ends_every_stream_with_the_error():
    fake = FakeEngine(fail_at_step=3)
    a = AsyncLLMEngine(fake)

    async def main():
        results = await asyncio.gather(*(collect(a, f"f{i}", [i], SamplingParams(max_tokens=10)) for i in range(4)),
                                       return_exceptions=True)
        for r in results:
            assert isinstance(r, EngineDeadError) and isinstance(r.__cause__, RuntimeError)
            assert "fell over" in str(r)
        with pytest.raises(EngineDeadError, match="fell over"):
            await collect(a, "later", [1], SamplingParams())
        assert not await a.abort("f0")
        return await a.stats()

    stats = asyncio.run(main())
    assert stats["errored"] and not stats["is_running"] and stats["num_steps"] == 3
    assert a.errored and not a.is_running and isinstance(a.error, RuntimeError)
    assert a.shutdown(5) and not fake.requests  # their pages were handed back


def test_a_hung_step_is_visible_and_fail_ends_every_stream():
    gate = threading.Semaphore(2)  # two steps, then the third blocks until the gate opens
    fake = FakeEngine(gate=gate)
    a = AsyncLLMEngine(fake)
    assert a.iteration_seconds() == 0.0  # asleep: nothing to do

    async def main():
        streams = [asyncio.ensure_future(collect(a, f"h{i}", [i], SamplingParams(max_tokens=10))) for i in range(3)]
        while fake.num_steps < 2 or a.iteration_seconds() < 0.2:  # the third step is stuck
            await asyncio.sleep(0.01)
        a.fail("a step ran past the step timeout")
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "step timeout" in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await collect(a, "later", [1], SamplingParams())
        with pytest.raises(EngineDeadError):  # the engine is not ours to read while a step hangs
            await a.stats()

    asyncio.run(main())
    assert a.errored and a.iteration_seconds() == 0.0
    gate.release(100)  # the step returns: the thread sees it was failed, frees the pages and ends
    assert a.shutdown(5) and not fake.requests
