"""Weights in place (`LLM.update_weights`): after an update the engine serves exactly what a fresh
`LLM` on the same weights serves (greedy, float32), with no compilation, from jserve's names or
Hugging Face's, on one device or a dp=2,tp=2 mesh from a differently sharded source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jserve.core.request import SamplingParams
from jserve.model.checkpoint import convert, load_checkpoint, save_params
from jserve.model.sources import _HF_GLOBAL, _HF_LAYER

DATA = Path(__file__).parent / "data"
PROMPTS = [[5, 9, 17, 33, 65, 129], [7, 7, 8, 200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SETTINGS = dict(dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, page_size=8,
                num_pages=32, compilation_cache=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_checkpoint):
    """(the tiny llama3 checkpoint, a copy with perturbed weights, those weights on the host)."""
    root = tmp_path_factory.mktemp("weights")
    hf = root / "hf"
    shutil.copytree(DATA / "arch" / "llama3", hf)
    shutil.copy(smollm2_checkpoint / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    convert(hf, root / "base", progress=False)
    _, params, _ = load_checkpoint(root / "base", host=True)
    rng = np.random.default_rng(0)
    perturbed = {k: (v + rng.normal(0, 0.05, v.shape)).astype(v.dtype) for k, v in params.items()}
    shutil.copytree(root / "base", root / "perturbed", ignore=shutil.ignore_patterns("params"))
    save_params(root / "perturbed" / "params", perturbed)
    return root / "base", root / "perturbed", perturbed


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def _hf_names(params: dict, num_layers: int) -> dict:
    """jserve's checkpoint layout -> Hugging Face's names ([out, in] linears)."""
    out = {hf: (params[ours].T if t else params[ours]) for hf, (ours, t) in _HF_GLOBAL.items() if ours in params}
    for i in range(num_layers):
        for hf, (ours, t) in _HF_LAYER.items():
            if ours in params:
                out[f"model.layers.{i}.{hf}"] = params[ours][i].T if t else params[ours][i]
    return out


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_update_equals_a_fresh_llm_on_the_new_weights(checkpoints, backend):
    from jserve import LLM

    base, perturbed_dir, perturbed = checkpoints
    fresh = LLM(str(perturbed_dir), backend=backend, **SETTINGS, warmup=False)  # only its tokens
    want = _tokens(fresh)
    fresh.close()
    llm = LLM(str(base), backend=backend, **SETTINGS)
    before = _tokens(llm)
    assert before != want  # the perturbation changes the greedy text: the comparison can fail
    timing = llm.update_weights(perturbed)
    assert _tokens(llm) == want
    assert timing["seconds"] > 0
    # Hugging Face names, from JAX arrays on the device: back to the original weights
    _, original, _ = load_checkpoint(base)
    llm.update_weights(_hf_names(original, llm.config.num_layers))
    assert _tokens(llm) == before
    # donated device arrays already on the serving device: taken over, not freed under the new params
    llm.update_weights({k: jax.device_put(v) for k, v in perturbed.items()}, donate=True)
    assert _tokens(llm) == want
    assert llm.stats()["compilations_after_warmup"] == 0
    llm.close()


def test_update_on_a_mesh_from_a_differently_sharded_source(checkpoints):
    """dp=2,tp=2 serving mesh on devices 0-3; the source split over a 1-D mesh of devices 4-7."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jserve import LLM

    base, perturbed_dir, perturbed = checkpoints
    fresh = LLM(str(perturbed_dir), mesh="dp=2,tp=2", **SETTINGS, warmup=False)  # only its tokens
    want = _tokens(fresh)
    fresh.close()
    llm = LLM(str(base), mesh="dp=2,tp=2", **SETTINGS)
    before = _tokens(llm)
    assert before != want
    trainer = Mesh(np.array(jax.devices()[4:8]), ("fsdp",))
    source = {k: jax.device_put(v, NamedSharding(trainer, P("fsdp") if v.shape[0] % 4 == 0 else P()))
              for k, v in perturbed.items()}
    llm.update_weights(source, donate=True)
    assert _tokens(llm) == want
    assert all(x.is_deleted() for x in source.values() if x.shape[0] % 4 == 0)  # donated: moved, not copied
    assert llm.stats()["compilations_after_warmup"] == 0
    llm.close()


def test_bad_weights_are_named_and_nothing_changes(checkpoints):
    from jserve import LLM

    base, _, perturbed = checkpoints
    llm = LLM(str(base), **SETTINGS)
    before = _tokens(llm)
    with pytest.raises(ValueError, match="missing \\['wq'\\]"):
        llm.update_weights({k: v for k, v in perturbed.items() if k != "wq"})
    with pytest.raises(ValueError, match="'w_up' has shape"):
        llm.update_weights({**perturbed, "w_up": perturbed["w_up"][:, :, :64]})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.nope.weight'"):
        llm.update_weights({"model.layers.0.mlp.nope.weight": np.zeros((4, 4))})
    with pytest.raises(ValueError, match="policy must be one of"):
        llm.update_weights(perturbed, policy="later")
    assert _tokens(llm) == before
    assert llm.stats()["compilations_after_warmup"] == 0
    llm.close()


def test_replace_params_checks_the_tree_shapes_dtypes_and_shardings(checkpoints):
    from jserve import LLM

    llm = LLM(str(checkpoints[0]), backend="xla", **SETTINGS)
    params = llm.runner.params
    same = jax.tree.map(lambda x: x + 0, params)
    with pytest.raises(ValueError, match=r"\['final_norm'\]: bfloat16\[64\], expected float32\[64\]"):
        llm.runner.replace_params({**same, "final_norm": same["final_norm"].astype("bfloat16")})
    with pytest.raises(ValueError, match="missing"):
        llm.runner.replace_params({k: v for k, v in same.items() if k != "final_norm"})
    other = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    with pytest.raises(ValueError, match=r"\['embed'\]: sharded as"):
        llm.runner.replace_params({**same, "embed": jax.device_put(same["embed"], other)})
    llm.runner.replace_params(same)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))  # the old buffers are freed at once
    assert llm.stats()["compilations_after_warmup"] == 0
    llm.close()
