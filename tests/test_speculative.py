"""Speculative decoding: the verify step, and the engine's output
with speculation against the same engine without it (token for token, greedy and seeded; the
sampled distribution by a chi-square test; page-table invariants after every step under random
accept lengths; composition with stops, n > 1, logprobs, penalties, prefix caching, preemption,
structured outputs and a draft model).

Most tests drive the engine with an *oracle* proposer: it proposes the reference run's own next
tokens, corrupted at a random position, so every accept length 0 .. k happens; the n-gram and
draft-model proposers get their own tests. The settings and the n-gram lookup alone:
tests/test_speculative_settings.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.core.request import SamplingParams, StructuredOutputsParams
from jserve.core.speculative import SpeculativeConfig
from jserve.engine.build import build_engine
from jserve.engine.config import EngineConfig
from jserve.runtime.steps import StepRow
from test_engine import make_engine, run_outputs, tiny, workload  # noqa: F401 (tiny: a fixture)
from test_structured_engine import tokenizer, wide  # noqa: F401 (fixtures)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}


# ------------------------------------------------------------------------------ the oracle


class OracleProposer:
    """Proposes each sequence's reference continuation (by prompt), with a wrong token at a random
    place in about half the proposals and a random length, so accept lengths cover 0 .. k."""

    def __init__(self, reference: dict[tuple, list[int]], seed: int = 0, vocab: int = 256):
        self.reference = reference
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def propose(self, requests, wanted):
        out = []
        for req, k in zip(requests, wanted):
            ref = self.reference.get(tuple(req.prompt_token_ids), [])
            done = len(req.output_token_ids)
            drafts = list(ref[done:done + int(self.rng.integers(0, k + 1))])
            if drafts and self.rng.random() < 0.5:
                j = int(self.rng.integers(len(drafts)))
                drafts[j] = (drafts[j] + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
            out.append(drafts)
        return out

    def sync(self, rows):
        pass

    def forget(self, request_id):
        pass


def checked_run(engine, prompts, params, every_step=None, compiles=0):
    """run_outputs, checking the scheduler's and page table's invariants after every step, and
    that no page is held and nothing compiled (`compiles`: the prompt-logprob step's, on first use)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
        if every_step is not None:
            every_step(engine)
    stats = engine.stats()
    assert stats["pages_in_use"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["num_pages"] - 1
    if engine.runner.warmed_up:
        assert stats["compilations_after_warmup"] <= compiles
    return [done[str(i)] for i in range(len(prompts))]


def spec_engine(tiny, reference, k=4, seed=0, **kw):
    engine = make_engine(tiny, speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw)
    engine.speculator.proposer = OracleProposer(reference, seed)
    return engine


def reference_of(prompts, outputs):
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)}


@pytest.fixture(scope="module")
def greedy_case(tiny):
    prompts, params = workload(24, seed=5)
    params = [dataclasses.replace(p, max_tokens=p.max_tokens + 8) for p in params]
    base = checked_run(make_engine(tiny), prompts, params)
    return prompts, params, base


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_output_is_identical_for_every_k_under_random_accept_lengths(tiny, greedy_case, k):
    prompts, params, base = greedy_case
    engine = spec_engine(tiny, reference_of(prompts, base), k=k, seed=k)
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = engine.stats()
    assert stats["spec_verify_steps"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert stats["spec_mean_accepted_length"] > 1


def test_accept_lengths_cover_zero_to_k_and_rejected_pages_return(tiny, greedy_case):
    """Every accept length happens, and after each step a sequence holds no page past its tokens."""
    prompts, params, base = greedy_case
    engine = spec_engine(tiny, reference_of(prompts, base), k=4, seed=11)
    lengths = set()
    execute_verify = engine.runner.execute_verify

    def spy(rows):
        out = execute_verify(rows)
        lengths.update(int(v) - 1 for v, r in zip(out.num_valid, rows) if len(r.draft_ids) == 4)
        return out

    engine.runner.execute_verify = spy

    def no_spare_pages(engine):
        table = engine.page_table
        for req in engine.scheduler.running:
            assert len(table.page_ids(req.request_id)) <= -(-req.num_tokens // table.page_size)

    checked_run(engine, prompts, params, every_step=no_spare_pages)
    assert lengths == {0, 1, 2, 3, 4}


def test_sampling_penalties_logprobs_and_stops_are_identical_with_seeds(tiny):
    prompts, _ = workload(16, seed=8)
    params = [SamplingParams(temperature=0.9, top_p=0.95 if i % 2 else 1.0, top_k=0 if i % 3 else 20, seed=i,
                             max_tokens=24, logprobs=2, repetition_penalty=1.3 if i % 4 == 0 else 1.0,
                             frequency_penalty=0.5 if i % 4 == 1 else 0.0, presence_penalty=0.4 if i % 4 == 2 else 0.0,
                             stop_token_ids=[7] if i % 5 == 0 else None, min_tokens=3 if i % 5 == 0 else 0,
                             ignore_eos=True) for i in range(16)]
    base = checked_run(make_engine(tiny), prompts, params)
    engine = spec_engine(tiny, reference_of(prompts, base), k=4, seed=3)
    spec = checked_run(engine, prompts, params)
    for b, s in zip(base, spec):
        bo, so = b.outputs[0], s.outputs[0]
        assert (so.token_ids, so.finish_reason, so.stop_reason) == (bo.token_ids, bo.finish_reason, bo.stop_reason)
        for t, lb, ls in zip(bo.token_ids, bo.logprobs, so.logprobs):
            assert set(lb) == set(ls)
            assert abs(lb[t].logprob - ls[t].logprob) < 1e-4 and lb[t].rank == ls[t].rank
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_stop_strings_n_samples_and_prompt_logprobs_compose(tiny):
    prompts, _ = workload(8, seed=9)
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=20, ignore_eos=True,
                             prompt_logprobs=1 if i == 0 else None) for i in range(8)]
    base = checked_run(make_engine(tiny), prompts, params, compiles=1)
    # A stop string from the middle of one sample's text: the step that accepts past it is cut there.
    text = base[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3] if len(text) > 6 else None
    if stop:
        params[1] = dataclasses.replace(params[1], stop=[stop])
        base = checked_run(make_engine(tiny), prompts, params, compiles=1)
    reference = {}
    for p, o in zip(prompts, base):
        reference[tuple(p)] = list(o.outputs[0].token_ids)  # the oracle knows sample 0; sample 1 gets misses
    spec = checked_run(spec_engine(tiny, reference, k=3, warmup=True), prompts, params, compiles=1)
    for b, s in zip(base, spec):
        assert [(o.token_ids, o.text, o.finish_reason) for o in s.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in b.outputs]
    assert [lp and set(lp) for lp in spec[0].prompt_logprobs] == [lp and set(lp) for lp in base[0].prompt_logprobs]


def test_prefix_caching_and_preemption(tiny):
    shared = list(range(10, 30))
    prompts, params = workload(24, seed=2, shared_prefix=shared)
    params = [dataclasses.replace(p, max_tokens=p.max_tokens + 10) for p in params]
    kw = dict(num_pages=40, enable_prefix_caching=True)  # 39 pages of 4 tokens: preemptions happen
    base_engine = make_engine(tiny, **kw)
    base = checked_run(base_engine, prompts, params)
    # Warmed up: nothing compiles after it, verify steps, preemptions and prefix hits included.
    engine = spec_engine(tiny, reference_of(prompts, base), k=4, seed=4, warmup=True, **kw)
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_structured_outputs_compose(wide, tokenizer):
    """A JSON schema: drafts the grammar refuses are cut before the verify step, each position's
    mask is the grammar after the drafts before it, and the output is unchanged."""
    from test_structured_engine import SCHEMA, V, _engine

    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, V, int(rng.integers(3, 20))).tolist() for _ in range(6)]
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=60, structured_outputs=so) for i in range(6)]
    base = checked_run(_engine(wide, tokenizer), prompts, params)
    engine = _engine(wide, tokenizer, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    engine.speculator.proposer = OracleProposer(reference_of(prompts, base), seed=6, vocab=V)
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert engine.stats()["grammar_errors"] == 0 and engine.stats()["spec_accepted_tokens"] > 0
    assert all(json.loads(o.outputs[0].text) for o in spec if o.outputs[0].finish_reason == "stop")


def _chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """The chi-square quantile 1 - alpha by Wilson and Hilferty's approximation (z for 1e-3: 3.09)."""
    z = {1e-3: 3.090}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_distribution_is_the_targets(tiny):
    """Disjoint seeds with and without speculation: the joint distribution of the second and
    third sampled tokens (each usually decided at a draft position) passes a chi-square
    homogeneity test, and it is no trivial one (the two samples differ token for token)."""
    prompt = workload(1, seed=13)[0][0]
    n = 600
    make = lambda seed0: [SamplingParams(temperature=1.0, top_k=3, seed=seed0 + i, max_tokens=3, ignore_eos=True)  # noqa: E731
                          for i in range(n)]
    base = checked_run(make_engine(tiny, max_num_seqs=16), [prompt] * n, make(0))
    reference = {}

    class Sampled(OracleProposer):  # proposes the base run's most common continuation
        def propose(self, requests, wanted):
            return [[common[len(r.output_token_ids)]][:k] if len(r.output_token_ids) < 3 else [] for r, k in
                    zip(requests, wanted)]

    firsts = [tuple(o.outputs[0].token_ids) for o in base]
    common = max(set(firsts), key=firsts.count)
    engine = make_engine(tiny, max_num_seqs=16, speculative_config={**NGRAM, "num_speculative_tokens": 2})
    engine.speculator.proposer = Sampled(reference)
    spec = checked_run(engine, [prompt] * n, make(10_000))
    a = [tuple(o.outputs[0].token_ids[1:3]) for o in base]
    b = [tuple(o.outputs[0].token_ids[1:3]) for o in spec]
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]], float)
    keep = table.sum(0) >= 10  # pool rare cells so each expected count is large enough
    table = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(table.shape[1] - 1), (chi2, table)
    assert engine.stats()["spec_accepted_tokens"] > 50 and a != b


# ------------------------------------------------------------------------------ proposers and policy


def test_ngram_speculation_on_a_repetitive_model_keeps_greedy_output(tiny, greedy_case):
    prompts, params, base = greedy_case
    engine = make_engine(tiny, speculative_config={**NGRAM, "num_speculative_tokens": 5})
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert engine.stats()["spec_accepted_tokens"] > 0  # the random tiny model loops: lookups hit


def test_draft_model_proposer(tiny, greedy_case):
    """A draft model with the target's weights is always right (its mirrored pages hold the right
    K/V after prefill chunks, accepted drafts and rejected ones); a perturbed one rarely is; the
    output is the target's either way."""
    prompts, params, base = greedy_case
    config, weights, tokenizer = tiny
    rng = np.random.default_rng(0)
    noisy = {k: v + 0.03 * jnp.asarray(rng.standard_normal(v.shape), v.dtype) for k, v in weights.items()}
    settings = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=4, num_pages=200,
                    backend="cpu", speculative_config={"method": "draft_model", "model": "tiny",
                                                       "num_speculative_tokens": 3, "disable_by_batch_size": 64,
                                                       "min_acceptance": 0})
    rates = []
    for draft in (weights, noisy):
        engine = build_engine(config, weights, tokenizer, [], EngineConfig(**settings), draft=(config, draft))
        spec = checked_run(engine, prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
        rates.append(engine.stats()["spec_acceptance_rate"])
    assert rates[0] == 1.0 and rates[1] < 1.0
    short = dataclasses.replace(config, max_position_embeddings=64)
    with pytest.raises(ValueError, match="draft model's context"):
        build_engine(config, weights, tokenizer, [], EngineConfig(**settings), draft=(short, weights))
    wide = dataclasses.replace(config, vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary"):
        build_engine(config, weights, tokenizer, [], EngineConfig(**settings), draft=(wide, weights))


def test_large_batches_turn_speculation_down(tiny, greedy_case):
    prompts, params, base = greedy_case
    engine = spec_engine(tiny, reference_of(prompts, base), k=4)
    engine.speculator.disable_by_batch_size = 3
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = engine.stats()
    assert stats["spec_turned_down_steps"] > 0
    # With 8 seats and 24 requests, speculation runs only once the queue has drained to <= 3 decodes.
    assert stats["spec_verify_steps"] < stats["num_steps"]


def test_low_acceptance_rests_a_sequence(tiny, greedy_case):
    prompts, params, base = greedy_case
    wrong = {tuple(p): [(t + 1) % 256 for t in o.outputs[0].token_ids] for p, o in zip(prompts, base)}
    engine = make_engine(tiny, speculative_config={**NGRAM, "acceptance_window": 4, "backoff_steps": 1000})
    engine.speculator.proposer = OracleProposer(wrong)
    engine.speculator.proposer.rng = np.random.default_rng(1)
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == 0
    # Each sequence proposes until its 4-token window fills, then rests for the rest of its run.
    assert stats["spec_proposed_tokens"] <= 24 * (4 + 3)


# ------------------------------------------------------------------------------ the verify step


def test_verify_step_samples_what_single_steps_sample(tiny):
    """execute_verify on the greedy continuation accepts all of it and gives each position's
    logprobs as plain decode steps do; a wrong draft is rejected with the right token instead."""
    engine = make_engine(tiny, speculative_config=NGRAM)
    runner = engine.runner
    prompt = list(range(3, 21))
    base = make_engine(tiny)
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = run_outputs(base, [prompt], [greedy])[0]
    pages = list(range(1, 10))
    # Prefill the prompt but its last token, then verify [last, greedy continuation].
    runner.execute([StepRow(0, prompt[:-1], pages)])
    cont = out.token_ids
    got = runner.execute_verify([StepRow(len(prompt) - 1, prompt[-1:], pages, SamplingParams(temperature=0, logprobs=3),
                                         draft_ids=cont[:4])])
    assert int(got.num_valid[0]) == 5 and got.tokens[:, 0].tolist() == cont[:5]
    for j in range(5):
        assert abs(float(got.logprob[j, 0]) - out.logprobs[j][cont[j]].logprob) < 1e-4
    wrong = [cont[0], (cont[1] + 1) % 256, cont[2]]
    got = runner.execute_verify([StepRow(len(prompt) - 1, prompt[-1:], pages, greedy, draft_ids=wrong)])
    assert int(got.num_valid[0]) == 2 and got.tokens[:2, 0].tolist() == cont[:2]
    with pytest.raises(ValueError, match="at most 4 drafts"):
        runner.execute_verify([StepRow(0, [1], pages, draft_ids=[1] * 5)])
    with pytest.raises(ValueError, match="needs 2 pages"):
        runner.execute_verify([StepRow(2, [1], [1], draft_ids=[1, 2])])


def test_verify_step_lowers_for_tpu_and_cuda(tiny):
    """The verify step (the model over k + 1 tokens per row and the sampler at every position)
    lowers for TPU and CUDA with the XLA backend's real kernels."""
    config, params, tokenizer = tiny
    for backend, platform in (("tpu", "tpu"), ("gpu", "cuda")):
        engine = build_engine(config, {k: v.astype(jnp.bfloat16) for k, v in params.items()}, tokenizer, [],
                              EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=16,
                                           num_pages=16, backend=backend, warmup=False, kv_cache_dtype="bfloat16",
                                           speculative_config=NGRAM))
        runner = engine.runner
        B, T = 4, 5
        rows = [StepRow(0, [1] + [2] * 4, [1] * runner.max_pages)] * B
        (tokens, positions, meta, _), drafts = runner.pack(rows, B, T), np.zeros((B, 4), np.int32)
        sampling, history = runner.sampling_inputs(rows, B)
        mask = runner.masks.ones(B * T)
        text = runner.multi.verify_fn(B, T).trace(runner.params, runner.kv, tokens, positions, meta, drafts, sampling,
                                             history, mask).lower(lowering_platforms=(platform,)).as_text()
        # (the tiny model's head_dim 16 takes the reference attention on a GPU, Mosaic on a TPU)
        assert "tpu_custom_call" in text if platform == "tpu" else "stablehlo" in text


def test_config_json_round_trip_in_stats(tiny):
    engine = make_engine(tiny, speculative_config=json.dumps(NGRAM))
    assert engine.config.speculative_config == SpeculativeConfig(**NGRAM)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] == 0 and stats["spec_acceptance_rate"] == 0.0


def test_draft_masks_are_the_masks_after_each_draft(tokenizer):
    from jserve.structured.grammar import GrammarCompiler, bitmask_width, fill_bitmasks, fill_bitmasks_with_drafts
    from test_structured_engine import V

    grammar = GrammarCompiler(tokenizer, V, [2]).compile(StructuredOutputsParams(regex=r"(ab|cd)+ [0-9]{2,4}"))
    drafts = tokenizer.encode("abcdab 12", add_special_tokens=False)
    matcher = grammar.matcher()
    assert matcher.valid_prefix(drafts) == len(drafts)
    assert matcher.valid_prefix(drafts + tokenizer.encode("x", add_special_tokens=False)) == len(drafts)
    got = np.zeros((len(drafts) + 2, bitmask_width(V)), np.int32)
    fill_bitmasks_with_drafts([(matcher, 1, drafts)], got)
    reference = grammar.matcher()
    for j in range(len(drafts) + 1):
        row = np.zeros((1, got.shape[1]), np.int32)
        fill_bitmasks([(reference, 0)], row)
        assert np.array_equal(got[1 + j], row[0]), j
        if j < len(drafts):
            assert reference.consume(drafts[j])
    assert not got[0].any()  # rows outside 1 .. 1 + len(drafts) are left alone
    assert matcher.valid_prefix(drafts) == len(drafts)  # the matcher is where it began


def test_quantized_target(tiny, greedy_case):
    """An int4-quantized target verifies as its plain decoding samples. On the float path: the
    integer path (int8 activations) serves calls of 8 rows or more, so a verify call (k + 1 rows a
    sequence) and a plain decode call of fewer sequences would round differently."""
    from jserve.model import quant

    config, weights, tokenizer = tiny
    host = {k: np.asarray(v) for k, v in weights.items()}
    q = quant.quantize_params(config, host, quant.QuantSpec.parse("int4", None))
    prompts, params, _ = greedy_case
    prompts, params = prompts[:8], params[:8]
    settings = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=4, num_pages=200,
                    backend="cpu", int8_activations=False)
    base = checked_run(build_engine(config, q, tokenizer, [], EngineConfig(**settings)), prompts, params)
    engine = build_engine(config, q, tokenizer, [], EngineConfig(**settings, speculative_config=NGRAM))
    engine.speculator.proposer = OracleProposer(reference_of(prompts, base), seed=9)
    spec = checked_run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert engine.stats()["spec_accepted_tokens"] > 0
