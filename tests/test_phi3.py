"""Phi-3 (fused weights, sliding window, partial rotary, LongRoPE) against transformers.

The tiny random models in tests/data/arch/phi3 and phi3_longrope (tests/tools/make_arch_goldens.py):
`phi3` is Phi-3-mini-4k's layer (qkv_proj and gate_up_proj fused, a sliding window of 8 on every
layer, full rotary); `phi3_longrope` Phi-3.5 / Phi-4-mini's (partial rotary 0.75, LongRoPE with an
original context of 12 tokens, tied). transformers rotates a sequence of at most 12 tokens by the
short factors and a longer one, every position of it, by the long ones: a forward pass by its
length, and generate() recomputes its cache when a sequence passes 12 (reference.npz: `logits`
of 24 tokens, all long; `logits_short` of the first 12; `greedy_ids` from a 10-token prompt,
crossing over; `greedy_long_ids` from a 16-token prompt). The engine flags a long sequence's
rotary positions (`StepRow.seq_len`) and its scheduler recomputes a sequence as it passes 12
(`SchedulerConfig.recompute_past`), so both greedy runs must come out of the paged engine with
chunked prefill, preemption, prefix caching, multi-step decode and speculation.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.page_table import PageTable
from jserve.core.plan import Request, RequestStatus
from jserve.core.request import SamplingParams
from jserve.core.scheduler import Scheduler, SchedulerConfig, tokens_before_recompute
from jserve.engine import EngineConfig, build_engine
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params, quant
from jserve.model.checkpoint import read_params
from jserve.model.config import LONG_ROPE_FLAG, ModelConfig
from jserve.runtime import backends

PHIS = ["phi3", "phi3_longrope"]
ORIG = 12  # phi3_longrope's original_max_position_embeddings


def _hf_config(arch):
    return json.loads((DATA / "arch" / arch / "config.json").read_text())


def _engine(config, params, backend="reference", **kw):
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=4, page_size=4, num_pages=64,
                    backend=backends.create(backend), warmup=False, enable_prefix_caching=False)
    return build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**settings, **kw}))


def _greedy(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), [int(t) for t in p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = finish(engine)
    return [list(outs[str(i)].outputs[0].token_ids) for i in range(len(prompts))]


# ------------------------------------------------------------------------------ configs


def test_phi3_configs_parse():
    p3 = ModelConfig.from_hf_config(_hf_config("phi3"))
    lr = ModelConfig.from_hf_config(_hf_config("phi3_longrope"))
    assert (p3.architecture, p3.sliding_window, p3.rotary_dim, p3.rope_scaling) == ("phi3", 8, None, None)
    assert p3.llama_layer and not p3.tie_word_embeddings and p3.long_rope_after is None and not p3.long_rope(10**6)
    s = lr.rope_scaling
    assert (lr.rotary_dim, lr.rope_dim, lr.head_dim, lr.sliding_window) == (12, 12, 16, None)
    assert s.rope_type == "longrope" and s.original_max_position_embeddings == ORIG and len(s.long_factor) == 6
    assert s.factor == 256 / ORIG
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / ORIG) / math.log(ORIG)))
    assert lr.long_rope_after == ORIG and not lr.long_rope(ORIG) and lr.long_rope(ORIG + 1)
    assert not lr.llama_layer  # partial rotary: not the fused native layers' layer
    assert lr.tie_word_embeddings and lr.num_params() == 90_432  # transformers' count (README)
    for c in (p3, lr):
        assert ModelConfig.from_json(c.to_json()) == c


def test_real_checkpoint_configs():
    """Phi-3-mini-4k, Phi-3.5-mini (LongRoPE, "su" in Phi-3-mini-128k's first config) and
    Phi-4-mini (partial rotary 0.75, tied) as transformers 4.x wrote them (top-level keys)."""
    base = dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, rope_theta=10000.0)
    mini = ModelConfig.from_hf_config({**base, "max_position_embeddings": 4096, "rope_scaling": None,
                                       "original_max_position_embeddings": 4096, "sliding_window": 2047})
    assert mini.sliding_window == 2047 and mini.rope_scaling is None and mini.llama_layer
    long = {"long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0] * 48}
    for kind in ("longrope", "su"):
        c = ModelConfig.from_hf_config({**base, "max_position_embeddings": 131072, "sliding_window": 262144,
                                        "original_max_position_embeddings": 4096,
                                        "rope_scaling": {"type": kind, **long}})
        assert c.rope_scaling.rope_type == "longrope" and c.long_rope_after == 4096 and c.llama_layer
        assert c.rope_scaling.attention_factor == pytest.approx(1.1902380714238083)  # sqrt(1 + ln 32 / ln 4096)
    phi4 = ModelConfig.from_hf_config({
        **base, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
        "partial_rotary_factor": 0.75, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "sliding_window": 262144, "tie_word_embeddings": True,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}})
    assert (phi4.head_dim, phi4.rotary_dim, phi4.num_kv_heads) == (128, 96, 8) and phi4.tie_word_embeddings
    explicit = ModelConfig.from_hf_config({**base, "max_position_embeddings": 131072,
                                           "original_max_position_embeddings": 4096,
                                           "rope_scaling": {"type": "longrope", **long, "attention_factor": 1.0}})
    assert explicit.rope_scaling.attention_factor == 1.0


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 6, "rope_theta": 1e4}},
     "short_factor and long_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                          "rope_theta": 1e4, "partial_rotary_factor": 0.75}}, "rotary_dim / 2 = 6"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                          "short_mscale": 1.2, "rope_theta": 1e4, "partial_rotary_factor": 0.75}}, "short_mscale"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_phi3_variants_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**_hf_config("phi3_longrope"), **change})


# ------------------------------------------------------------------------------ weights and logits


def test_fused_weights_are_split_at_load():
    """qkv_proj's rows are q (4 heads), k, v (2 heads each); gate_up_proj's gate then up: split into
    the Llama layer's own weights ([in, out]), so sharding and the fused native layers need nothing new."""
    from safetensors.numpy import load_file

    raw = load_file(DATA / "arch" / "phi3" / "model.safetensors")
    config, params = read_params(DATA / "arch" / "phi3")
    qkv, gate_up = raw["model.layers.1.self_attn.qkv_proj.weight"], raw["model.layers.1.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(params["wq"][1], qkv[:64].T)
    np.testing.assert_array_equal(params["wk"][1], qkv[64:96].T)
    np.testing.assert_array_equal(params["wv"][1], qkv[96:].T)
    np.testing.assert_array_equal(params["w_gate"][1], gate_up[:128].T)
    np.testing.assert_array_equal(params["w_up"][1], gate_up[128:].T)
    assert not any(k for k in params if "qkv" in k or "gate_up" in k)


def _forward(config, params, ids, layout="list"):
    """Logits over a contiguous cache; a sequence longer than the original context rotates by the
    long factors (LONG_ROPE_FLAG), as one forward pass of transformers does."""
    B, T = ids.shape
    stacked = layout == "stacked"
    model = nnx.merge(model_graphdef(config, layout), model_params(config, params, layout))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    rope = positions + LONG_ROPE_FLAG if config.long_rope(T) else positions
    cache = init_cache(config.num_layers, B, config.num_kv_heads, T, config.head_dim, stacked=stacked)
    ops = XlaOps(DenseAttention(config.sliding_window, stacked=stacked), scan=stacked)
    return np.asarray(model(jnp.asarray(ids), rope, cache, positions, ops)[0])


@pytest.mark.parametrize("layout", ["list", "stacked"])
@pytest.mark.parametrize("arch", PHIS)
def test_logits_match_transformers(arch, layout):
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    config, params = load_arch(arch)
    np.testing.assert_allclose(_forward(config, params, ref["input_ids"], layout), ref["logits"], atol=1e-4, rtol=0)
    if "logits_short" in ref:  # the first 12 tokens alone: the short factors
        short = _forward(config, params, ref["input_ids"][:, :ORIG], layout)
        np.testing.assert_allclose(short, ref["logits_short"], atol=1e-4, rtol=0)
        assert np.abs(short - ref["logits"][:, :ORIG]).max() > 0.1  # the long factors differ


def test_cached_greedy_decode_matches_transformers():
    """phi3 (no LongRoPE): prefill + single-token steps over the contiguous cache (the window of 8
    slides past the 10-token prompt)."""
    ref = np.load(DATA / "arch" / "phi3" / "reference.npz")
    config, params = load_arch("phi3")
    model = nnx.merge(model_graphdef(config), model_params(config, params))
    ops = XlaOps(DenseAttention(config.sliding_window))
    step = jax.jit(lambda tokens, positions, cache: model(tokens, positions, cache, positions, ops,
                                                          logits_index=jnp.full((1, 1), tokens.shape[1] - 1)))
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    cache = init_cache(config.num_layers, 1, config.num_kv_heads, 18, config.head_dim)
    logits, cache = step(jnp.asarray([prompt]), jnp.arange(10)[None], cache)
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(7):
        logits, cache = step(jnp.asarray([[tokens[-1]]]), jnp.asarray([[len(prompt) + len(tokens) - 1]]), cache)
        tokens.append(int(jnp.argmax(logits[0, -1])))
    assert tokens == ref["greedy_ids"][0].tolist()


# ------------------------------------------------------------------------------ the paged engine


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("arch", PHIS)
def test_paged_greedy_decode_with_chunked_prefill_and_preemption(arch, backend):
    """transformers' greedy tokens: prompts prefilled in chunks of 4, six sequences, up to four at a
    time, over 11 pages of 4 tokens (8 for phi3_longrope's short prompt, whose recomputes past 12
    tokens free pages too; 7 for phi3, whose sequences give back the pages behind its sliding
    window), so some are preempted and recomputed. phi3_longrope: the 10-token
    prompt's sequences pass 12 tokens while decoding (each is recomputed there, by the long
    factors), and the 16-token prompt's are long from their first chunk (positions 0..3 included)."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    cases = [(10, ref["greedy_ids"][0].tolist())]
    if "greedy_long_ids" in ref:
        cases.append((16, ref["greedy_long_ids"][0].tolist()))
    for prompt_len, want in cases:
        # phi3's window of 8 lets each sequence give back the pages behind it: fewer pages then.
        pages = 8 if config.shared_window else 9 if config.long_rope_after and prompt_len == 10 else 12
        engine = _engine(config, params, backend, num_pages=pages)
        if backend == "cpu":  # the fused native decode layers are the Llama layer's: full rotary only
            assert engine.runner.ops.fused == config.llama_layer
        got = _greedy(engine, [ref["input_ids"][0, :prompt_len]] * 6)
        assert got == [want] * 6, (prompt_len, got)
        stats = engine.stats()
        assert stats["num_preemptions"] > 0 and stats["pages_in_use"] == 0, stats
        recomputes = engine.scheduler.num_recomputes
        assert recomputes == (6 if arch == "phi3_longrope" and prompt_len <= ORIG else 0), recomputes


@pytest.mark.parametrize("arch", PHIS)
def test_paged_engine_prompt_logprobs_match_transformers(arch):
    """Every position's log-probabilities of the 24-token input (chunks of 8 over pages of 4): a
    LongRoPE sequence longer than 12 is long at each position, its chunks before 12 included; the
    first 12 tokens alone are short."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    cases = [("logits", 24)] + ([("logits_short", ORIG)] if "logits_short" in ref else [])
    for key, n in cases:
        engine = _engine(config, params, max_num_batched_tokens=8)
        ids = [int(t) for t in ref["input_ids"][0, :n]]
        want = np.asarray(jax.nn.log_softmax(jnp.asarray(ref[key][0]), axis=-1))
        engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
        got = finish(engine)["a"].prompt_logprobs
        diff = [abs(entry[ids[q + 1]].logprob - want[q][ids[q + 1]]) for q, entry in enumerate(got[1:])]
        assert len(diff) == n - 1 and max(diff) < 1e-4, (key, max(diff))


def test_prefix_cache_never_shares_pages_across_longrope_sides():
    """With prefix caching, a 16-token prompt (long) and the same ids' first 10 (short) share their
    first two pages' tokens but not their rotation: each still decodes as transformers does, in
    either order; the same short prompt again hits the cache."""
    config, params = load_arch("phi3_longrope")
    ref = np.load(DATA / "arch" / "phi3_longrope" / "reference.npz")
    short, long = ref["input_ids"][0, :10], ref["input_ids"][0, :16]
    want = {10: ref["greedy_ids"][0].tolist(), 16: ref["greedy_long_ids"][0].tolist()}
    for order in ([long, short], [short, long]):
        engine = _engine(config, params, enable_prefix_caching=True, max_num_seqs=1)
        for prompt in order:  # one after the other: the second finds the first's pages cached
            assert _greedy(engine, [prompt]) == [want[len(prompt)]]
        # Hits on the long side only: the short sequence's recompute past 12 tokens takes the long
        # one's first two pages, or the long prompt the recomputed short sequence's.
        assert engine.page_table.num_prefix_hit_tokens == 8
        engine.add_request("again", [int(t) for t in short], SamplingParams(temperature=0, max_tokens=1))
        finish(engine)  # the short side's two pages, from the short sequence's first prefill
        assert engine.page_table.num_prefix_hit_tokens == 16


def test_multi_step_decode_and_speculation_stop_at_the_switch():
    """A multi-step decode call (4 steps) and a speculative step's drafts never run a sequence
    across 12 tokens: the recompute follows the call, and the tokens are transformers'."""
    config, params = load_arch("phi3_longrope")
    ref = np.load(DATA / "arch" / "phi3_longrope" / "reference.npz")
    prompt = ref["input_ids"][0, :10]
    for kw in ({"num_scheduler_steps": 4},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                       "disable_by_batch_size": 8}}):
        engine = _engine(config, params, **kw)
        assert _greedy(engine, [prompt, prompt]) == [ref["greedy_ids"][0].tolist()] * 2, kw
        assert engine.scheduler.num_recomputes == 2
        assert engine.speculator is None or engine.speculator.num_verify_steps > 0


def test_fused_native_layers_run_full_rotary_longrope():
    """A full-rotary LongRoPE model (Phi-3.5-mini's kind: the fused native decode layers take its
    per-token tables, attention factor included) gives the reference backend's tokens and
    logprobs, across the switch at 12 tokens and from a long prompt (no transformers reference:
    phi3_longrope's weights with all 16 dims rotating)."""
    config, params = load_arch("phi3_longrope")
    s = config.rope_scaling
    full = dataclasses.replace(config, rotary_dim=None, rope_scaling=dataclasses.replace(
        s, short_factor=s.short_factor + (1.5, 1.2), long_factor=s.long_factor + (60.0, 80.0)))
    ref = np.load(DATA / "arch" / "phi3_longrope" / "reference.npz")
    outs = {}
    for backend in ("cpu", "reference"):
        engine = _engine(full, params, backend)
        assert getattr(engine.runner.ops, "fused", False) == (backend == "cpu")
        for i, n in enumerate((10, 16)):
            engine.add_request(str(i), [int(t) for t in ref["input_ids"][0, :n]],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
        outs[backend] = [o.outputs[0] for _, o in sorted(finish(engine).items())]
    for got, want in zip(outs["cpu"], outs["reference"]):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                                   [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)], atol=1e-4)


def test_scheduler_recomputes_a_request_as_it_passes_recompute_past():
    table = PageTable(32, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                                      enable_prefix_caching=True, num_scheduler_steps=4, recompute_past=6),
                      table)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20), 0.0)
    sched.add_request(req)
    assert sched._cache_salt(req) is None
    plan = sched.schedule()
    sched.update(plan, {"a": 4})  # 4 tokens
    plan = sched.schedule()  # multi-step decode: at most 3 samples (to 7 tokens, computing up to 6)
    assert plan.chunks[0].decode_steps == tokens_before_recompute(4, 6) == 3
    for token in (5, 6):
        sched.update(plan, {"a": token})
        plan.chunks[0] = sched.next_decode_step(plan.chunks[0])
    sched.update(plan, {"a": 7})  # 7 tokens: past 6
    assert req.status is RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert (sched.num_recomputes, sched.num_preemptions, req.num_preemptions) == (1, 0, 0)
    assert sched._cache_salt(req) == "\x00past-6"
    sched.check_invariants()
    plan = sched.schedule()  # recomputed from the first token, in chunks (8 tokens a step)
    assert plan.chunks[0].start == 0 and plan.chunks[0].num_tokens == 7 and plan.chunks[0].emits_token
    assert tokens_before_recompute(7, 6) is None and tokens_before_recompute(3, None) is None
    with pytest.raises(ValueError, match="recompute_past"):
        SchedulerConfig(recompute_past=0)


# ------------------------------------------------------------------------------ GGUF


def _write_gguf(arch, config, folder, path, qkv_type=None):
    """The tiny HF model as llama.cpp's converter writes a phi3 GGUF: attn_qkv and ffn_up (gate and
    up) fused, no rotary permutation, rope.dimension_count, the sliding window (0: none), LongRoPE's
    factors as rope_factors_long / _short with rope.scaling.original_context_length and attn_factor.
    `qkv_type`: the attn_qkv tensors quantized to that GGML type."""
    import gguf
    from safetensors.numpy import load_file

    tensors = load_file(folder / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, config.num_layers)
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(config.max_position_embeddings)
    s = config.rope_scaling
    w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings if s else config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_layers)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.rope_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_sliding_window(config.sliding_window or 0)
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    if s is not None:
        w.add_rope_scaling_attn_factors(s.attention_factor)
        w.add_tensor("rope_factors_long.weight", np.asarray(s.long_factor, np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(s.short_factor, np.float32))
    for hf_name, a in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if qkv_type is not None and name.endswith("attn_qkv.weight"):
            w.add_tensor(name, gguf.quants.quantize(a, qkv_type), raw_dtype=qkv_type)
        else:
            w.add_tensor(name, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", PHIS)
def test_gguf_of_the_same_weights_reads_as_the_hf_folder(arch, tmp_path):
    folder = DATA / "arch" / arch
    hf_config, hf_params = read_params(folder)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(arch, hf_config, folder, path)
    config, params = read_params(path)
    want = dataclasses.replace(hf_config, bos_token_id=None, eos_token_ids=(),
                               rms_norm_eps=float(np.float32(hf_config.rms_norm_eps)))
    if hf_config.rope_scaling is not None:  # float32 tensors and metadata
        s = hf_config.rope_scaling
        want = dataclasses.replace(want, rope_scaling=dataclasses.replace(
            s, short_factor=tuple(float(np.float32(f)) for f in s.short_factor),
            long_factor=tuple(float(np.float32(f)) for f in s.long_factor),
            attention_factor=float(np.float32(s.attention_factor))))
    assert config == want
    assert set(params) == set(hf_params)
    for name, a in params.items():
        np.testing.assert_array_equal(a, hf_params[name], err_msg=name)


def test_gguf_quantized_fused_qkv_splits_along_output_channels(tmp_path):
    """A Q8_0 attn_qkv read with keep_quantized: three QuantizedWeights whose dequantization is
    the fused tensor's, column for column (no float copy)."""
    import gguf

    folder = DATA / "arch" / "phi3"
    hf_config, _ = read_params(folder)
    path = tmp_path / "q8.gguf"
    _write_gguf("phi3", hf_config, folder, path, qkv_type=gguf.GGMLQuantizationType.Q8_0)
    _, floats = read_params(path)
    _, params = read_params(path, keep_quantized=True)
    for name in ("wq", "wk", "wv"):
        assert quant.is_quantized(params[name]) and params[name].scheme == "int8", name
        np.testing.assert_array_equal(np.asarray(quant.dequantize(params[name])), floats[name], err_msg=name)
    assert not quant.is_quantized(params["w_gate"])


def test_gguf_phi3_metadata():
    """Phi-4-mini as llama.cpp writes it: rope.dimension_count 96 of head_dim 128, no sliding
    window (0), LongRoPE factors from its tensors, the attention factor from the metadata."""
    meta = {"general.architecture": "phi3", "phi3.embedding_length": 3072, "phi3.block_count": 32,
            "phi3.feed_forward_length": 8192, "phi3.attention.head_count": 24, "phi3.attention.head_count_kv": 8,
            "phi3.vocab_size": 200064, "phi3.rope.dimension_count": 96, "phi3.attention.sliding_window": 0,
            "phi3.context_length": 131072, "phi3.rope.scaling.original_context_length": 4096,
            "phi3.rope.scaling.attn_factor": 1.19}
    factors = ([2.0] * 48, [1.0] * 48)
    c = ModelConfig.from_gguf_metadata(meta, has_output_tensor=False, rope_factors=factors)
    assert (c.architecture, c.head_dim, c.rotary_dim, c.sliding_window, c.tie_word_embeddings) == \
        ("phi3", 128, 96, None, True)
    assert c.rope_scaling.long_factor == (2.0,) * 48 and c.rope_scaling.attention_factor == 1.19
    assert c.long_rope_after == 4096
    plain = ModelConfig.from_gguf_metadata({**meta, "phi3.rope.dimension_count": 128}, has_output_tensor=True)
    assert plain.rope_scaling is None and plain.rotary_dim is None
    with pytest.raises(ValueError, match="phi3 only"):
        ModelConfig.from_gguf_metadata({**{k.replace("phi3.", "llama."): v for k, v in meta.items()},
                                        "general.architecture": "llama"}, has_output_tensor=True, rope_factors=factors)
