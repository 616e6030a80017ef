"""Meshes (dp, tp) on eight fake CPU devices (conftest sets the device count).

Every mesh must give the tokens of one device, and logprobs within float tolerance: on a tiny
model with SmolLM2's head shape (9 query heads, 3 KV heads, so tp=2/4/8 pad and replicate), and
on the real SmolLM2 against its golden cases. The compiled step's HLO must hold the expected
all-reduces and never gather a whole weight.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig, build_engine
from jserve.model import LlamaModel
from jserve.model.config import ModelConfig
from jserve.runtime.sharding import head_layout, laid_out_config, lay_out_params, make_mesh, parse_mesh, place_params

MESHES = ["tp=2", "tp=3", "tp=4", "tp=8", "dp=2,tp=2", "dp=8"]

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=100, num_layers=2,
                   num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=512, qkv_bias=True)


def _stacked(config: ModelConfig, seed: int = 0) -> dict:
    model = LlamaModel(config, rngs=nnx.Rngs(seed))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {k: v for k, v in pure.items() if k != "layers"}
    for name in pure["layers"][0]:
        # Non-zero biases, so padding mistakes in them would show.
        out[name] = jnp.stack([pure["layers"][i][name] for i in range(config.num_layers)])
        if name.startswith("b"):
            out[name] = out[name] + 0.05 * jax.random.normal(jax.random.key(len(name)), out[name].shape)
    return out


class _Tok:
    def detokenizer(self, ids, skip_special_tokens=True):
        class D:
            def add(self, t):
                return ""

            def flush(self):
                return ""

        return D()

    def decode(self, ids):
        return ""


# ------------------------------------------------------------------------------ mesh specs


def test_parse_mesh():
    assert parse_mesh("dp=2,tp=4") == {"dp": 2, "tp": 4}
    assert parse_mesh("tp=3") == {"dp": 1, "tp": 3}
    assert parse_mesh(" tp = 2 , dp = 1 ") == {"dp": 1, "tp": 2}
    for bad, word in [("pp=2", "'pp'"), ("tp=0", "tp"), ("tp=2,tp=2", "twice"), ("tp", "'tp'"), ("", "empty"),
                      ("tp=-1", "tp")]:
        with pytest.raises(ValueError, match=word):
            parse_mesh(bad)


def test_make_mesh_checks_device_count():
    mesh = make_mesh("dp=2,tp=4")
    assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (2, 4)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("dp=2,tp=8")
    # A user's own Mesh with the axes the other way round.
    theirs = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("tp", "dp"))
    assert make_mesh(theirs).devices.shape == (2, 2)
    with pytest.raises(ValueError, match="'x'"):
        make_mesh(jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",)))


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 9, 12])
def test_head_layout_keeps_each_query_with_its_kv_head(tp):
    lay = head_layout(TINY, tp)  # 9 query heads, 3 KV heads
    assert lay.physical_heads % tp == 0 and lay.physical_kv_heads % tp == 0
    q_src, kv_src = lay.q_source(), lay.kv_source()
    assert sorted(q_src[q_src >= 0].tolist()) == list(range(9))  # every real head exactly once
    for h, src in enumerate(q_src):
        if src >= 0:  # the stored KV head this query head reads holds its original KV head
            assert kv_src[h // lay.q_per_kv] == src // 3
    assert lay.padded_intermediate_size % tp == 0


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_laid_out_params_give_the_same_logits(tp):
    """Padding and replication alone (one device, dense attention) change nothing."""
    from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params

    params = _stacked(TINY)
    lay = head_layout(TINY, tp)
    cfg = laid_out_config(TINY, lay)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 11)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))

    def logits(config, stacked):
        model = nnx.merge(model_graphdef(config), model_params(config, stacked))
        cache = init_cache(config.num_layers, 2, config.num_kv_heads, 16, config.head_dim)
        return model(tokens, positions, cache, positions, XlaOps(DenseAttention()))[0]

    ref = jax.jit(lambda p: logits(TINY, p))(params)
    got = jax.jit(lambda p: logits(cfg, lay_out_params(TINY, lay, p)))(params)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ engine


def _generate(config, params, mesh, prompts, max_tokens, **kw):
    cfg = EngineConfig(warmup=False, mesh=mesh, **kw)
    engine = build_engine(config, params, _Tok(), [], cfg)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id)] = o.outputs[0]
    stats = engine.stats()
    assert stats["pages_in_use"] == 0, stats
    return [outs[i] for i in range(len(prompts))], engine


def _assert_same(got, ref, atol):
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        for lg, lr in zip(g.logprobs, r.logprobs):
            assert lg.keys() == lr.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lr], [lr[t].logprob for t in lr], atol=atol)


@pytest.fixture(scope="module")
def tiny_reference():
    params = _stacked(TINY)
    prompts = [np.random.RandomState(i).randint(0, 128, n).tolist() for i, n in enumerate([5, 17, 40, 3, 33, 9])]
    # One prefill call and one decode shape per mesh (compiles dominate this file's time).
    kw = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=1 << 20)
    ref, _ = _generate(TINY, params, None, prompts, 10, **kw)
    return params, prompts, kw, ref


def test_async_scheduling_over_a_tp_mesh_feeds_rows_into_the_same_forward(tiny_reference):
    """Fed tokens keep the sharding `_place` gives a call's tokens: no second forward compiles."""
    params, prompts, kw, ref = tiny_reference
    got, engine = _generate(TINY, params, "tp=2", prompts, 10, async_scheduling=True, **kw)
    _assert_same(got, ref, atol=1e-4)
    assert engine.stats()["launched_steps"] > 0
    assert sum(f._cache_size() for f in engine.runner._steps.values()) == 2  # the mixed and the decode shape
    with pytest.raises(ValueError, match="async_scheduling runs on one data-parallel group"):
        _generate(TINY, params, "dp=2", prompts[:1], 2, async_scheduling=True, **kw)
    _, engine = _generate(TINY, params, "dp=2", prompts[:1], 2, async_scheduling=None, **kw)  # serve's default
    assert engine.async_scheduling is False and "launched_steps" not in engine.stats()


@pytest.mark.parametrize("mesh", MESHES)
def test_tiny_model_same_tokens_and_logprobs_on_every_mesh(tiny_reference, mesh):
    params, prompts, kw, ref = tiny_reference
    got, engine = _generate(TINY, params, mesh, prompts, 10, **kw)
    _assert_same(got, ref, atol=1e-4)
    assert engine.runner.num_compilations == 2, engine.runner.compiles.seen
    assert len({tuple(o.token_ids) for o in ref}) > 1  # not a degenerate model
    if "dp" in mesh:  # requests spread over the groups, each group's pages come back
        assert len(engine.page_tables) == parse_mesh(mesh)["dp"]


def test_dp_groups_route_shared_prefixes_together():
    from jserve.core.dp_scheduler import DataParallelScheduler
    from jserve.core.page_table import PageTable
    from jserve.core.scheduler import Request, Scheduler, SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=True)
    dps = DataParallelScheduler([Scheduler(cfg, PageTable(40, 16, enable_prefix_caching=True)) for _ in range(2)])
    system = list(range(1, 40))
    sp = SamplingParams(max_tokens=2)
    dps.add_request(Request("a", system + [50], sp, 0.0))
    dps.add_request(Request("b", [7, 8, 9], sp, 0.0))
    assert dps.group_of("a") == 0 and dps.group_of("b") == 1  # least loaded
    plan = dps.schedule()
    assert plan.dp_groups == [0, 1]
    dps.update(plan, {"a": 3, "b": 4})
    dps.check_invariants()
    dps.add_request(Request("c", system + [60], sp, 0.0))
    assert dps.group_of("c") == 0  # its prefix is cached in group 0, though group 0 is busier
    # Everything of Scheduler's public face that the engine and the async engine read.
    public = {n for n in dir(Scheduler) if not n.startswith("_")} - {"config", "page_table", "clock"}
    assert public <= set(dir(dps)), public - set(dir(dps))
    assert dps.get_request("c").request_id == "c" and dps.get_request("zzz") is None
    assert {r.request_id for r in dps.running + dps.waiting} == {"a", "b", "c"}
    b = dps.get_request("b")  # async scheduling's placeholder patch reaches b's group's page table
    dps.fill_placeholder(b, 0, 11)
    assert b.output_token_ids == [11] and dps.schedulers[1].page_table._seq("b").token_ids[3] == 11
    dps.abort_request("a")
    assert dps.group_of("a") is None and dps.num_running == 1 and dps.num_waiting == 1


def test_bad_dp_split_is_a_clear_error():
    with pytest.raises(ValueError, match="max_num_seqs \\(6\\) must be a multiple of dp \\(4\\)"):
        build_engine(TINY, _stacked(TINY), _Tok(), [],
                     EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=64,
                                  kv_cache_bytes=1 << 20, warmup=False, mesh="dp=4"))


# ------------------------------------------------------------------------------ HLO


def test_step_hlo_has_the_collectives_and_no_weight_gather():
    mesh = make_mesh("tp=4")
    cfg, per_layer = place_params(TINY, _stacked(TINY), mesh)
    engine = build_engine(TINY, _stacked(TINY), _Tok(), [],
                          EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16,
                                       kv_cache_bytes=1 << 20, warmup=False, mesh="tp=4"))
    runner = engine.runner
    from jserve.runtime.steps import StepRow

    arrays = runner.place(runner.pack([StepRow(0, [1], [1, 2])] * 4, 4, 1))  # two 16-token pages
    hlo = runner.step_fn(4, 1).lower(runner.params, runner.kv, *arrays).compile().as_text()
    # Megatron: one all-reduce after attention and one after the MLP per layer (XLA may fuse or
    # add a few for the embedding, norms and the tied head).
    all_reduces = len(re.findall(r"= [^=]*all-reduce(?:-start)?\(", hlo))
    assert all_reduces >= 2 * TINY.num_layers, all_reduces
    # No all-gather may produce a whole weight matrix (e.g. [64, 12*16] wq or [100->100, 64] w_down).
    weight_shapes = {tuple(x.shape) for x in jax.tree.leaves(per_layer) if x.ndim == 2}
    for m in re.finditer(r"f32\[([\d,]+)\][^=\n]*= [^\n]*all-gather", hlo):
        shape = tuple(int(d) for d in m.group(1).split(","))
        assert shape not in weight_shapes, f"a weight is gathered whole: {m.group(0)[:200]}"
    # Each device holds a quarter of each split weight.
    wq = per_layer["layers"][0]["wq"]
    assert wq.addressable_shards[0].data.shape == (64, wq.shape[1] // 4)


# ------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def smollm2_params(smollm2_checkpoint):
    from jserve.model.checkpoint import load_checkpoint

    config, params, _ = load_checkpoint(smollm2_checkpoint)
    return config, params


@pytest.mark.parametrize("mesh", ["dp=2,tp=2"])
def test_smollm2_golden_greedy_on_a_mesh(smollm2_params, golden, mesh):
    """The golden cases' first 8 greedy tokens (all confident) on a mesh that pads heads (tp=2) and
    splits the pool (dp=2). Each SmolLM2 mesh costs 1-2 min of compiling, so the sweep over every
    mesh is `scripts/bench_sharding.py` (all 8 meshes correct when last run); the tiny model above
    covers every mesh in the suite."""
    config, params = smollm2_params
    prompts = [c["prompt_ids"] for c in golden["cases"]]
    # All prompts fit one prefill call and one decode shape: two compilations per mesh.
    kw = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=16 << 20)
    got, engine = _generate(config, params, mesh, prompts, 8, **kw)
    for case, out in zip(golden["cases"], got):
        assert out.token_ids == case["greedy_ids"][:8]
    assert engine.runner.num_compilations == 2, engine.runner.compiles.seen


def test_make_mesh_keeps_a_user_mesh_device_order():
    devs = np.asarray(jax.devices()[:6]).reshape(3, 2)  # axes (tp=3, dp=2)
    mesh = make_mesh(jax.sharding.Mesh(devs, ("tp", "dp")))
    assert mesh.devices.shape == (2, 3)
    assert (mesh.devices == devs.T).all()  # device at tp=i, dp=j stays there


def test_restore_shardings_never_hold_a_whole_weight(smollm2_checkpoint):
    """What `LLM(mesh=...)` asks Orbax for: split weights arrive split (tp=2 pads heads, so
    those weights restore split along another axis and are laid out afterwards)."""
    from jserve.model.checkpoint import read_model_config
    from jserve.model.llama import param_shapes
    from jserve.runtime.sharding import restore_sharding

    config = read_model_config(smollm2_checkpoint)[0]
    for spec in ("tp=2", "tp=3", "dp=2,tp=2"):
        mesh = make_mesh(spec)
        layout = head_layout(config, dict(zip(mesh.axis_names, mesh.devices.shape))["tp"])
        for name, shape in param_shapes(config).items():
            shard = restore_sharding(mesh, name, shape, layout).shard_shape(shape)
            if np.prod(shape) >= 576 * 576:  # every matrix
                assert np.prod(shard) < np.prod(shape), (spec, name, shape, shard)


def test_cli_asks_for_cpu_devices_for_a_mesh():
    from jserve.cli import cpu_devices_for_mesh

    env = {}
    cpu_devices_for_mesh("dp=2,tp=3", env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=6"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"}
    cpu_devices_for_mesh("tp=2", env)  # the user's own count stays
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --other"
    with pytest.raises(ValueError, match="'pp'"):
        cpu_devices_for_mesh("pp=2", {})


def test_prompt_logprobs_on_a_mesh():
    """Prompt logprobs (the paged prefill's scoring step over the laid-out, sharded weights) agree too."""
    def prompt_logprobs(mesh):
        engine = build_engine(TINY, _stacked(TINY), _Tok(), [],
                              EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                           kv_cache_bytes=1 << 20, warmup=False, mesh=mesh))
        engine.add_request("a", [1, 5, 9, 22, 7], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[-1].prompt_logprobs

    ref, got = prompt_logprobs(None), prompt_logprobs("dp=2,tp=2")
    assert ref[0] is None and got[0] is None and len(got) == 5
    for r, g in zip(ref[1:], got[1:]):
        assert r.keys() == g.keys()
        np.testing.assert_allclose([g[t].logprob for t in r], [r[t].logprob for t in r], atol=1e-4)
