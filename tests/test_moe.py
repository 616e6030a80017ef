"""Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers, and over expert-parallel meshes.

The tiny random models in tests/data/arch/{qwen3_moe,mixtral,qwen2_moe} (tests/tools/make_arch_goldens.py)
have 8 experts, top-2, and routing the generator checks is not trivial (most experts used, many
distinct top-2 sets, no near-ties; top-1 changes the logits). Meshes run on the conftest's 8
fake CPU devices.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig, build_engine
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params, moe
from jserve.model.checkpoint import read_params
from jserve.model.config import ModelConfig
from jserve.runtime import backends

MOES = ["qwen3_moe", "mixtral", "qwen2_moe"]


def _forward(config, params, ids, layout="list", grouped="ragged_dot"):
    B, T = ids.shape
    stacked = layout == "stacked"
    model = nnx.merge(model_graphdef(config, layout), model_params(config, params, layout))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_cache(config.num_layers, B, config.num_kv_heads, T, config.head_dim, stacked=stacked)
    ops = XlaOps(DenseAttention(config.sliding_window, stacked=stacked), scan=stacked, grouped_matmul=grouped)
    return np.asarray(model(jnp.asarray(ids), positions, cache, positions, ops)[0])


# ------------------------------------------------------------------------------ configs


def test_moe_configs_parse():
    cfgs = {a: ModelConfig.from_hf_config(json.loads((DATA / "arch" / a / "config.json").read_text())) for a in MOES}
    q3, mx, q2 = cfgs["qwen3_moe"], cfgs["mixtral"], cfgs["qwen2_moe"]
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size, q3.norm_topk_prob) == (8, 2, 32, True)
    assert q3.qk_norm and q3.head_dim == 32 and not q3.shared_expert_intermediate_size
    assert (mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob, mx.qk_norm) == (8, 32, True, False)
    assert q2.qkv_bias and not q2.norm_topk_prob and q2.shared_expert_intermediate_size == 64 and q2.shared_expert_gate
    for c in cfgs.values():
        assert c.moe and not c.llama_layer and ModelConfig.from_json(c.to_json()) == c
    # Parameter counts are transformers' (README table), and a token reads the top-2 of 8 experts.
    assert (q3.num_params(), mx.num_params(), q2.num_params()) == (181_696, 156_992, 181_952)
    assert q3.active_params() == q3.num_params() - 2 * 6 * 3 * 64 * 32


@pytest.mark.parametrize("change,match", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_moe_variants_are_named(change, match):
    cfg = json.loads((DATA / "arch" / "qwen3_moe" / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**cfg, **change})


def test_real_checkpoint_config_keys():
    """Qwen3-30B-A3B's and Mixtral-8x7B's config.json keys (num_experts as the Hub writes it)."""
    q = ModelConfig.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1e6,
        "sliding_window": None, "use_sliding_window": False})
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 8, 768)
    assert 3.0e9 < q.active_params() < 3.6e9 and 30e9 < q.num_params() < 31e9  # "30B-A3B"
    m = ModelConfig.from_hf_config({
        "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None})
    assert m.moe_intermediate_size == 14336 and 46e9 < m.num_params() < 47e9 and 12e9 < m.active_params() < 13e9


# ------------------------------------------------------------------------------ routing


def test_routing_normalisation_and_grouped_matmuls():
    """route() is softmax + top-k (+ renormalisation); both grouped matmuls and a split of the
    experts into two halves (what two ep devices compute) give a per-token loop's outputs."""
    rng = np.random.default_rng(0)
    for N, E in [(1, 8), (5, 8), (300, 8), (7, 64)]:
        x = jnp.asarray(rng.normal(size=(N, 16)), jnp.float32)
        w_router = jnp.asarray(rng.normal(size=(16, E)), jnp.float32)
        wg, wu = (jnp.asarray(rng.normal(size=(E, 16, 8)) * 0.3, jnp.float32) for _ in range(2))
        wd = jnp.asarray(rng.normal(size=(E, 8, 16)) * 0.3, jnp.float32)
        raw, _ = moe.route(x, w_router, 2, False)
        w, e = moe.route(x, w_router, 2, True)
        probs = np.asarray(jax.nn.softmax(x @ w_router, axis=-1))
        np.testing.assert_allclose(raw, np.sort(probs, -1)[:, ::-1][:, :2], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
        ref = np.zeros((N, 16), np.float32)
        for t in range(N):
            for j in range(2):
                g, xt = int(e[t, j]), np.asarray(x[t])
                ref[t] += float(w[t, j]) * (np.asarray(jax.nn.silu(xt @ wg[g])) * (xt @ np.asarray(wu[g]))) @ wd[g]
        for impl in moe.GROUPED_MATMULS:
            got = moe.routed_experts(x, w, e, wg, wu, wd, impl=impl)
            np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5, err_msg=impl)
            half = E // 2
            split = sum(moe.routed_experts(x, w, e, wg[i:i + half], wu[i:i + half], wd[i:i + half], first=i,
                                           impl=impl) for i in (0, half))
            np.testing.assert_allclose(split, ref, atol=2e-5, rtol=1e-5, err_msg=impl)


def test_gather_decode_reads_only_the_selected_experts():
    """A decode-sized step's gather matmul gathers one expert's weights per (token, choice): the
    compiled HLO's largest gather is [rows * k, hidden, ffn], never the whole [experts, ...]."""
    E, D, F, N = 64, 32, 16, 4
    w = jnp.zeros((E, D, F))
    fn = jax.jit(lambda x, g, s: moe.gather_matmul(x, w, g, s))
    hlo = fn.lower(jnp.zeros((N * 2, D)), jnp.zeros(N * 2, jnp.int32), jnp.zeros(E, jnp.int32)).compile().as_text()
    assert re.search(rf"f32\[{N * 2},{D},{F}\]", hlo), hlo[:2000]
    assert moe._gather_tiles(8, 64) == (1, 8) and moe._gather_tiles(1024, 8)[0] == 128


# ------------------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("grouped", moe.GROUPED_MATMULS)
@pytest.mark.parametrize("layout", ["list", "stacked"])
@pytest.mark.parametrize("arch", MOES)
def test_logits_match_transformers(arch, layout, grouped):
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    config, params = load_arch(arch)
    logits = _forward(config, params, ref["input_ids"], layout, grouped)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", MOES)
def test_cached_greedy_decode_matches_transformers(arch):
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    config, params = load_arch(arch)
    model = nnx.merge(model_graphdef(config), model_params(config, params))
    ops = XlaOps(DenseAttention(config.sliding_window), grouped_matmul="gather")
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


def _engine(config, params, backend, **kw):
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=4, page_size=4, num_pages=12,
                    backend=backends.create(backend), warmup=False, enable_prefix_caching=False)
    return build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**settings, **kw}))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("arch", MOES)
def test_paged_greedy_decode_with_chunked_prefill_and_preemption(arch, backend):
    """transformers' greedy tokens from the engine (native CPU backend: the model's own MoE layers
    on the native attention; XLA backend: the scanned stack): prompts prefilled in chunks of 4, six
    sequences, up to four at a time, over 11 pages of 4 tokens (each needs 5), so some are
    preempted and recomputed."""
    config, params = load_arch(arch)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    engine = _engine(config, params, backend)
    if backend == "cpu":
        assert not engine.runner.ops.fused  # the fused native layers are Llama's
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    for i in range(6):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = finish(engine)
    for i in range(6):
        assert list(outs[str(i)].outputs[0].token_ids) == ref["greedy_ids"][0].tolist(), i
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["pages_in_use"] == 0


# ------------------------------------------------------------------------------ GGUF


def _write_gguf(arch, config, folder, path):
    """The tiny HF model as llama.cpp's converter writes it: blk.N.ffn_gate_inp (the router),
    ffn_{gate,up,down}_exps stacked [experts, out, in], ffn_*_shexp and ffn_gate_inp_shexp for the
    shared expert, Mixtral as a "llama" GGUF with its Q/K rotary permutation."""
    import gguf
    from safetensors.numpy import load_file

    from jserve.model.sources import unpermute_rotary

    tensors = load_file(folder / "model.safetensors")
    gguf_arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[arch]
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if arch != "mixtral":
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    out = {}
    experts = {}
    for hf, a in tensors.items():
        if hf in glob:
            out[glob[hf]] = a
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", hf)
        if m:
            kind = {"w1": "gate", "w3": "up", "w2": "down"}.get(m.group(3), m.group(3).split("_")[0])
            experts.setdefault((int(m.group(1)), kind), {})[int(m.group(2))] = a
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
        module = m.group(2).replace("block_sparse_moe.", "mlp.")
        if arch == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's permute
            heads = config.num_heads if "q_proj" in module else config.num_kv_heads
            perm = unpermute_rotary(np.arange(a.shape[0]), heads)
            a = a[np.argsort(perm)]
        out[f"blk.{m.group(1)}.{names[module]}.{m.group(3)}"] = a
    for (layer, kind), per in experts.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([per[e] for e in range(config.num_experts)])
    for name, a in out.items():
        w.add_tensor(name, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", MOES)
def test_gguf_of_the_same_weights_reads_as_the_hf_folder(arch, tmp_path):
    folder = DATA / "arch" / arch
    hf_config, hf_params = read_params(folder)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(arch, hf_config, folder, path)
    config, params = read_params(path)
    want = dataclasses.replace(hf_config, bos_token_id=None, eos_token_ids=(),
                               rms_norm_eps=float(np.float32(hf_config.rms_norm_eps)))
    if arch == "mixtral":
        want = dataclasses.replace(want, intermediate_size=hf_config.intermediate_size)
    assert config == want
    assert set(params) == set(hf_params)
    for name, a in params.items():
        np.testing.assert_allclose(a, hf_params[name], atol=1e-6, rtol=0, err_msg=name)


def test_gguf_moe_metadata_follows_llama_cpp():
    def meta(arch, **extra):
        return {"general.architecture": arch, f"{arch}.embedding_length": 2048, f"{arch}.block_count": 48,
                f"{arch}.feed_forward_length": 6144, f"{arch}.attention.head_count": 32,
                f"{arch}.attention.head_count_kv": 4, f"{arch}.vocab_size": 151936,
                **{f"{arch}.{k}": v for k, v in extra.items()}}

    q3 = ModelConfig.from_gguf_metadata(meta("qwen3moe", expert_count=128, expert_used_count=8,
                                             expert_feed_forward_length=768), has_output_tensor=True)
    assert (q3.architecture, q3.num_experts, q3.moe_intermediate_size) == ("qwen3_moe", 128, 768) and q3.norm_topk_prob
    q2 = ModelConfig.from_gguf_metadata(meta("qwen2moe", expert_count=60, expert_used_count=4,
                                             expert_feed_forward_length=1408,
                                             expert_shared_feed_forward_length=5632), has_output_tensor=True)
    assert not q2.norm_topk_prob and q2.shared_expert_intermediate_size == 5632 and q2.shared_expert_gate
    mx = ModelConfig.from_gguf_metadata(meta("llama", expert_count=8, expert_used_count=2), has_output_tensor=True)
    assert mx.architecture == "mixtral" and mx.moe_intermediate_size == 6144 and mx.norm_topk_prob
    assert ModelConfig.from_gguf_metadata(meta("llama"), has_output_tensor=True).architecture == "llama"
    with pytest.raises(ValueError, match="expert_count"):
        ModelConfig.from_gguf_metadata(meta("qwen3moe"), has_output_tensor=True)


# ------------------------------------------------------------------------------ expert parallelism


needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def test_parse_mesh_with_ep_and_dense_models_refuse_it():
    from jserve.runtime.sharding import check_experts, make_mesh, parse_mesh

    assert parse_mesh("ep=2,tp=2") == {"dp": 1, "tp": 2, "ep": 2}
    assert parse_mesh("dp=2,tp=4") == {"dp": 2, "tp": 4}
    if jax.device_count() >= 4:
        mesh = make_mesh("dp=2,ep=2")
        assert mesh.axis_names == ("dp", "ep", "tp") and mesh.devices.shape == (2, 2, 1)
    dense = ModelConfig.from_hf_config(json.loads((DATA / "arch" / "qwen3" / "config.json").read_text()))
    with pytest.raises(ValueError, match="ep=2 splits a mixture of experts.*dense"):
        check_experts(dense, {"dp": 1, "tp": 1, "ep": 2})
    with pytest.raises(ValueError, match="ep=3 does not divide the model's 8 experts"):
        check_experts(load_arch("mixtral")[0], {"ep": 3})


@pytest.fixture(scope="module")
def moe_reference():
    config, params = load_arch("qwen2_moe")  # experts, a shared expert, q/k/v biases
    prompts = [np.random.RandomState(i).randint(0, 256, n).tolist() for i, n in enumerate([5, 17, 30, 3])]
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=4, num_pages=80,
              enable_prefix_caching=False, warmup=False)
    return config, params, prompts, kw, _generate(config, params, None, prompts, kw)[0]


def _generate(config, params, mesh, prompts, kw):
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(mesh=mesh, **kw))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    outs = finish(engine)
    return [outs[str(i)].outputs[0] for i in range(len(prompts))], engine


@needs8
@pytest.mark.parametrize("mesh", ["ep=2", "ep=4", "ep=2,tp=2", "dp=2,ep=2"])
def test_expert_parallel_meshes_give_one_devices_tokens_and_logprobs(moe_reference, mesh):
    config, params, prompts, kw, ref = moe_reference
    got, engine = _generate(config, params, mesh, prompts, kw)
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        for lg, lr in zip(g.logprobs, r.logprobs):
            assert lg.keys() == lr.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lr], [lr[t].logprob for t in lr], atol=1e-4)
    assert len({tuple(o.token_ids) for o in ref}) > 1
    ep = int(re.search(r"ep=(\d)", mesh).group(1))
    we = engine.runner.params["layers"][0]["we_gate"] if 0 in engine.runner.params["layers"] else \
        engine.runner.params["layers"]["we_gate"][0]
    assert we.addressable_shards[0].data.shape[0] == config.num_experts // ep  # each device: its experts


@needs8
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_step_hlo_never_gathers_the_experts(backend):
    """The compiled decode step on ep=2,tp=2: the expert weights stay split (no all-gather makes
    an array of their full expert count with their hidden and width dims), and the MoE's psum is
    there (an all-reduce per layer beside tp's)."""
    config, params = load_arch("mixtral")
    engine = build_engine(config, params, IdTokenizer(), [],
                          EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, page_size=4,
                                       num_pages=40, warmup=False, mesh="ep=2,tp=2",
                                       backend=backends.create(backend)))
    runner = engine.runner
    from jserve.runtime.steps import StepRow

    arrays = runner.place(runner.pack([StepRow(0, [1], [1, 2])] * 4, 4, 1))
    hlo = runner.step_fn(4, 1).lower(runner.params, runner.kv, *arrays).compile().as_text()
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gathers = re.findall(r"(\w+)\[([\d,]+)\][^=\n]*= [^\n]*all-gather", hlo)
    for _, dims in gathers:
        shape = [int(d) for d in dims.split(",")]
        assert not (E in shape and D in shape and F in shape), f"experts gathered: {dims}"
    assert len(re.findall(r"= [^=]*all-reduce(?:-start)?\(", hlo)) >= 3 * config.num_layers


def test_plan_reports_expert_bytes_per_device():
    from jserve.runtime.sharding import param_bytes_per_device

    config = load_arch("mixtral")[0]
    whole = param_bytes_per_device(config, 1, itemsize=4)
    split = param_bytes_per_device(config, 2, 2, itemsize=4)
    for name in moe.EXPERT_WEIGHTS:
        assert split[name] * 4 == whole[name]
    assert whole["we_gate"] == config.num_layers * 8 * 64 * 32 * 4


def test_plan_cli_prints_expert_bytes(capsys):
    from jserve import cli

    folder = str(DATA / "arch" / "qwen3_moe")
    assert cli.main(["plan", "--model", folder, "--device-memory", "1GiB"]) == 0
    # 2 layers x 3 matrices x 8 experts x 64 x 32 x 4 bytes
    assert re.search(r"experts \(8 x 32, top-2\)\s+384 KiB", capsys.readouterr().out)
    assert cli.main(["plan", "--model", folder, "--device-memory", "1GiB", "--mesh", "ep=2,tp=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"experts \(8 x 32, top-2\) per device\s+96 KiB", out) and "4 of 8 experts per device" in out
    assert cli.main(["plan", "--model", str(DATA / "arch" / "qwen3"), "--device-memory", "1GiB", "--mesh", "ep=2"]) == 2
    assert "is dense" in capsys.readouterr().err
    env = {}
    cli.cpu_devices_for_mesh("dp=2,ep=2,tp=2", env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
