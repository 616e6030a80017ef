"""Structured outputs below the server: the sampler's bitmask against llguidance's own reference,
the grammar compiler (cache, errors, time limit, threads), the forced tool-call reader, and the
engine with constrained and free requests mixed under multi-step decode, n > 1 and preemption."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import re
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from arch_helpers import finish
from conftest import DATA
from jserve.core.request import SamplingParams, StructuredOutputsParams
from jserve.engine import EngineConfig, build_engine
from jserve.model.checkpoint import read_params
from jserve.runtime.sampler import SamplingArrays, apply_bitmask, sample
from jserve.runtime.steps import StepRow
from jserve.structured.grammar import GrammarCompiler, GrammarError, allowed_tokens, canonical
from jserve.structured.tools import ForcedToolParser, required_schema
from jserve.text.tokenizer import Tokenizer

V = 49152


def _random_bitmask(rng, batch, vocab):
    words = (vocab + 31) // 32
    return rng.integers(-2**31, 2**31, (batch, words), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("vocab", [256, 1000, 49152])
def test_apply_bitmask_matches_llguidance_reference(vocab):
    import llguidance.numpy as llg_np

    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    mask = _random_bitmask(rng, 5, vocab)
    mask[1] = -1  # a free row
    mask[2] = 0  # nothing allowed
    want = logits.copy()
    llg_np.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_bitmask)(logits, mask))
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.flatnonzero(np.isfinite(got[3])), allowed_tokens(mask[3], vocab))


def test_sampler_respects_the_mask():
    rng = np.random.default_rng(0)
    B, vocab = 8, 1000
    logits = jnp.asarray(rng.normal(size=(B, vocab)) * 3, jnp.float32)
    mask = np.full((B, (vocab + 31) // 32), -1, np.int32)
    allowed = {}
    for b in range(0, B, 2):  # even rows constrained to a few tokens, odd rows free
        ids = rng.choice(vocab, 5, replace=False)
        mask[b] = 0
        for t in ids:
            mask[b, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        allowed[b] = set(ids.tolist())
    params = [SamplingParams(temperature=0.0 if b % 4 < 2 else 1.0, seed=b, top_k=50 if b == 4 else 0, logprobs=2,
                             repetition_penalty=1.3 if b == 6 else 1.0) for b in range(B)]
    history = (np.full((B, 16), vocab, np.int32), np.zeros((B,), np.int32))
    free = sample(logits, SamplingArrays.build([(p, 0) for p in params], B), history,
                  np.full_like(mask, -1), num_logprobs=2)
    unmasked = sample(logits, SamplingArrays.build([(p, 0) for p in params], B), history, None, num_logprobs=2)
    for key in free:
        np.testing.assert_array_equal(np.asarray(free[key]), np.asarray(unmasked[key]))
    for step in range(20):
        arrays = SamplingArrays.build([(p, step) for p in params], B)
        out = sample(logits, arrays, history, jnp.asarray(mask), num_logprobs=2)
        tokens = np.asarray(out["tokens"])
        for b in range(B):
            if b in allowed:
                assert tokens[b] in allowed[b], (b, tokens[b])
                if params[b].greedy:  # the best allowed token
                    assert tokens[b] == max(allowed[b], key=lambda t: float(logits[b, t]))
            else:
                assert tokens[b] == np.asarray(free["tokens"])[b] or not params[b].greedy
        # logprobs stay those of the model's own distribution
        lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        np.testing.assert_allclose(np.asarray(out["logprob"]), lp[np.arange(B), tokens], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"], ids=["lowered-for-TPU", "lowered-for-CUDA"])
def test_the_masked_sampler_lowers_for_tpu_and_gpu(platform):
    """The sampler with its bitmask input (what every step runs on an accelerator) lowers for
    the TPU and for CUDA on this CPU, the mask unpacked inside the step."""
    from jserve.runtime import device_steps
    from jserve.runtime.sampler import penalty_history

    B, vocab = 8, 1000
    args = (jnp.zeros((B, vocab), jnp.float32), SamplingArrays.build([], B), penalty_history([], B, 64, vocab),
            jnp.full((B, (vocab + 31) // 32), -1, jnp.int32))
    text = jax.jit(device_steps.sample_rows).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "shift_right_logical" in text and "case" in text  # the unpacking, under the switch


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return Tokenizer.load(smollm2_checkpoint)


def test_grammar_compiler_cache_errors_and_threads(tokenizer):
    compiler = GrammarCompiler(tokenizer, V, [2])
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}})
    b = StructuredOutputsParams(json='{"properties": {"b": {}, "a": {"type": "integer"}}, "type": "object"}')
    assert canonical(a) == canonical(b)
    assert compiler.compile(a) is compiler.compile(b) and compiler.num_compiled == 1
    assert canonical(a) != canonical(dataclasses.replace(a, disable_any_whitespace=False))
    for spec, needle in [(StructuredOutputsParams(regex="(a"), "regex"),
                         (StructuredOutputsParams(json={"type": "object", "propertyNames": {"maxLength": 3}}),
                          "propertyNames"),
                         (StructuredOutputsParams(json="[1, 2"), "not valid JSON"),
                         (StructuredOutputsParams(json="[1, 2]"), "JSON schema object"),
                         (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule")]:
        with pytest.raises(GrammarError, match=re.escape(needle)):
            compiler.compile(spec)
    slow = GrammarCompiler(tokenizer, V, [2])  # a compilation made to outlast its limit
    real = slow._compile
    slow._compile = lambda spec, key: (time.sleep(0.5), real(spec, key))[1]
    with pytest.raises(GrammarError, match="within"):
        slow.compile(StructuredOutputsParams(regex="[a-z]{1,40}@[0-9]{2,30}"), timeout=0.1)
    # many threads compiling the same and different constraints at once
    specs = [StructuredOutputsParams(choice=[f"x{i % 5}", "y"]) for i in range(40)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(compiler.compile, specs))
    assert len({id(c) for c in compiled}) == 5  # one per constraint: concurrent misses wait for one compilation
    for spec, c in zip(specs, compiled):
        m = c.matcher()
        for t in tokenizer.encode(spec.choice[0], add_special_tokens=False):
            assert m.consume(t)
        assert m.consume(2) and m.is_stopped
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})


def test_a_busy_compiler_is_grammar_busy(tokenizer, monkeypatch):
    import threading

    from jserve.structured.grammar import GrammarBusy

    compiler = GrammarCompiler(tokenizer, V, [2], workers=1, timeout=0.2)
    compiler.queue_timeout = 0.2
    release = threading.Event()
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec, key: (release.wait(5), real(spec, key))[1])
    slow = concurrent.futures.ThreadPoolExecutor(1).submit(compiler.compile, StructuredOutputsParams(regex="a"), 10)
    try:
        with pytest.raises(GrammarBusy, match="busy"):  # queued behind it for longer than queue_timeout
            compiler.compile(StructuredOutputsParams(regex="b"))
    finally:
        release.set()
    assert slow.result(10).key == canonical(StructuredOutputsParams(regex="a"))  # its own limit counts from its start


def test_sentencepiece_vocabulary_bytes():
    from jserve.structured.grammar import _SentencePieceTokens

    assert _SentencePieceTokens._bytes("<0x0A>") == b"\n"
    assert _SentencePieceTokens._bytes("\u2581hello") == b" hello"
    assert _SentencePieceTokens._bytes("é") == "é".encode()


def test_forced_tool_stream_equals_parse_at_any_split():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    text = '[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}}, {"name": "b", "parameters": {}}]'
    required = ForcedToolParser(None)
    content, calls = required.parse(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": [1, {"y": "]}"}]}), ("b", {})]
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        stream = required.stream()
        deltas = []
        for piece in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])):
            deltas += stream.feed(piece)[1]
        deltas += stream.finish()[1]
        assert [(d.index, d.name, d.arguments) for d in deltas] == [(i, c.name, c.arguments)
                                                                    for i, c in enumerate(calls)]
        assert [d.id for d in deltas] == [c.id for c in stream.calls]
    assert required.parse('[{"name": "a", "param')[0] == '[{"name": "a", "param'  # cut short: content
    named = ForcedToolParser("get")
    stream = named.stream()
    pieces = ['{"ci', 'ty": "Par', 'is"}']
    deltas = [d for p in pieces for d in stream.feed(p)[1]] + stream.finish()[1]
    assert deltas[0].name == "get" and deltas[0].id and all(d.id is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"city": "Paris"}' == stream.calls[0].arguments
    assert named.parse('{"city": "Pa')[1] == []
    cut = named.stream()  # cut by a stop string or max_tokens: the deltas went out, but no call counts
    cut.feed('{"city": "Pa')
    assert cut.finish() == ("", []) and cut.calls == []


# ------------------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def wide(tokenizer):
    """A tiny random model with SmolLM2's vocabulary (so every token of the tokenizer exists)."""
    config, params = read_params(DATA / "arch" / "smollm2")
    embed = np.asarray(params["embed"])
    extra = np.random.default_rng(0).normal(0, embed.std(), (V - embed.shape[0], embed.shape[1]))
    params = {**params, "embed": np.concatenate([embed, extra.astype(embed.dtype)])}
    return dataclasses.replace(config, vocab_size=V), {k: jnp.asarray(v) for k, v in params.items()}


def _engine(wide, tokenizer, **kw):
    config, params = wide
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=4, num_pages=256,
               backend="cpu", warmup=True)
    return build_engine(config, params, tokenizer, [2], EngineConfig(**{**cfg, **kw}))


def _run(engine, requests):
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return finish(engine)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "bb", "ccc"]},
                                           "list": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
          "required": ["n", "tag", "list"], "additionalProperties": False}


def test_mixed_requests_under_multi_step_n_and_preemption(wide, tokenizer):
    """Constrained requests (n=2, greedy and sampled, penalties) run beside free ones on a small
    page pool under multi-step decode: every constrained output validates, and the free ones are
    exactly what they are without any constrained request beside them."""
    engine = _engine(wide, tokenizer, num_scheduler_steps=4, num_pages=40)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 2000, rng.integers(3, 20)).tolist() for _ in range(12)]
    free = {f"free{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for i, p in enumerate(prompts[:6])}
    constrained = {f"json{i}": (p, SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, n=2, max_tokens=60,
                                                  frequency_penalty=0.5 if i == 3 else 0.0,
                                                  structured_outputs=StructuredOutputsParams(json=SCHEMA)))
                   for i, p in enumerate(prompts[6:])}
    alone = _run(engine, free)
    steps = engine.num_steps
    mixed = _run(engine, {**free, **constrained})
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool should be small enough to preempt"
    assert stats["compilations_after_warmup"] == 0 and stats["grammar_errors"] == 0
    assert stats["pages_in_use"] == 0
    for rid in free:
        assert mixed[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
    for rid in constrained:
        for out in mixed[rid].outputs:
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine.num_steps > steps


def test_runner_refuses_a_grammar_in_a_multi_step_call(wide, tokenizer):
    engine = _engine(wide, tokenizer, num_scheduler_steps=2, max_num_seqs=2, warmup=False)  # no compile check here
    matcher = engine.grammars.compile(StructuredOutputsParams(choice=["a"])).matcher()
    row = StepRow(0, [5], [1] * 32, decode_steps=2, grammar_matcher=matcher)
    with pytest.raises(ValueError, match="single steps"):
        engine.runner.execute_decode_steps([row])
    # a constrained prefill chunk samples within its grammar
    out = engine.runner.execute([StepRow(0, [5, 6, 7], [1] * 32, grammar_matcher=matcher)])
    allowed = set(tokenizer.encode("a", add_special_tokens=False))
    assert int(out.tokens[0]) in allowed
    # and so does a chunk whose prompt logprobs are scored (the runner's scoring step)
    out = engine.runner.execute([StepRow(0, [5, 6, 7], [1] * 32, prompt_targets=[6, 7, -1], grammar_matcher=matcher)])
    assert int(out.tokens[0]) in allowed and out.prompt[0] is not None


def test_a_refused_token_aborts_the_request(wide, tokenizer, monkeypatch):
    """If a grammar ever refuses a sampled token (here: its mask is never filled, so the sampler
    runs free), the request ends as "abort", counted, its pages back, the engine serving on."""
    import jserve.runtime.step_masks as step_masks

    engine = _engine(wide, tokenizer, max_num_seqs=2, warmup=False)  # nothing here checks compilation
    monkeypatch.setattr(step_masks, "fill_bitmasks", lambda rows, out: None)
    spec = StructuredOutputsParams(choice=["zzzzzzzz"])
    done = _run(engine, {"a": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec))})
    assert done["a"].outputs[0].finish_reason == "abort"
    stats = engine.stats()
    assert stats["grammar_errors"] == 1 and stats["pages_in_use"] == 0
    monkeypatch.undo()
    done = _run(engine, {"b": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec))})
    assert done["b"].outputs[0].text == "zzzzzzzz" and done["b"].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs", [{"choice": True}, {"choice": 3}, {"choice": {"a": 1}}, {"regex": 5},
                                    {"grammar": ["x"]}, {"json": 3}, {"json_object": "yes"}])
def test_structured_outputs_params_refuse_bad_types(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)
