"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers, through every backend's paged engine.

The tiny random models in tests/data/arch/gemma2 and gemma3 (tests/tools/make_arch_goldens.py) have
sliding-window layers (window 8) interleaved with full ones, soft-capping (Gemma 2), Gemma 3's
local rotary base and q/k norms, and a query scale that is not head_dim ** -0.5; each changes
their logits (the generator checks it), so a backend that drops any of them fails here. The
contiguous-cache forward and cached decode are in tests/test_model_arch.py, with the other
architectures.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig, build_engine
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
from jserve.model.checkpoint import read_params
from jserve.model.config import FULL, SLIDING, ModelConfig
from jserve.runtime import backends

GEMMAS = ["gemma2", "gemma3"]

# name: (backend name, options), as tests/test_backends.py
BACKENDS = {
    "native": ("cpu", {}),
    "native xla dots": ("cpu", {"native_matmuls": False}),
    "xla scanned reference": ("reference", {}),
    "xla unrolled reference": ("reference", {"scan": False}),
    "xla scanned pallas": ("cpu_pallas", {}),
}


def _engine(config, params, backend, **kw):
    """`backend`: a name, or (name, options) for a backend built here (without a mesh)."""
    built = backend if isinstance(backend, str) else backends.create(backend[0], **backend[1])
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=64,
                    backend=built, warmup=False)
    return build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**settings, **kw}))


def test_gemma_configs_parse():
    cfgs = {a: ModelConfig.from_hf_config(json.loads((DATA / "arch" / a / "config.json").read_text()))
            for a in GEMMAS}
    g2, g3 = cfgs["gemma2"], cfgs["gemma3"]
    assert g2.layer_types == (SLIDING, FULL, SLIDING) and g2.sliding_window == 8
    assert g2.attn_logit_softcap == 2.0 and g2.final_logit_softcap == 3.0
    assert g2.attention_scale == 32 ** -0.5 and g2.hidden_act == "gelu_tanh" and g2.post_norms
    assert g2.norm_offset == 1.0 and g2.embed_scale and not g2.tie_word_embeddings
    assert g2.layer_period() == 2 and g2.mixed_layers and not g2.llama_layer
    assert g3.layer_types == (SLIDING, SLIDING, FULL, SLIDING) and g3.layer_period() == 3
    assert g3.qk_norm and g3.head_dim == 32 and g3.attention_scale == 24 ** -0.5
    assert g3.rope_theta == 1e6 and g3.rope_scaling.rope_type == "linear" and g3.rope_scaling.factor == 8
    assert g3.rope_local_theta == 1e4 and g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    assert g3.tie_word_embeddings
    for c in cfgs.values():
        assert ModelConfig.from_json(c.to_json()) == c


def test_gemma_configs_of_older_transformers_and_multimodal_checkpoints():
    """transformers 4.x configs (no layer_types; rope_theta / rope_local_base_freq /
    sliding_window_pattern at the top), and a Gemma 3 multimodal config (text_config, HF defaults
    for the keys it leaves out), as Gemma 3 4B's."""
    g2 = ModelConfig.from_hf_config({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                     "num_hidden_layers": 4, "rope_theta": 10000.0})
    assert g2.layer_types == (SLIDING, FULL) * 2 and g2.sliding_window == 4096
    assert g2.attn_logit_softcap == 50.0 and g2.final_logit_softcap == 30.0
    g3 = ModelConfig.from_hf_config({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                     "num_hidden_layers": 26, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                     "sliding_window": 512, "sliding_window_pattern": 6, "head_dim": 256,
                                     "query_pre_attn_scalar": 256, "rope_scaling": None})
    assert g3.layer_types == ((SLIDING,) * 5 + (FULL,)) * 4 + (SLIDING,) * 2 and g3.layer_period() == 6
    assert g3.rope_local_theta == 1e4 and g3.rope_scaling is None and g3.sliding_window == 512
    mm = ModelConfig.from_hf_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}})
    assert (mm.architecture, mm.num_layers, mm.num_heads, mm.num_kv_heads, mm.head_dim) == ("gemma3", 34, 8, 4, 256)
    assert mm.rope_scaling.factor == 8.0 and mm.rope_local_theta == 1e4 and mm.vocab_size == 262208
    assert mm.layer_types.count(FULL) == 5


@pytest.mark.parametrize("change,match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers"),
    ({"architectures": ["Gemma3nForCausalLM"], "model_type": "gemma3n_text"}, "Gemma3nForCausalLM"),
])
def test_unsupported_gemma_variants_are_named(change, match):
    cfg = json.loads((DATA / "arch" / "gemma3" / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**cfg, **change})


def test_gemma_gguf_metadata_follows_llama_cpp():
    """What llama.cpp's converter writes for Gemma 2 / 3 and what llama.cpp derives: the layer
    pattern (2 / 6), Gemma 3's local rotary base 10000, the query scale (head_dim; hidden / heads
    for the 27B models)."""
    def meta(arch, layers, **extra):
        return {"general.architecture": arch, f"{arch}.embedding_length": 4608, f"{arch}.block_count": layers,
                f"{arch}.feed_forward_length": 36864, f"{arch}.attention.head_count": 32,
                f"{arch}.attention.head_count_kv": 16, f"{arch}.attention.key_length": 128,
                f"{arch}.attention.sliding_window": 4096, f"{arch}.vocab_size": 256000,
                **{f"{arch}.{k}": v for k, v in extra.items()}}

    g2 = ModelConfig.from_gguf_metadata(meta("gemma2", 46, attn_logit_softcapping=50.0,
                                             final_logit_softcapping=30.0), has_output_tensor=False)
    assert g2.layer_types[:4] == (SLIDING, FULL, SLIDING, FULL) and g2.tie_word_embeddings
    assert g2.query_pre_attn_scalar == 4608 // 32 and g2.attn_logit_softcap == 50.0 and g2.norm_offset == 1
    g3 = ModelConfig.from_gguf_metadata(meta("gemma3", 26, **{"rope.freq_base": 1e6}), has_output_tensor=False)
    assert g3.layer_types == ((SLIDING,) * 5 + (FULL,)) * 4 + (SLIDING,) * 2
    assert g3.query_pre_attn_scalar == 128 and g3.rope_local_theta == 1e4 and g3.qk_norm
    assert g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    given = ModelConfig.from_gguf_metadata(
        meta("gemma3", 3, **{"attention.sliding_window_pattern": [True, False, True]}), has_output_tensor=False)
    assert given.layer_types == (SLIDING, FULL, SLIDING)


def _write_gguf(arch, config, folder, path):
    """The tiny HF model as llama.cpp's converter writes it: its tensor names (gguf's own
    TensorNameMap), 1 added to every norm weight, no rotary permutation, its metadata keys."""
    import gguf
    from safetensors.numpy import load_file

    tensors = load_file(folder / "model.safetensors")
    arch_enum = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch]
    names = gguf.get_tensor_name_map(arch_enum, config.num_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_sliding_window(config.sliding_window)
    # Not the converter's default pattern for these tiny models: written out, as llama.cpp reads it.
    w.add_array(f"{arch}.attention.sliding_window_pattern", [t == SLIDING for t in config.layer_types])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcap)
        w.add_final_logit_softcapping(config.final_logit_softcap)
    else:
        w.add_rope_freq_base(config.rope_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_scaling.factor)
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    for hf_name, a in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if hf_name == "lm_head.weight":  # gguf's Gemma 2 tensors have no output (its models are tied)
            name = "output.weight"
        assert name is not None, hf_name
        if hf_name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        w.add_tensor(name, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", GEMMAS)
def test_gguf_of_the_same_weights_reads_as_the_hf_folder(arch, tmp_path):
    """A GGUF with llama.cpp's Gemma names and norm convention (1 + w stored) reads to the HF
    folder's weights, and (with the one setting GGUF does not carry, query_pre_attn_scalar, at
    head_dim as llama.cpp assumes) to its config."""
    folder = DATA / "arch" / arch
    hf_config, hf_params = read_params(folder)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(arch, hf_config, folder, path)
    config, params = read_params(path)
    want = dataclasses.replace(hf_config, query_pre_attn_scalar=float(hf_config.head_dim), bos_token_id=None,
                               eos_token_ids=(), rms_norm_eps=float(np.float32(hf_config.rms_norm_eps)))
    assert config == want
    assert set(params) == set(hf_params)
    for name, a in params.items():
        np.testing.assert_allclose(a, hf_params[name], atol=1e-6, rtol=0, err_msg=name)
    assert any(name.endswith("post_norm") for name in params)


@pytest.mark.parametrize("arch", GEMMAS)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_paged_engine_logprobs_match_transformers(arch, name):
    """The 24-token reference input through the paged engine (chunks of 8 over pages of 4, so the
    window of 8 spans three pages): every position's log-probabilities are transformers'."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    engine = _engine(config, params, BACKENDS[name])
    if name == "native":
        assert not engine.runner.ops.fused  # the fused native layers are Llama's: Gemma runs its own
    ids = [int(t) for t in ref["input_ids"][0]]
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(ref["logits"][0]), axis=-1))
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
    got = finish(engine)["a"].prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    worst = 0.0
    for q, entry in enumerate(got[1:]):  # position q predicts token q + 1
        top = sorted((e for e in entry.values() if e.rank <= 5), key=lambda e: e.rank)
        diff = np.abs(np.array([entry[ids[q + 1]].logprob] + [e.logprob for e in top])
                      - np.array([want[q][ids[q + 1]]] + list(np.sort(want[q])[::-1][:5])))
        worst = max(worst, float(diff.max()))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("arch", GEMMAS)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_paged_greedy_decode_with_chunked_prefill_and_preemption(arch, backend):
    """transformers' greedy tokens from the engine: prompts prefilled in chunks of 4, six
    sequences, up to four at a time, over 11 pages of 4 tokens (each needs 5), so some are
    preempted and recomputed."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    engine = _engine(config, params, (backend, {}), max_num_batched_tokens=4, num_pages=12, max_num_seqs=4,
                     enable_prefix_caching=False)
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    for i in range(6):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = finish(engine)
    for i in range(6):
        assert list(outs[str(i)].outputs[0].token_ids) == ref["greedy_ids"][0].tolist(), i
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["pages_in_use"] == 0


def test_scanned_gemma_stack_grows_with_the_period_not_the_depth():
    """The XLA backend's stack over interleaved layers: one while loop over groups of
    `layer_period()` layers, so 13 layers (4 groups of sliding, sliding, full, then a sliding one)
    compile to the HLO of 7 (2 groups + 1), with the folded pages written in place as for one
    kind of layer (tests/test_backends.py), and the scan gives the unrolled stack's logits."""
    import re

    from jserve.runtime.runner import Runner

    config, params = load_arch("gemma3")

    def deepen(layers):  # layers 0, 1, 2 repeated, then layer 3
        order = jnp.asarray([i % 3 for i in range(layers - 1)] + [3])
        p = {k: (v[order] if k not in ("embed", "lm_head", "final_norm") else v) for k, v in params.items()}
        cfg = dataclasses.replace(config, num_layers=layers, layer_types=tuple(config.layer_types[i] for i in order))
        assert cfg.layer_period() == 3
        return cfg, p

    sizes = {}
    for layers in (7, 13):
        cfg, p = deepen(layers)
        runner = Runner(cfg, p, num_pages=16, page_size=4, max_model_len=32, backend="reference",
                        batch_buckets=(2,), token_buckets=(8,), max_num_batched_tokens=8)
        tokens, positions, meta, last = runner.pack([None] * 2, 2, 1)
        hlo = runner.step_fn(2, 1).lower(runner.params, runner.kv, tokens, positions, meta, last).compile().as_text()
        sizes[layers] = (len(hlo.splitlines()), len(re.findall(r" while\(", hlo)))
        K, P, S, D = runner.kv[0].shape  # the folded pages: carried through, never copied, K and V aliased
        cache = rf"f32\[{K},{P},{S},{D}\]|f32\[{K},{P * S},{D}\]"
        assert not [line for line in hlo.splitlines() if re.search(rf"(?:{cache})\S* copy\(", line)]
        assert len(re.findall(r"\{\d+\}: \(\d+, \{\}, (?:may|must)-alias\)", hlo.splitlines()[0])) == 2
    (small, loops), (big, deep_loops) = sizes.values()
    assert loops == deep_loops >= 1 and big < 1.05 * small, sizes
    deep, deep_params = deepen(13)
    ids = np.random.default_rng(0).integers(0, deep.vocab_size, (1, 20)).astype(np.int32)
    pos = np.arange(20, dtype=np.int32)[None]
    out = {}
    for layout in ("list", "stacked"):
        stacked = layout == "stacked"
        model = nnx.merge(model_graphdef(deep, layout), model_params(deep, deep_params, layout))
        cache = init_cache(deep.num_layers, 1, deep.num_kv_heads, 20, deep.head_dim, stacked=stacked)
        out[layout] = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), cache, jnp.asarray(pos),
                                       XlaOps(DenseAttention(deep.sliding_window, stacked=stacked), scan=stacked))[0])
    np.testing.assert_allclose(out["stacked"], out["list"], atol=1e-5, rtol=0)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_greedy_on_a_mesh(arch):
    """Tensor and data parallel (the extra norms replicated, heads split) give transformers' tokens."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    engine = _engine(config, params, "reference", mesh="dp=2,tp=2")  # by name: build_engine gives it the mesh
    engine.add_request("a", [int(t) for t in ref["input_ids"][0, :10]],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(finish(engine)["a"].outputs[0].token_ids) == ref["greedy_ids"][0].tolist()
