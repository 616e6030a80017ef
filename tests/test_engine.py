"""The continuous-batching engine: batching, preemption, prefix caching and chunking change nothing.

A tiny random SmolLM2-shaped model (tests/data/arch/smollm2) with the real SmolLM2 tokenizer:
greedy outputs of many mixed requests in one run must equal each request run alone.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig, build_engine
from jserve.model.checkpoint import read_params
from jserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(smollm2_checkpoint):
    config, params = read_params(DATA / "arch" / "smollm2")
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    return config, {k: jnp.asarray(v) for k, v in params.items()}, tokenizer


def make_engine(tiny, eos=(), **kw):
    """The tiny engine; not warmed up unless `warmup=True` (a test that checks that nothing compiles
    after warm-up asks for it: tracing every bucket costs a test 10 to 20 s)."""
    config, params, tokenizer = tiny
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=4, num_pages=200,
                    backend="cpu", warmup=False)
    return build_engine(config, params, tokenizer, list(eos), EngineConfig(**{**defaults, **kw}))


def run_outputs(engine, prompts, params):
    """Each request's final (first) CompletionOutput, in prompt order."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


def run(engine, prompts, params):
    return [o.token_ids for o in run_outputs(engine, prompts, params)]


def workload(n=64, seed=0, shared_prefix=()):
    rng = np.random.default_rng(seed)
    prompts = [list(shared_prefix) + rng.integers(3, 256, rng.integers(1, 60)).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def alone(tiny):
    """Each request of the default workload run by itself on a fresh engine (no sharing at all)."""
    engine = make_engine(tiny, enable_prefix_caching=False)
    prompts, params = workload()
    return [run(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]


def assert_clean(engine):
    """No page held, the pool whole, the scheduler consistent; and after a warm-up, nothing compiled."""
    stats = engine.stats()
    assert stats["pages_in_use"] == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["num_pages"] - 1
    if engine.runner.warmed_up:
        assert stats["compilations_after_warmup"] == 0
    engine.scheduler.check_invariants()
    return stats


def test_64_mixed_requests_in_one_run_equal_each_alone(tiny, alone):
    engine = make_engine(tiny, warmup=True)
    prompts, params = workload()
    assert run(engine, prompts, params) == alone
    stats = assert_clean(engine)
    assert stats["num_preemptions"] == 0 and stats["num_steps"] < sum(p.max_tokens for p in params)


def test_preemption_under_a_small_pool_keeps_outputs(tiny, alone):
    engine = make_engine(tiny, num_pages=40, enable_prefix_caching=False)
    prompts, params = workload()
    assert run(engine, prompts, params) == alone
    assert assert_clean(engine)["num_preemptions"] > 0


def test_prefix_cache_reuses_a_shared_system_prompt(tiny):
    system = list(range(10, 42))  # 8 full pages of 4 tokens
    prompts, params = workload(n=16, seed=1, shared_prefix=system)
    cold = make_engine(tiny, enable_prefix_caching=False)
    expected = [run(cold, [p], [sp])[0] for p, sp in zip(prompts, params)]
    engine = make_engine(tiny, enable_prefix_caching=True)
    assert run(engine, prompts, params) == expected
    stats = assert_clean(engine)
    # Requests admitted in the same step cannot hit each other's pages (not computed yet).
    assert stats["prefix_cache_hit_tokens"] >= len(prompts) // 2 * len(system)
    assert stats["pages_cached"] > 0


def test_chunked_prefill_with_a_small_token_budget(tiny, alone):
    engine = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    prompts, params = workload()
    assert run(engine, prompts, params) == alone
    assert_clean(engine)
    assert max(len(p) for p in prompts) > 16  # so some prompts really were split


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(tiny):
    engine = make_engine(tiny)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    alone = run(engine, [[5, 6, 7, 8]], [p])[0]
    prompts, params = workload(n=12, seed=3)
    busy = run(engine, prompts[:6] + [[5, 6, 7, 8]] + prompts[6:], params[:6] + [p] + params[6:])
    assert busy[6] == alone
    assert_clean(engine)


def test_abort_frees_pages_at_once(tiny):
    engine = make_engine(tiny)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["pages_in_use"] > 0
    out = engine.abort_request("a")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    engine.abort_request("b")
    assert engine.stats()["pages_in_use"] == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request("nope") is None


def test_n_parallel_samples_share_the_prompt_pages(tiny):
    engine = make_engine(tiny)
    engine.add_request("x", list(range(3, 30)), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8,
                                                               ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


def test_bad_requests_are_rejected_with_the_value(tiny):
    engine = make_engine(tiny, warmup=False)
    with pytest.raises(ValueError, match="128"):
        engine.add_request("long", [5] * 200, SamplingParams())
    with pytest.raises(ValueError, match="256"):
        engine.add_request("vocab", [5, 256], SamplingParams())
    for token in (256, 2**31, 2**40):  # past int32 reached the device's stop-id array once
        with pytest.raises(ValueError, match=f"stop_token_ids: {token} is outside"):
            engine.add_request("stop-id", [5], SamplingParams(stop_token_ids=[token]))
    assert not engine.has_unfinished_requests()
    engine.add_request("dup", [5], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", [5], SamplingParams())
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(tiny, max_num_seqs=32, max_num_batched_tokens=16)


def test_penalties_reach_the_sampler_through_the_engine(tiny):
    engine = make_engine(tiny)
    prompt = [7, 8, 9, 7, 8, 9]
    plain = run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)])[0]
    strong = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=5.0,
                            frequency_penalty=2.0)
    penalised = run(engine, [prompt], [strong])[0]
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))  # fewer repeats
    # The same penalised request inside a batch gives the same tokens.
    prompts, params = workload(n=6, seed=5)
    assert run(engine, prompts + [prompt], params + [strong])[-1] == penalised
    assert_clean(engine)


@pytest.mark.parametrize("backend,given,want", [("cpu", None, 64), ("cpu_pallas", None, 16), ("cpu", 8, 8)])
def test_page_size_defaults_to_64_on_the_native_cpu_kernel(tiny, backend, given, want):
    # Scattered 16 KiB chunks read at twice the bandwidth of 4 KiB ones (the native backend's default).
    engine = make_engine(tiny, backend=backend, page_size=given, warmup=False, num_pages=None,
                         kv_cache_bytes=1 << 20)
    assert engine.runner.page_size == want
    assert engine.page_tables[0].page_size == want
    prompt = list(range(3, 100))  # more than one 64-token page
    assert run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])[0]
    assert_clean(engine)


def test_bfloat16_kv_cache_under_float32_weights(tiny):
    """`kv_cache_dtype="bfloat16"` (vLLM's knob): bfloat16 pages under float32 weights, twice the
    pages in the same byte budget, outputs close to float32 pages and still the same alone as in
    a batch; a bad value is rejected by name."""
    prompts, params = workload(n=12, seed=3)
    params = [dataclasses.replace(p, logprobs=3) for p in params]
    kw = dict(warmup=False, num_pages=None, kv_cache_bytes=1 << 20, page_size=16)
    engines = {dtype: make_engine(tiny, kv_cache_dtype=dtype, **kw) for dtype in ("auto", "bfloat16")}
    assert engines["auto"].runner.kv[0][0].dtype == jnp.float32
    assert engines["bfloat16"].runner.kv[0][0].dtype == jnp.bfloat16
    assert engines["bfloat16"].runner.num_pages == 2 * engines["auto"].runner.num_pages
    outs = {dtype: run_outputs(engine, prompts, params) for dtype, engine in engines.items()}
    for f32, b16 in zip(outs["auto"], outs["bfloat16"]):
        # Teacher-forcing is not available here, so compare the first sampled position only.
        first_f32, first_b16 = f32.logprobs[0], b16.logprobs[0]
        shared = set(first_f32) & set(first_b16)
        assert shared and max(abs(first_f32[t].logprob - first_b16[t].logprob) for t in shared) < 0.05
    single = make_engine(tiny, kv_cache_dtype="bfloat16", enable_prefix_caching=False, **kw)
    alone = [run(single, [p], [sp])[0] for p, sp in zip(prompts[:4], params[:4])]
    assert [o.token_ids for o in outs["bfloat16"][:4]] == alone
    assert_clean(engines["bfloat16"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'fp4'"):
        make_engine(tiny, kv_cache_dtype="fp4", **kw)
