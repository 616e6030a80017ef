"""Embeddings (`--task embed`): the pooled step against transformers, chunked prompts, pages.

The reference is transformers' own forward pass over the tiny random models of tests/data/arch
(reference.npz: `logits` [2, 24, 256] of `input_ids`). Their head is [hidden 64 -> vocab 256] of
full column rank, so the final hidden states transformers computed (after the final norm: what
`AutoModel`'s `last_hidden_state` and sentence-transformers pool) are the least-squares solution
of logits = hidden @ head, to float32 precision; each pooling of them is the expected embedding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.engine import EngineConfig, build_engine
from jserve.engine.embed_engine import EmbedEngine, PoolingParams, resolve_pooling
from jserve.model.pooling import PoolingConfig, read_sentence_transformers
from jserve.runtime import backends


def _reference_hidden(arch: str, params) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids [2, 24], transformers' final hidden states [2, 24, hidden]) of the arch golden."""
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    head = np.asarray(params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T, np.float64)
    logits = ref["logits"].astype(np.float64)  # [2, 24, vocab]
    flat = logits.reshape(-1, logits.shape[-1])
    hidden, *_ = np.linalg.lstsq(head.T, flat.T, rcond=None)
    return ref["input_ids"], hidden.T.reshape(*logits.shape[:2], -1)


def _expected(hidden: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    v = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
    return v / np.linalg.norm(v) if normalize else v


def _engine(config, params, *, backend="reference", **kw) -> EmbedEngine:
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64,
                    backend=backends.create(backend), task="embed", enable_prefix_caching=False)
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**settings, **kw}))
    assert isinstance(engine, EmbedEngine)
    return engine


def _embed(engine, prompts, dimensions=None) -> list[np.ndarray]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), [int(t) for t in p], PoolingParams(dimensions))
    outs = finish(engine)
    return [outs[str(i)].embedding for i in range(len(prompts))]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_pooling_matches_transformers(arch, pooling):
    """Each pooling of the model's final hidden states, normalised, as transformers computes them;
    prompts of 24 tokens with 16 tokens a step, so each spans two chunks (and shares steps)."""
    config, params = load_arch(arch)
    ids, hidden = _reference_hidden(arch, params)
    engine = _engine(config, params, pooling=pooling)
    free = engine.page_table.pool.num_free_pages
    got = _embed(engine, ids)
    for g, h in zip(got, hidden):
        np.testing.assert_allclose(g, _expected(h, pooling), atol=2e-4)
        assert abs(np.linalg.norm(g) - 1) < 1e-5
    assert engine.page_table.pool.num_free_pages == free  # every page given back
    assert engine.stats()["compilations_after_warmup"] == 0


def test_unnormalised_mean_and_short_prompts_on_native():
    """Without normalisation the vector is the mean itself; prompts of 1 .. 24 tokens batched
    together on the native backend (its own kernels) each equal their own prefix's pooling."""
    config, params = load_arch("llama3")
    ids, hidden = _reference_hidden("llama3", params)
    engine = _engine(config, params, backend="native", pooling="mean", pooling_normalize="false")
    lengths = [1, 5, 24, 9]
    got = _embed(engine, [ids[0][:n] for n in lengths])
    # transformers' hidden state at position p depends only on tokens <= p (causal)
    for g, n in zip(got, lengths):
        np.testing.assert_allclose(g, hidden[0][:n].mean(axis=0), atol=5e-4)
    assert engine.stats()["compilations_after_warmup"] == 0


def test_dimensions_and_aborts():
    config, params = load_arch("qwen3")
    engine = _engine(config, params, pooling="last")
    with pytest.raises(ValueError, match="Matryoshka"):
        engine.add_request("x", [1, 2, 3], PoolingParams(8))
    engine.pooling = PoolingConfig("last", True, ())
    ids, hidden = _reference_hidden("qwen3", params)
    (v,) = _embed(engine, [ids[0]], dimensions=8)
    want = hidden[0][-1][:8]
    np.testing.assert_allclose(v, want / np.linalg.norm(want), atol=2e-4)
    with pytest.raises(ValueError, match="dimensions=65"):
        engine.add_request("y", [1], PoolingParams(65))
    free = engine.page_table.pool.num_free_pages
    engine.add_request("a", list(ids[1]), PoolingParams())
    engine.step()  # its first chunk: it holds pages now
    assert engine.page_table.pool.num_free_pages < free
    out = engine.abort_request("a")
    assert out.finished and out.embedding is None
    assert engine.page_table.pool.num_free_pages == free and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("z", [config.vocab_size], PoolingParams())


def test_task_resolution(tmp_path):
    base = EngineConfig()
    assert resolve_pooling(base, None) is None  # auto, nothing declared: generation
    declared = PoolingConfig("mean", False, (32, 64))
    assert resolve_pooling(base, declared) == declared
    assert resolve_pooling(EngineConfig(task="generate"), declared) is None
    assert resolve_pooling(EngineConfig(task="embed"), None) == PoolingConfig()
    assert resolve_pooling(EngineConfig(task="embed", pooling="cls", pooling_normalize="true"),
                           declared) == PoolingConfig("cls", True, (32, 64))
    with pytest.raises(ValueError, match="applies to task 'embed'"):
        resolve_pooling(EngineConfig(task="generate", pooling="mean"), None)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        resolve_pooling(EngineConfig(task="embed", num_scheduler_steps=4), None)
    with pytest.raises(ValueError, match="task must be one of"):
        EngineConfig(task="score")
    # a sentence-transformers folder, as Qwen3-Embedding ships one
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_lasttoken": True}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert read_sentence_transformers(tmp_path) == PoolingConfig("last", True, None)
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    assert read_sentence_transformers(tmp_path).matryoshka == (32, 64)
    assert read_sentence_transformers(tmp_path / "1_Pooling") is None


def _st_folder(folder, pooling_key: str):
    """tests/data/arch/qwen3 as a sentence-transformers embedding model: weights saved from the bare
    decoder (no `model.` prefix, as Qwen3-Embedding's), modules.json with Pooling and Normalize."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jserve.model.checkpoint import resolve_model

    src = DATA / "arch" / "qwen3"
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    tensors = load_file(src / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, folder / "model.safetensors")
    shutil.copy(resolve_model(None) / "tokenizer.json", folder / "tokenizer.json")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({pooling_key: True}))
    return folder


def test_llm_embed_from_a_sentence_transformers_folder(tmp_path):
    """`convert` records the folder's pooling in generation.json; `LLM` (task auto) then serves
    embeddings (mean here, from 1_Pooling) and refuses generation, and the reverse."""
    from jserve import LLM
    from jserve.core.request import SamplingParams
    from jserve.model.checkpoint import convert

    out = convert(_st_folder(tmp_path / "st", "pooling_mode_mean_tokens"), tmp_path / "ckpt", progress=False)
    assert json.loads((out / "generation.json").read_text())["pooling"] == {
        "pooling": "mean", "normalize": True, "matryoshka": None}
    config, params = load_arch("qwen3")
    ids, hidden = _reference_hidden("qwen3", params)
    settings = dict(backend="xla-reference", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                    compilation_cache=False)
    llm = LLM(str(out), **settings)
    try:
        outs = llm.embed([{"prompt_token_ids": list(map(int, p))} for p in ids])
        for o, h in zip(outs, hidden):
            np.testing.assert_allclose(o.embedding, _expected(h, "mean"), atol=2e-4)
        with pytest.raises(ValueError, match="task 'embed', not 'generate'"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=1))
        assert llm.stats()["pages_in_use"] == 0
    finally:
        llm.close()
    llm = LLM(str(out), task="generate", **settings)
    try:
        with pytest.raises(ValueError, match="task 'generate', not 'embed'"):
            llm.embed([[1, 2]])
    finally:
        llm.close()
