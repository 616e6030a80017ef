"""Every backend's layer stack against the model's own layers, and the scanned stack's HLO.

The reference is `LlamaModel` itself: its `DecoderLayer`s unrolled as plain XLA ops over a
contiguous cache (`XlaOps(DenseAttention())`), one forward over the whole sequence. Each backend
runs the same weights its own way (packed native matmuls, the fused native decode layers, a
scanned stack over folded pages, Pallas interpret-mode attention) through chunked prefill and
decode over scattered pages, and must give the same log-probabilities.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch_helpers import IdTokenizer, load_arch
from jserve.core.request import SamplingParams
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
from jserve.runtime import backends
from jserve.runtime.runner import Runner
from jserve.runtime.steps import StepRow

WANTS_LOGPROBS = SamplingParams(temperature=0.0, logprobs=5)

# name: (backend name, backend options)
BACKENDS = {
    "native fused": ("cpu", {}),
    "native xla dots": ("cpu", {"native_matmuls": False}),
    "xla scanned reference": ("reference", {}),
    "xla unrolled reference": ("reference", {"scan": False}),
    "xla scanned pallas": ("cpu_pallas", {}),
}


def _model_logprobs(config, params, ids):
    """Log-probabilities at every position from the model's own unrolled layers."""
    T = len(ids)
    model = nnx.merge(model_graphdef(config), model_params(config, params))
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    cache = init_cache(config.num_layers, 1, config.num_kv_heads, T, config.head_dim)
    logits, _ = model(jnp.asarray([ids], jnp.int32), positions, cache, positions,
                      XlaOps(DenseAttention(config.sliding_window)))
    return np.asarray(jax.nn.log_softmax(logits[0], axis=-1))


@pytest.mark.parametrize("arch", ["smollm2", "qwen2", "mistral"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_stacks_match_the_models_own_layers(arch, name):
    config, params = load_arch(arch)
    kernel, options = BACKENDS[name]
    backend = backends.create(kernel, **options)
    runner = Runner(config, params, num_pages=24, page_size=4, max_model_len=32, backend=backend,
                    max_num_batched_tokens=8, batch_buckets=(1, 2), token_buckets=(8,))
    if name == "native fused" and arch == "smollm2":
        assert runner.ops.fused  # no biases, no q/k norms: the decode steps take the fused call
    ids = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, 14)]
    pages = [7, 3, 12, 5]  # out of order; page 0 is the null page
    steps = [runner.execute([StepRow(0, ids[:8], pages[:2], WANTS_LOGPROBS)]),  # two prefill chunks
             runner.execute([StepRow(8, ids[8:11], pages[:3], WANTS_LOGPROBS)])]
    for n in range(11, 14):  # decode, fed the sequence's own tokens
        steps.append(runner.execute([StepRow(n, [ids[n]], pages[:n // 4 + 1], WANTS_LOGPROBS)]))
    want = _model_logprobs(config, params, ids)
    for pos, out in zip([7, 10, 11, 12, 13], steps):
        top = np.sort(want[pos])[::-1][:5]
        np.testing.assert_allclose(out.top_logprobs[0][:5], top, atol=2e-4, err_msg=f"position {pos}")


def _decode_hlo(runner, batch):
    tokens, positions, meta, last = runner.pack([None] * batch, batch, 1)
    return runner.step_fn(batch, 1).lower(runner.params, runner.kv, tokens, positions, meta,
                                          last).compile().as_text()


def test_scanned_stack_has_no_cache_sized_copy_and_one_layer_body():
    """The XLA backend's decode step: the layers in one while loop whose body is compiled once
    (the HLO does not grow with depth), the folded pages carried through it and written in place
    (donated, aliased to the output, never copied)."""
    config, params = load_arch("llama3")
    num_pages, page = 64, 4
    sizes = {}
    for layers in (config.num_layers, 4 * config.num_layers):
        deep = {k: (jnp.concatenate([v] * (layers // config.num_layers)) if v.shape[0] == config.num_layers
                    and k not in ("embed", "lm_head", "final_norm") else v) for k, v in params.items()}
        cfg = config.__class__(**{**config.__dict__, "num_layers": layers})
        runner = Runner(cfg, deep, num_pages=num_pages, page_size=page, max_model_len=32, backend="reference",
                        batch_buckets=(4,), token_buckets=(8,), max_num_batched_tokens=8)
        k_pages, v_pages = runner.kv
        assert k_pages.shape == (cfg.num_kv_heads, layers * num_pages, page, cfg.head_dim)
        hlo = _decode_hlo(runner, 4)
        cache = rf"f32\[{cfg.num_kv_heads},{layers * num_pages},{page},{cfg.head_dim}\]"
        copies = [line for line in hlo.splitlines() if re.search(cache + r"\S* copy\(", line)]
        assert not copies, copies
        flat = rf"f32\[{cfg.num_kv_heads},{layers * num_pages * page},{cfg.head_dim}\]"
        assert not [line for line in hlo.splitlines() if re.search(flat + r"\S* copy\(", line)]
        header = hlo.splitlines()[0]
        assert len(re.findall(r"\{\d+\}: \(\d+, \{\}, (?:may|must)-alias\)", header)) == 2, header  # K and V
        sizes[layers] = (len(hlo.splitlines()), hlo.count(" while("))
    (small, loops), (deep_size, deep_loops) = sizes.values()
    assert loops == deep_loops >= 1 and deep_size < 1.05 * small, sizes


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_prompt_logprobs_on_the_paged_runner_match_the_model(backend):
    """Prompt logprobs come from the engine's own prefill chunks (no second runner): each
    position's chosen-token logprob and top-3 equal the model's; a second request of the same
    prompt (whose pages the prefix cache holds) and n=2 get them whole too."""
    from jserve.core.request import SamplingParams
    from jserve.engine import EngineConfig, build_engine

    config, params = load_arch("smollm2")
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=64,
        backend=backend, warmup=False))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, config.vocab_size, 19)]
    want = _model_logprobs(config, params, ids)
    for rid, n in (("a", 1), ("b", 1), ("c", 2)):
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=n))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        got = outs[-1].prompt_logprobs
        assert got[0] is None and len(got) == len(ids), rid
        for q, entry in enumerate(got[1:]):  # position q predicts token q + 1
            token = ids[q + 1]
            np.testing.assert_allclose(entry[token].logprob, want[q][token], atol=2e-4, err_msg=f"{rid} {q}")
            top = sorted((e for e in entry.values() if e.rank <= 3), key=lambda e: e.rank)
            np.testing.assert_allclose([e.logprob for e in top], np.sort(want[q])[::-1][:3], atol=2e-4)
    stats = engine.stats()
    assert stats["pages_in_use"] == 0
    assert stats["compilations_after_warmup"] >= 1  # the scoring step compiles on first use
