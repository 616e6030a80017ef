"""The paged runner against Hugging Face greedy tokens and against the dense-cache runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.core.request import GREEDY, SamplingParams
from jserve.model.checkpoint import read_params
from jserve.runtime.backends import NativeCpuBackend, XlaBackend
from jserve.runtime.backends.native_cpu import EIGEN_DOTS
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow
from pallas_kernels.native import decoder_layer as native_layer
from pallas_kernels.native import matmul as native_matmul


def _model_logits(config, params, ids):
    """The model's own logits at every position of `ids` (its layers unrolled, a contiguous cache)."""
    from flax import nnx

    from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params

    model = nnx.merge(model_graphdef(config), model_params(config, params))
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    cache = init_cache(config.num_layers, 1, config.num_kv_heads, len(ids), config.head_dim)
    logits, _ = model(jnp.asarray([ids], jnp.int32), positions, cache, positions,
                      XlaOps(DenseAttention(config.sliding_window)))
    return np.asarray(logits[0])


def rows(triples, sampling=GREEDY):
    """`StepRow`s from `(start, token_ids, page_ids)` triples, all with these settings."""
    return [StepRow(*t, sampling=sampling) for t in triples]


def _load(arch):
    config, params = read_params(DATA / "arch" / arch)
    return config, {k: jnp.asarray(v) for k, v in params.items()}, np.load(DATA / "arch" / arch / "reference.npz")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("arch", ["llama3", "mistral"])
def test_chunked_prefill_and_decode_over_pages_match_transformers(arch, backend):
    config, params, ref = _load(arch)
    runner = Runner(config, params, num_pages=32, page_size=4, max_model_len=64, backend=backend,
                    max_num_batched_tokens=16)
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    pages = [7, 3, 12, 5, 9]  # out of order on purpose; page 0 is the null page
    # Prefill in two chunks (6 + 4 tokens), as the scheduler does with a small budget.
    runner.execute(rows([(0, prompt[:6], pages[:2])]))
    out = runner.execute(rows([(6, prompt[6:], pages[:3])]))
    tokens = [int(out.tokens[0])]
    for _ in range(7):
        n = len(prompt) + len(tokens)
        out = runner.execute(rows([(n - 1, [tokens[-1]], pages[:-(-n // 4)])]))
        tokens.append(int(out.tokens[0]))
    assert tokens == ref["greedy_ids"][0].tolist()


def test_mixed_batch_of_decodes_and_chunks_matches_full_forward():
    """Several sequences at different stages in one step give the logits' argmax of a plain forward."""
    config, params, ref = _load("qwen3")
    runner = Runner(config, params, num_pages=40, page_size=4, max_model_len=32, backend="cpu",
                    max_num_batched_tokens=32)
    ids = ref["input_ids"]
    seqs = [ids[0, :13].tolist(), ids[1, :9].tolist(), ids[1, 5:20].tolist()]
    page_lists = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
    # Seq 0 fully computed but its last token; seq 1 prefilled up to 4; seq 2 nothing yet.
    runner.execute(rows([(0, seqs[0][:12], page_lists[0]), (0, seqs[1][:4], page_lists[1])]))
    out = runner.execute(rows([(12, seqs[0][12:], page_lists[0]), (4, seqs[1][4:], page_lists[1]),
                          (0, seqs[2], page_lists[2])]))
    expected = [int(np.argmax(_model_logits(config, params, s)[-1])) for s in seqs]
    assert out.tokens.tolist() == expected


def test_compilations_are_counted_and_stop_after_warmup():
    config, params, _ = _load("smollm2")
    runner = Runner(config, params, num_pages=16, page_size=4, max_model_len=16, backend="reference",
                    batch_buckets=(2, 4), token_buckets=(8,), max_num_batched_tokens=8)
    runner.warmup(progress=False)
    before = runner.num_compilations
    assert before > 0 and runner.num_compilations_after_warmup == 0
    runner.execute(rows([(0, [1, 2, 3, 4, 5], [1, 2])]))
    runner.execute(rows([(5, [6], [1, 2]), (0, [9], [3])]))
    runner.execute(rows([(0, [1, 2, 3], [5]), (0, [4, 5, 6, 7, 8], [6, 7]), (0, [1, 2], [8])]))
    assert runner.num_compilations == before and runner.num_compilations_after_warmup == 0
    with pytest.raises(ValueError, match="largest token bucket"):
        runner.execute(rows([(0, list(range(9)), [4, 5, 6])]))


def _step_hlo(runner, batch, tokens):
    arrays = runner.pack([None] * batch, batch, tokens)
    return runner.step_fn(batch, tokens).lower(runner.params, runner.kv, *arrays).as_text()


@pytest.mark.parametrize("native_matmuls", [True, False])
def test_cpu_steps_use_native_matmuls_or_eigen_dots_and_match_the_reference(native_matmuls):
    config, params, _ = _load("smollm2")
    kw = dict(num_pages=32, page_size=4, max_model_len=16, batch_buckets=(2, 8), token_buckets=(8,),
              max_num_batched_tokens=8)
    runner = Runner(config, params, backend="cpu", native_matmuls=native_matmuls, **kw)
    ref = Runner(config, params, backend="reference", **kw)
    assert isinstance(runner.backend, NativeCpuBackend) and isinstance(ref.backend, XlaBackend)
    assert runner.backend.native_attention
    assert runner.backend.native_matmuls == runner.backend.native_head == native_matmuls
    if native_matmuls:
        # Layer weights and the tied embedding packed once; every layer matmul and the LM head on
        # the packed kernel: in a prefill chunk q/k/v and gate/up as one call each, in decode all
        # the layers as one call (pallas_kernels.decoder_layer); one jit (no XLA dot left to pick
        # a library for).
        assert runner.params["layers"][0]["wq"].ndim == 3  # packed; the reference's are stacked
        assert ref.params["layers"]["wq"].shape == (config.num_layers, *params["wq"].shape[1:])
        assert runner.params["embed"].ndim == 3 and ref.params["embed"].ndim == 2
        for batch, tokens in ((1, 1), (2, 1), (8, 1), (1, 8)):
            hlo = _step_hlo(runner, batch, tokens)
            if tokens == 1:  # decode: all the layers as one native call, then the head
                assert hlo.count(f"@{native_layer.TARGET}(") == 1, (batch, tokens)
                assert hlo.count(f"@{native_matmul.TARGET}(") == 1, (batch, tokens)
                assert hlo.count(f"@{native_matmul.TARGET_MANY}(") == 0, (batch, tokens)
            else:
                assert hlo.count(f"@{native_layer.TARGET}(") == 0, (batch, tokens)
                assert hlo.count(f"@{native_matmul.TARGET}(") == 2 * config.num_layers + 1, (batch, tokens)
                assert hlo.count(f"@{native_matmul.TARGET_MANY}(") == 2 * config.num_layers, (batch, tokens)
            assert runner.backend.compiler_options(batch, tokens) is None
        _check_batch_8_matches_the_reference(runner, ref)
        return
    options = runner.backend.compiler_options
    assert options(4, 1) is None  # 2-4 rows: Eigen's logits dot is slow
    assert 1 in Runner(config, params, backend="cpu", num_pages=8, max_model_len=16).batch_buckets
    assert 1 not in Runner(config, params, backend="cpu_pallas", num_pages=8, max_model_len=16).batch_buckets
    assert options(8, 1) == EIGEN_DOTS
    assert options(2, 1) is None and options(2, 8) is None
    assert options(1, 8) == EIGEN_DOTS  # one-row prefill (the prompts below)
    assert runner.step_fn(8, 1) is runner.step_fn(1, 8) is not runner.step_fn(2, 1)
    _check_batch_8_matches_the_reference(runner, ref)


def _check_batch_8_matches_the_reference(runner, ref):
    runner.warmup(progress=False)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14, 15, 16, 17]]
    pages = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(len(prompts))]
    tokens = {}
    for r in (runner, ref):
        last = [int(r.execute(rows([(0, p, pg)])).tokens[0]) for p, pg in zip(prompts, pages)]
        seen = [list(p) + [t] for p, t in zip(prompts, last)]
        for _ in range(3):  # decode all five rows: the batch-8 bucket
            out = r.execute(rows([(len(s) - 1, [s[-1]], pg) for s, pg in zip(seen, pages)]))
            for s, t in zip(seen, out.tokens.tolist()):
                s.append(int(t))
        tokens[r.backend.name] = seen
    assert tokens["native"] == tokens["xla-reference"]
    assert runner.num_compilations_after_warmup == 0
    assert runner.records[-1].bucket == (8, 1)


def test_step_records_count_real_tokens_bytes_and_flops():
    config, params, _ = _load("llama2")
    runner = Runner(config, params, num_pages=16, page_size=4, max_model_len=32, backend="reference",
                    batch_buckets=(2,), token_buckets=(8,), max_num_batched_tokens=8)
    runner.execute(rows([(0, [1, 2, 3, 4, 5], [1, 2])]))
    runner.execute(rows([(5, [6], [1, 2])]))
    prefill, decode = runner.records
    assert (prefill.kind, prefill.bucket, prefill.real_tokens, prefill.padded_tokens) == ("mixed", (2, 8), 5, 8)
    assert (decode.kind, decode.bucket, decode.real_tokens, decode.padded_tokens) == ("decode", (2, 1), 1, 2)
    weights = sum(v.size * 4 for v in jax.tree.leaves(params))
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert decode.bytes_needed == weights + kv_token * (6 + 1)
    layer_params = sum(v.size for v in jax.tree.leaves(params)) - 2 * config.vocab_size * config.hidden_size
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * 6
    assert decode.flops_needed == 2 * layer_params + 2 * config.hidden_size * config.vocab_size + attention


_FRESH_PROCESS = r"""
import sys, threading
from jserve.model.checkpoint import read_params
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow

config, params = read_params(sys.argv[1])
runner = Runner(config, params, num_pages=16, page_size=4, max_model_len=16, backend="reference",
                batch_buckets=(2, 4), token_buckets=(8,), max_num_batched_tokens=8)
runner.warmup(progress=False)
# As in `jserve serve`: warm-up on the loader thread, steps on the engine thread; the first
# shape warm-up compiled (decode at batch 2) is the first one traffic uses.
t = threading.Thread(target=lambda: runner.execute([StepRow(5, [6], [1, 2]), StepRow(0, [9], [3])]))
t.start()
t.join()
print(runner.num_compilations_after_warmup)
"""


def test_no_compilation_after_warmup_in_a_fresh_process():
    """Regressions of the first-traffic compile: uncommitted KV pages on the first warm-up call, and
    Pallas imported (new JAX config options, so a new tracing context) during the first trace."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(DATA / "arch" / "smollm2")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0", out.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_backend_runner_matches_reference_backend():
    """A bfloat16 model with head_dim 64 (the Mosaic GPU kernel's case) through chunked prefill
    and decode on the `gpu` and `reference` backends: same top logprobs at every step."""
    import dataclasses

    config, params, _ = _load("llama3")
    config = dataclasses.replace(config, head_dim=64)
    rng = np.random.default_rng(0)
    shapes = {"wq": (2, 64, 256), "wk": (2, 64, 128), "wv": (2, 64, 128), "wo": (2, 256, 64)}
    params = {k: jnp.asarray(rng.standard_normal(shapes.get(k, v.shape)) * (0.5 if k == "embed" else 0.1)
                             + (1.0 if "norm" in k else 0.0), jnp.bfloat16)
              for k, v in params.items()}
    prompt = rng.integers(3, 256, 40).tolist()
    pages = [9, 3, 12, 5, 7]  # out of order; page 0 is the null page
    wants_logprobs = SamplingParams(temperature=0.0, logprobs=5)  # top logprobs on
    tops = {}
    for backend in ("gpu", "reference"):
        runner = Runner(config, params, num_pages=16, page_size=16, max_model_len=80,
                        backend=backend, max_num_batched_tokens=32, kv_dtype=jnp.bfloat16)
        runner.execute(rows([(0, prompt[:24], pages[:2])], wants_logprobs))
        steps = [runner.execute(rows([(24, prompt[24:], pages[:3])], wants_logprobs))]
        for n in range(40, 56):  # decode, fed the prompt's own tokens so both runs see the same
            steps.append(runner.execute(rows([(n, [prompt[n - 40]], pages[:-(-(n + 1) // 16)])],
                                             wants_logprobs)))
        tops[backend] = np.stack([s.top_logprobs[0] for s in steps])
    assert np.isfinite(tops["reference"]).all() and tops["reference"].min() < -1.0  # not one-hot
    np.testing.assert_allclose(tops["gpu"], tops["reference"], atol=0.1)


def test_bfloat16_weights_stay_bfloat16_on_the_native_matmuls():
    """A bfloat16 model on the CPU backend: the layer weights and the tied embedding packed as
    bfloat16 (half the bytes; on XLA's bfloat16 dots the SmolLM2 step was 16x slower at one row),
    every matmul on the native kernel, and the same top logprobs as XLA's dots over the same
    weights through chunked prefill and decode."""
    config, params, _ = _load("smollm2")
    params = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
    kw = dict(num_pages=16, page_size=4, max_model_len=32, backend="cpu", max_num_batched_tokens=8,
              batch_buckets=(1, 2), token_buckets=(8,), kv_dtype=jnp.bfloat16)
    native, xla = Runner(config, params, **kw), Runner(config, params, native_matmuls=False, **kw)
    assert native.backend.native_matmuls and native.backend.native_head and not xla.backend.native_matmuls
    assert native.params["layers"][0]["w_gate"].dtype == jnp.bfloat16 == native.params["embed"].dtype
    assert native.params["layers"][0]["w_gate"].ndim == 3 and native.params["embed"].ndim == 3
    assert native.param_bytes == sum(v.size * 2 for v in params.values())  # the step's floor reads these
    hlo = _step_hlo(native, 1, 8)
    assert hlo.count(f"@{native_matmul.TARGET}(") == 2 * config.num_layers + 1
    assert _step_hlo(native, 1, 1).count(f"@{native_layer.TARGET}(") == 1  # decode: the fused layers
    prompt = list(range(3, 15))
    wants_logprobs = SamplingParams(temperature=0.0, logprobs=5)
    tops = {}
    for name, runner in (("native", native), ("xla", xla)):
        steps = [runner.execute(rows([(0, prompt[:8], [5, 2])], wants_logprobs)),
                 runner.execute(rows([(8, prompt[8:], [5, 2, 9])], wants_logprobs))]
        for n in range(12, 20):  # decode, fed fixed tokens so both runs see the same
            steps.append(runner.execute(rows([(n, [n], [5, 2, 9, 11, 4][:n // 4 + 1])], wants_logprobs)))
        tops[name] = np.stack([s.top_logprobs[0] for s in steps])
    assert np.isfinite(tops["xla"]).all() and tops["xla"].min() < -1.0  # not one-hot
    np.testing.assert_allclose(tops["native"], tops["xla"], atol=0.05)



def test_step_records_count_an_int8_caches_scales():
    """An int8 KV cache's floor counts its codes (1 byte an element) and a float32 scale per token
    and KV head, K and V."""
    import jax.numpy as jnp

    config, params, _ = _load("llama2")
    runner = Runner(config, params, num_pages=16, page_size=4, max_model_len=32, backend="reference",
                    kv_dtype=jnp.int8, batch_buckets=(2,), token_buckets=(8,), max_num_batched_tokens=8)
    runner.execute(rows([(0, [1, 2, 3, 4, 5], [1, 2])]))
    runner.execute(rows([(5, [6], [1, 2])]))
    weights = sum(v.size * 4 for v in jax.tree.leaves(params))
    kv_token = 2 * config.num_layers * config.num_kv_heads * (config.head_dim * 1 + 4)
    assert runner.records[-1].bytes_needed == weights + kv_token * (6 + 1)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_pallas"])
def test_a_mixed_step_is_one_call_and_gives_what_separate_steps_give(backend):
    """Decode rows and prefill chunks of several lengths (one continuing a cached prefix) in one
    ragged call: the samples and the pages written equal those of each row run on its own."""
    config, params, ref = _load("llama3")
    prompts = [[int(t) for t in ref["input_ids"][0, :n]] for n in (7, 3, 11)]
    pages = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]

    def runner():
        return Runner(config, params, num_pages=16, page_size=4, max_model_len=16, backend=backend,
                      batch_buckets=(1, 2, 4), max_num_batched_tokens=16)

    alone, mixed = runner(), runner()
    # Row 0 is decoding (its prompt cached), row 1 starts, row 2 continues after 5 cached tokens.
    for r in (alone, mixed):
        r.execute(rows([(0, prompts[0], pages[0])]))
        r.execute(rows([(0, prompts[2][:5], pages[2])]))
    step = [(7, [prompts[0][-1]], pages[0]), (0, prompts[1], pages[1]), (5, prompts[2][5:], pages[2])]
    expected = [int(alone.execute(rows([s])).tokens[0]) for s in step]
    calls = len(mixed.records)
    out = mixed.execute(rows(step))
    assert len(mixed.records) == calls + 1 and mixed.records[-1].kind == "mixed"
    assert mixed.records[-1].bucket == (4, 16) and mixed.records[-1].real_tokens == 1 + 3 + 6
    assert [int(t) for t in out.tokens] == expected
    for a, b in zip(jax.tree.leaves(alone.kv), jax.tree.leaves(mixed.kv)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_params_device_is_found_once_per_params_object(monkeypatch):
    """`Runner.device` flattens the params only when they are replaced, not on every step; the
    steps' samples are those of a runner that looks it up each time."""
    from jserve.runtime import runner as runner_module

    config, params, _ = _load("llama2")
    steps = [rows([(0, [1, 2, 3, 4, 5], [1, 2])]), rows([(5, [6], [1, 2])]), rows([(6, [7], [1, 2])])]
    kwargs = dict(num_pages=16, page_size=4, max_model_len=32, backend="cpu", batch_buckets=(2,),
                  token_buckets=(8,), max_num_batched_tokens=8)
    class EachStep(Runner):  # the lookup before it was cached
        device = property(lambda self: runner_module._device_of(self.params))

    reference = EachStep(config, params, **kwargs)
    expected = [reference.execute(s).tokens.tolist() for s in steps]
    runner = Runner(config, params, **kwargs)
    calls = []
    real = runner_module._device_of
    monkeypatch.setattr(runner_module, "_device_of", lambda p: calls.append(p) or real(p))
    assert [runner.execute(s).tokens.tolist() for s in steps] == expected
    assert len(calls) == 1 and calls[0] is runner.params
    runner.params = dict(runner.params)  # replaced (as update_weights and wake-up do): looked up again
    runner.execute(rows([(7, [8], [1, 2])]))
    assert len(calls) == 2 and runner.device == jax.devices()[0]


def test_plain_greedy_calls_take_the_argmax_alone_and_sample_as_the_full_sampler_does():
    """A call whose rows are all plain greedy runs the argmax alone (not the full sampler), gives the
    tokens the full sampler gives on the same logits, and zeros for the logprob outputs; a row
    with a temperature, logprobs, a penalty or a logit entry sends the call to the full sampler.
    Warm-up compiles both for every batch, so neither kind of call compiles afterwards."""
    from jserve.runtime.sampler import SamplingArrays

    def plain(**settings):
        return SamplingArrays.build([(SamplingParams(temperature=0.0, **settings), 0), None], 2).plain_greedy()

    assert plain() and SamplingArrays.build([None] * 3, 3).plain_greedy()
    for settings in ({"logprobs": 2}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                     {"frequency_penalty": 0.5}, {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [1, 2]}):
        assert not plain(**settings), settings
    assert not SamplingArrays.build([(SamplingParams(temperature=0.7), 0)], 1).plain_greedy()

    config, params, _ = _load("smollm2")
    runner = Runner(config, params, num_pages=16, page_size=4, max_model_len=16, backend="cpu",
                    batch_buckets=(2, 4), token_buckets=(8,), max_num_batched_tokens=8)
    runner.warmup(progress=False)
    calls = {"greedy": 0, "full": 0}
    for name in ("greedy", "full"):
        fn = getattr(runner.sampler, name)

        def counted(*args, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*args)

        setattr(runner.sampler, name, counted)
    greedy = runner.execute(rows([(0, [1, 2, 3, 4, 5], [1, 2]), (0, [7, 8], [3])]))
    assert calls == {"greedy": 1, "full": 0}
    assert not greedy.logprob.any() and not greedy.rank.any() and not greedy.top_ids.any()
    wanted = runner.execute(rows([(0, [1, 2, 3, 4, 5], [4, 5]), (0, [7, 8], [6])],
                                 SamplingParams(temperature=0.0, logprobs=1)))
    assert calls == {"greedy": 1, "full": 1}
    np.testing.assert_array_equal(greedy.tokens, wanted.tokens)
    assert wanted.rank.min() == 1  # the full sampler's logprob outputs where asked
    runner.execute(rows([(5, [int(greedy.tokens[0])], [1, 2]), (2, [int(greedy.tokens[1])], [3])],
                        SamplingParams(temperature=0.8, seed=1)))
    assert calls == {"greedy": 1, "full": 2} and runner.num_compilations_after_warmup == 0

    logits = jax.random.normal(jax.random.key(0), (4, config.vocab_size))
    logits = logits.at[1, 7].set(50.0).at[1, 9].set(50.0)  # a tie: the first index, as jnp.argmax
    sampling = SamplingArrays.build([None] * 4, 4)
    history = runner.sampling_inputs([None] * 4, 4)[1]
    full = runner.sampler.full(logits, sampling, history, runner.masks.device(4, ()))
    np.testing.assert_array_equal(runner.sampler.greedy(logits)["tokens"], full["tokens"])
    np.testing.assert_array_equal(runner.sampler.greedy(logits)["tokens"], np.argmax(np.asarray(logits), -1))
