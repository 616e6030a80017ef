"""Multi-LoRA serving against Hugging Face PEFT (tests/data/lora, made by
tests/tools/make_lora_goldens.py): each adapter's greedy tokens and prompt logprobs on the tiny
Llama 3 and Qwen2 checkpoints, alone and with the base model and the other adapters mixed in one
batch, with chunked prefill, preemption, fewer slots than adapters, and on a dp=2,tp=2 mesh."""

from __future__ import annotations

import numpy as np
import pytest

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.lora_slots import LoRARequest
from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig, build_engine

ADAPTERS = ("a", "b", "c")
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def lora_request(model: str, name: str) -> LoRARequest:
    return LoRARequest(name, ADAPTERS.index(name) + 1, str(DATA / "lora" / model / name))


def input_ids(model: str) -> np.ndarray:
    """The fixed ids PEFT's references were computed on: the arch golden's int32 [2, 24]."""
    return np.load(DATA / "arch" / model / "reference.npz")["input_ids"]


def engine_for(model: str, **settings):
    """Not warmed up unless `warmup=True` (a test that checks that nothing compiles after warm-up
    asks for it): compiling every bucket costs an engine 15 to 20 s, the shapes a test runs 2 to 3 s."""
    config, params = load_arch(model)
    base = dict(backend="native", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, page_size=4,
                num_pages=128, enable_lora=True, max_loras=3, max_lora_rank=16, warmup=False)
    return build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**base, **settings}))


def run(engine, requests, model="llama3"):
    """requests: (request id, prompt ids, adapter name or None) of `model`'s adapters; their
    outputs' token ids by id."""
    for rid, prompt, name in requests:
        lora = None if name is None else lora_request(model, name)
        engine.add_request(rid, prompt, GREEDY8, lora_request=lora)
    return {rid: list(out.outputs[0].token_ids) for rid, out in finish(engine).items()}


def check_prompt_logprobs(engine, model, ref, ids, name, atol):
    """Each position's logprob of the next prompt token under adapter `name` (None: the base
    model), against the log-softmax of PEFT's logits in `ref`."""
    lora = None if name is None else lora_request(model, name)
    engine.add_request(f"p-{name}", ids, SamplingParams(max_tokens=1, prompt_logprobs=0), lora_request=lora)
    out = finish(engine)[f"p-{name}"]
    logits = ref[f"logits_{name or 'base'}"][0].astype(np.float64)
    want = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    got = [out.prompt_logprobs[j + 1][ids[j + 1]].logprob for j in range(len(ids) - 1)]
    np.testing.assert_allclose(got, [want[j, ids[j + 1]] for j in range(len(ids) - 1)], atol=atol, err_msg=str(name))


@pytest.mark.parametrize("model", ["llama3", "qwen2"])
def test_each_adapter_alone_matches_peft(model):
    ref = np.load(DATA / "lora" / model / "reference.npz")
    prompt = [int(t) for t in input_ids(model)[0, :10]]
    engine = engine_for(model)
    for name in (None, *ADAPTERS):
        got = run(engine, [("r", prompt, name)], model)["r"]
        assert got == [int(t) for t in ref[f"greedy_{name or 'base'}"][0]], name


@pytest.mark.parametrize("model", ["llama3", "qwen2"])
def test_prompt_logprobs_match_peft_logits(model):
    """Each position's logprob of the next prompt token under each adapter, against PEFT's logits."""
    ref = np.load(DATA / "lora" / model / "reference.npz")
    engine = engine_for(model)
    ids = [int(t) for t in input_ids(model)[0]]
    for name in (None, *ADAPTERS):
        check_prompt_logprobs(engine, model, ref, ids, name, atol=2e-4)


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_bfloat16_slots_match_peft(backend):
    """`lora_dtype="bfloat16"` (half the bytes a step reads for its adapters) over float32 weights:
    the stacks are bfloat16, each adapter's greedy tokens are PEFT's and its prompt logprobs within
    bfloat16's rounding of the adapter weights (2^-9 relative) of PEFT's float32 logits."""
    import jax
    import jax.numpy as jnp

    model = "llama3"
    ref = np.load(DATA / "lora" / model / "reference.npz")
    engine = engine_for(model, backend=backend, lora_dtype="bfloat16")
    layers = engine.runner.params["layers"]
    stacks = {k: v for k, v in jax.tree_util.tree_leaves_with_path(layers) if "lora_" in jax.tree_util.keystr(k)}
    assert stacks and all(v.dtype == jnp.bfloat16 for v in stacks.values())
    assert engine.runner.params["final_norm"].dtype == jnp.float32
    ids = [int(t) for t in input_ids(model)[0]]
    for name in (None, *ADAPTERS):
        got = run(engine, [("r", ids[:10], name)], model)["r"]
        assert got == [int(t) for t in ref[f"greedy_{name or 'base'}"][0]], name
        check_prompt_logprobs(engine, model, ref, ids, name, atol=5e-3)


def _mixed_requests():
    """Eight requests over both prompts of the reference, the base model and every adapter."""
    prompts = [[int(t) for t in input_ids("llama3")[i, :n]] for i, n in ((0, 10), (1, 13))]
    names = (None, *ADAPTERS)
    return [(f"r{i}", prompts[i % 2], names[i % 4]) for i in range(8)]


@pytest.fixture(scope="module")
def alone():
    """Each of _mixed_requests' outputs as a plain llama3 engine gives it alone, by request id."""
    engine = engine_for("llama3")
    return {rid: run(engine, [(rid, p, n)])[rid] for rid, p, n in _mixed_requests()}


@pytest.mark.parametrize("settings", [
    {},  # all at once, one mixed prefill
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill, four seats
    {"num_pages": 14, "enable_prefix_caching": False},  # a small pool: preemptions
    {"max_loras": 2},  # fewer slots than adapters: requests wait for one, slots are reloaded
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                            "disable_by_batch_size": 8}},
], ids=["mixed", "chunked", "preempted", "two-slots", "async", "ngram"])
def test_a_mixed_batch_gives_each_request_its_adapter(settings, alone):
    requests = _mixed_requests()
    engine = engine_for("llama3", warmup=True, **settings)
    assert run(engine, requests) == alone
    if "num_pages" in settings:
        assert engine.scheduler.num_preemptions > 0
    if settings.get("max_loras") == 2:
        assert engine.lora.slots.num_loads > 3
    assert engine.runner.num_compilations_after_warmup == 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_weights_keep_their_kernels_beside_the_adapters(quantization):
    """Over int8 / int4 base weights (the native backend's quantized panels): every adapter changes
    the output, and a mixed batch gives each request what it gets alone."""
    requests = _mixed_requests()
    alone = engine_for("llama3", quantization=quantization, quality_gate="off")
    assert alone.runner.backend.describe()["native_matmuls"]
    want = {rid: run(alone, [(rid, p, n)])[rid] for rid, p, n in requests}
    assert len({tuple(want[f"r{i}"]) for i in range(4)}) == 4  # the base model and three adapters differ
    engine = engine_for("llama3", quantization=quantization, quality_gate="off")
    assert run(engine, requests) == want


def test_a_dp2_tp2_mesh_gives_the_single_device_tokens(alone):
    """Eight requests of the base model and three adapters over two data-parallel groups of two
    tensor-parallel devices (fake CPU devices), as one device gives them alone."""
    requests = _mixed_requests()
    engine = engine_for("llama3", mesh="dp=2,tp=2", backend="xla", warmup=True)
    assert run(engine, requests) == alone
    assert engine.runner.num_compilations_after_warmup == 0


def test_the_prefix_cache_is_per_adapter():
    prompt = [int(t) for t in input_ids("llama3")[0, :20]]
    engine = engine_for("llama3")
    run(engine, [("first", prompt, "a")])
    assert engine.page_table.lookup_prefix(prompt, cache_salt=None) == 0  # not the base model's pages
    hits = engine.stats()["prefix_cache_hit_tokens"]
    run(engine, [("again", prompt, "a")])
    assert engine.stats()["prefix_cache_hit_tokens"] >= hits + 16  # adapter a's own pages: four of 4 tokens
    hits = engine.stats()["prefix_cache_hit_tokens"]
    run(engine, [("other", prompt, "b")])
    greedy = run(engine, [("base", prompt, None)])["base"]
    assert engine.stats()["prefix_cache_hit_tokens"] == hits  # neither b nor the base model reused a's
    fresh = engine_for("llama3")
    assert run(fresh, [("base", prompt, None)])["base"] == greedy


def test_bad_adapters_and_requests_are_refused():
    engine = engine_for("llama3", max_lora_rank=8)
    with pytest.raises(ValueError, match="rank"):  # adapter c has rank 16
        engine.add_request("x", [1, 2, 3], GREEDY8, lora_request=lora_request("llama3", "c"))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="nowhere"):
        engine.lora.add(LoRARequest("q", 9, str(DATA / "lora" / "nowhere")))
    assert engine.lora.known() == []
    engine.lora.add(lora_request("llama3", "a"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.lora.add(LoRARequest("a", 1, str(DATA / "lora" / "llama3" / "b")))
    engine.add_request("y", [1, 2, 3], GREEDY8, lora_request=lora_request("llama3", "a"))
    with pytest.raises(ValueError, match="in flight"):
        engine.lora.remove("a")
    finish(engine)
    engine.lora.remove("a")
    with pytest.raises(ValueError, match="not loaded"):
        engine.lora.remove("a")
    plain = engine_for("llama3", enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_request("z", [1, 2, 3], GREEDY8, lora_request=lora_request("llama3", "a"))
