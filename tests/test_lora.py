"""LoRA slots in the model and the runner (`jserve.model.lora`, `jserve.runtime.lora_writer`): rows
with different adapters in one call give what a model with the adapter merged into its weights
gives, on every backend, in decode, mixed, multi-step and verify calls; no compilation follows a
change of adapters."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.core.request import GREEDY
from jserve.model import lora
from jserve.model.checkpoint import read_params
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow


def _load(arch="llama3"):
    config, params = read_params(DATA / "arch" / arch)
    return config, {k: np.asarray(v) for k, v in params.items()}


def random_adapter(config, rank, seed, targets=lora.LORA_TARGETS, scale=0.3):
    """target -> (A [L, in, r], B [L, r, out]) float32, large enough to change the greedy tokens."""
    rng = np.random.default_rng(seed)
    shapes = lora.target_shapes(config)
    L = config.num_layers
    return {t: (rng.normal(0, scale, (L, shapes[t][0], rank)).astype(np.float32),
                rng.normal(0, scale, (L, rank, shapes[t][1])).astype(np.float32)) for t in targets}


def merged(params, adapter):
    """Checkpoint params with the adapter merged into the weights: W + A @ B per layer."""
    out = dict(params)
    for t, (a, b) in adapter.items():
        out[t] = params[t] + np.einsum("lir,lro->lio", a, b)
    return out


def decode_greedy(runner, prompt, slot, steps=6, pages=(1, 2, 3, 4)):
    """Prefill `prompt` then greedy-decode `steps` tokens alone, with LoRA slot `slot`: (tokens, logprobs)."""
    out = runner.execute([StepRow(0, prompt, list(pages), GREEDY, lora_slot=slot)])
    tokens, logprobs = [int(out.tokens[0])], [float(out.logprob[0])]
    for _ in range(steps - 1):
        n = len(prompt) + len(tokens)
        out = runner.execute([StepRow(n - 1, [tokens[-1]], list(pages), GREEDY, lora_slot=slot)])
        tokens.append(int(out.tokens[0]))
        logprobs.append(float(out.logprob[0]))
    return tokens, logprobs


def _runner(config, params, backend, spec=None, **kw):
    return Runner(config, {k: jnp.asarray(v) for k, v in params.items()}, num_pages=64, page_size=4,
                  max_model_len=64, backend=backend, max_num_batched_tokens=32, lora=spec, **kw)


@pytest.mark.parametrize("backend", ["native", "xla", "xla-reference"])
def test_each_slot_matches_its_merged_weights_and_slot_0_the_base(backend):
    config, params = _load()
    adapters = {1: random_adapter(config, 8, 1), 2: random_adapter(config, 4, 2, targets=("wq", "wv"))}
    runner = _runner(config, params, backend, lora.LoraSpec(max_loras=2, max_rank=8))
    for slot, adapter in adapters.items():
        runner.write_lora_slot(slot, adapter)
    prompt = [5, 17, 99, 3, 42, 7, 61, 200, 11, 8]
    want = {0: decode_greedy(_runner(config, params, backend), prompt, 0)}
    for slot, adapter in adapters.items():
        want[slot] = decode_greedy(_runner(config, merged(params, adapter), backend), prompt, 0)
    assert len({tuple(w[0]) for w in want.values()}) == 3  # the adapters change the tokens
    for slot in (0, 1, 2):
        got = decode_greedy(runner, prompt, slot)
        assert got[0] == want[slot][0], slot
        np.testing.assert_allclose(got[1], want[slot][1], atol=2e-4)


def test_a_mixed_batch_gives_each_row_its_adapter():
    """Three rows with slots 2, 0, 1 in one mixed call (chunks of different lengths), then decode
    calls of all three: each row's tokens are those it gets alone."""
    config, params = _load("qwen2")
    spec = lora.LoraSpec(max_loras=2, max_rank=8)
    runner = _runner(config, params, "native", spec)
    runner.write_lora_slot(1, random_adapter(config, 8, 3))
    runner.write_lora_slot(2, random_adapter(config, 8, 4))
    prompts = [[5, 17, 99, 3, 42, 7], [61, 200, 11, 8, 9, 10, 33, 2, 1], [4, 4, 90]]
    slots, pages = [2, 0, 1], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    alone = [decode_greedy(runner, p, s, steps=4, pages=pg)[0] for p, s, pg in zip(prompts, slots, pages)]
    out = runner.execute([StepRow(0, p, pg, GREEDY, lora_slot=s) for p, s, pg in zip(prompts, slots, pages)])
    tokens = [[int(t)] for t in out.tokens]
    for _ in range(3):
        rows = [StepRow(len(p) + len(t) - 1, [t[-1]], pg, GREEDY, lora_slot=s)
                for p, t, s, pg in zip(prompts, tokens, slots, pages)]
        for t, new in zip(tokens, runner.execute(rows).tokens):
            t.append(int(new))
    assert tokens == alone


def test_rewriting_a_slot_changes_its_rows_without_compiling():
    config, params = _load()
    runner = _runner(config, params, "native", lora.LoraSpec(max_loras=1, max_rank=8))
    runner.warmup(progress=False)
    prompt = [5, 17, 99, 3, 42, 7, 61, 200, 11, 8]
    base = decode_greedy(runner, prompt, 1)  # an empty slot is the base model
    assert base == decode_greedy(runner, prompt, 0)
    runner.write_lora_slot(1, random_adapter(config, 8, 5))
    with_adapter = decode_greedy(runner, prompt, 1)
    assert with_adapter[0] != base[0]
    runner.write_lora_slot(1, None)
    assert decode_greedy(runner, prompt, 1) == base
    assert runner.num_compilations_after_warmup == 0


def test_multi_step_and_verify_calls_carry_the_rows_slots():
    config, params = _load()
    adapter = random_adapter(config, 8, 6)
    runner = _runner(config, params, "native", lora.LoraSpec(max_loras=1, max_rank=8), max_decode_steps=4,
                     num_speculative_tokens=2)
    runner.write_lora_slot(1, adapter)
    prompt = [5, 17, 99, 3, 42, 7, 61, 200, 11, 8]
    want, _ = decode_greedy(runner, prompt, 1, steps=5)
    out = runner.execute([StepRow(0, prompt, [1, 2, 3, 4], GREEDY, lora_slot=1)])
    first = int(out.tokens[0])
    multi = runner.execute_decode_steps([StepRow(len(prompt), [first], [1, 2, 3, 4], GREEDY, lora_slot=1,
                                                 decode_steps=4)])
    assert [first, *[int(t) for t in multi.tokens[:, 0]]] == want
    verify = runner.execute_verify([StepRow(len(prompt), [first], [1, 2, 3, 4], GREEDY, lora_slot=1,
                                            draft_ids=want[1:3])])
    assert int(verify.num_valid[0]) == 3  # both drafts (the adapter's own tokens) confirmed
    assert [int(t) for t in verify.tokens[:, 0]] == want[1:4]


def test_slot_arrays_refuse_what_does_not_fit():
    config, _ = _load()
    spec = lora.LoraSpec(max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match="rank 8 .* exceeds max_lora_rank 4"):
        lora.slot_arrays(random_adapter(config, 8, 0), config, spec)
    bad = random_adapter(config, 4, 0, targets=("wq",))
    bad["wq"] = (bad["wq"][0][:, :-1], bad["wq"][1])
    with pytest.raises(ValueError, match="wq matrices"):
        lora.slot_arrays(bad, config, spec)
    with pytest.raises(ValueError, match="w_up"):
        lora.slot_arrays(random_adapter(config, 4, 0), config, lora.LoraSpec(1, 4, targets=lora.LORA_TARGETS[:4]))
    with pytest.raises(ValueError, match="read one input"):
        lora.LoraSpec(1, 4, targets=("wq",))
    with pytest.raises(ValueError, match="max_loras"):
        lora.LoraSpec(max_loras=0)


# The slot stacks' PartitionSpecs on a tp mesh (one layer's dims; stacked params lead with the layer axis).
_COLUMN, _ROW = (None, None, "tp"), ("tp", None, None, None)
SLOT_SPECS = {"lora_a_wq_wk_wv": (None,) * 4, "lora_a_w_gate_w_up": (None,) * 4, "lora_a_wo": _ROW,
              "lora_a_w_down": _ROW, **{f"lora_b_{t}": _COLUMN for t in ("wq", "wk", "wv", "w_gate", "w_up")},
              "lora_b_wo": (None,) * 3, "lora_b_w_down": (None,) * 3}


def _slots(runner):
    """name -> (array, its layer-less PartitionSpec as a full tuple) of layer 0's (or the stacked) slots."""
    layers = runner.params["layers"]
    stacked = 0 not in layers
    out = {}
    for name, x in (layers if stacked else layers[0]).items():
        if name.startswith("lora_"):
            spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
            out[name] = (x, spec[1:] if stacked else spec)
    return out


def test_slots_on_a_tp_mesh_are_sharded_like_their_base_linears():
    """tp=2 (fake CPU devices): B of the column-parallel targets split on its out dim, A of the
    row-parallel ones on its in dim (their partial sums reduced like the base linear's), the rest
    replicated; writing a slot keeps the shardings, and each slot's tokens and logprobs are the
    single device's."""
    from jserve.runtime.sharding import make_mesh

    config, params = _load()
    spec = lora.LoraSpec(max_loras=2, max_rank=8)
    runner = _runner(config, params, "xla", spec, mesh=make_mesh("tp=2"))
    slots = _slots(runner)
    assert {name: s for name, (_, s) in slots.items()} == SLOT_SPECS
    b_wq, a_wo = slots["lora_b_wq"][0], slots["lora_a_wo"][0]
    assert b_wq.addressable_shards[0].data.shape[-1] == b_wq.shape[-1] // 2
    assert a_wo.addressable_shards[0].data.shape[-4] == a_wo.shape[-4] // 2
    before = {name: x.sharding for name, (x, _) in slots.items()}
    adapters = {1: random_adapter(config, 8, 1), 2: random_adapter(config, 4, 2, targets=("wo", "w_down"))}
    single = _runner(config, params, "xla", spec)
    for slot, adapter in adapters.items():
        runner.write_lora_slot(slot, adapter)
        single.write_lora_slot(slot, adapter)
    assert {name: x.sharding for name, (x, _) in _slots(runner).items()} == before
    prompt = [5, 17, 99, 3, 42, 7, 61, 200, 11, 8]
    results = {slot: decode_greedy(runner, prompt, slot) for slot in (0, 1, 2)}
    assert len({tuple(r[0]) for r in results.values()}) == 3  # both adapters change the tokens
    for slot, got in results.items():
        want = decode_greedy(single, prompt, slot)
        assert got[0] == want[0], slot
        np.testing.assert_allclose(got[1], want[1], atol=2e-4)
