"""`jserve eval` (jserve/eval/): llama-perplexity's chunking and statistics, the evaluation text,
and the measurement end to end on a tiny random model (itself: KL 0; a perturbed copy: KL > 0,
its perplexity equal to a direct forward's)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import DATA
from jserve.eval import greedy as greedy_mod
from jserve.eval.chunks import chunk_tokens
from jserve.eval.evaluate import evaluate, evaluate_many
from jserve.eval.metrics import kl_summary, log_softmax64, percentile, summarize, token_stats
from jserve.eval.models import EvalModel, quantized
from jserve.eval.report import EvalReport
from jserve.eval.text import DEFAULT_MAX_CHARS, MIN_WORDS, default_text, load_text, pydoc_prose, write_text
from jserve.model import DenseAttention, XlaOps, init_cache, model_graphdef, model_params
from jserve.model.checkpoint import read_params

# ------------------------------------------------------------------------------- statistics


def test_token_stats_match_a_direct_computation():
    rng = np.random.default_rng(0)
    N, V = 300, 50  # more rows than one block
    lq, lr = rng.normal(size=(N, V)) * 3, rng.normal(size=(N, V)) * 3
    t = rng.integers(0, V, N)
    s = token_stats(lq.astype(np.float32), t, lr.astype(np.float32))
    q = np.exp(lq.astype(np.float32).astype(np.float64))
    q /= q.sum(-1, keepdims=True)
    r = np.exp(lr.astype(np.float32).astype(np.float64))
    r /= r.sum(-1, keepdims=True)
    rows = np.arange(N)
    np.testing.assert_allclose(s["nll_q"], -np.log(q[rows, t]), rtol=1e-12)
    np.testing.assert_allclose(s["nll_r"], -np.log(r[rows, t]), rtol=1e-12)
    np.testing.assert_allclose(s["kl"], np.sum(r * np.log(r / q), -1), rtol=1e-10)
    np.testing.assert_array_equal(s["top_q"], lq.argmax(-1))
    np.testing.assert_allclose(s["p_q"] - s["p_r"], q[rows, t] - r[rows, t], atol=1e-14)
    summary = summarize(s, t)
    assert summary["ppl_q"] == pytest.approx(np.exp(np.mean(-np.log(q[rows, t]))), rel=1e-12)
    assert summary["top1_agreement"] == pytest.approx(np.mean(lq.argmax(-1) == lr.argmax(-1)))
    assert summary["ln_ppl_ratio"] == pytest.approx(np.log(summary["ppl_q"] / summary["ppl_r"]), rel=1e-9)


def test_kl_closed_forms():
    # identical distributions (any shift of the logits): 0
    logits = np.random.default_rng(1).normal(size=(7, 11)).astype(np.float32)
    same = token_stats(logits, np.zeros(7, int), logits + 5.0)
    np.testing.assert_allclose(same["kl"], 0.0, atol=1e-12)
    # two-point distributions: a log(a/b) + (1-a) log((1-a)/(1-b))
    a, b = 0.8, 0.3
    s = token_stats(np.log([[b, 1 - b]]), np.array([0]), np.log([[a, 1 - a]]))
    assert s["kl"][0] == pytest.approx(a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b)), rel=1e-9)
    # R uniform over V: KL(U || Q) = -log V - mean_v log q(v); the uniform model's perplexity is V
    V = 16
    lq = np.random.default_rng(2).normal(size=(1, V))
    s = token_stats(lq, np.array([3]), np.zeros((1, V)))
    assert s["kl"][0] == pytest.approx(-np.log(V) - log_softmax64(lq).mean(), rel=1e-9)
    assert np.exp(s["nll_r"][0]) == pytest.approx(V)
    # a reference entry with probability 0 (masked logit) contributes nothing
    s = token_stats(np.log([[0.5, 0.25, 0.25]]), np.array([0]), np.array([[0.0, 0.0, -np.inf]]))
    assert s["kl"][0] == pytest.approx(0.5 * np.log(0.5 / 0.5) + 0.5 * np.log(0.5 / 0.25))


def test_percentiles_are_llama_cpps():
    v = np.random.default_rng(3).exponential(size=1001)
    for f in (0.9, 0.99, 0.999):
        assert percentile(v, f) == pytest.approx(np.percentile(v, 100 * f))  # linear, at f * (n - 1)
    s = kl_summary(np.array([4.0, 1.0, 3.0, 2.0]))
    assert s["median"] == 2.5 and s["max"] == 4.0 and s["mean"] == 2.5
    assert s["p99"] == pytest.approx(3 + 0.99 * 3 - 2)  # between the two largest: 3.97


# ------------------------------------------------------------------------------- chunks


def test_chunks_follow_llama_perplexity():
    tokens = np.arange(1000, 1000 + 8 * 5 + 3)  # 5 whole chunks of 8 and a dropped tail of 3
    c = chunk_tokens(tokens, 8)
    assert c.num_chunks == 5 and c.first == 4 and c.num_scored == 3
    np.testing.assert_array_equal(c.tokens, tokens[:40].reshape(5, 8))
    np.testing.assert_array_equal(c.logit_positions, [4, 5, 6])  # first .. ctx-2
    # the logit at position p is scored against the token at p + 1: positions 5..7 of each chunk
    np.testing.assert_array_equal(c.targets, tokens[:40].reshape(5, 8)[:, 5:])
    np.testing.assert_array_equal(c.targets, c.tokens[:, c.logit_positions + 1])
    with_bos = chunk_tokens(tokens, 8, bos=1, max_chunks=2)
    assert with_bos.num_chunks == 2
    np.testing.assert_array_equal(with_bos.tokens[:, 0], [1, 1])
    np.testing.assert_array_equal(with_bos.tokens[:, 1:], tokens[:16].reshape(2, 8)[:, 1:])
    np.testing.assert_array_equal(with_bos.targets, c.targets[:2])
    with pytest.raises(ValueError, match="at least 2 \\* ctx"):
        chunk_tokens(tokens[:15], 8)
    with pytest.raises(ValueError, match="even"):
        chunk_tokens(tokens, 7)


# ------------------------------------------------------------------------------- the text


def test_default_text_is_deterministic_english_prose(tmp_path):
    a, b = default_text(), default_text()
    assert a.text == b.text and a.sha256 == b.sha256
    assert DEFAULT_MAX_CHARS <= len(a.text) < DEFAULT_MAX_CHARS + 5000
    paragraphs = a.text.strip().split("\n\n")
    assert len(paragraphs) > 300
    assert all(len(p.split()) >= MIN_WORDS and "\n" not in p and p == p.strip() for p in paragraphs)
    assert "*****" not in a.text and "::=" not in a.text.replace('"::="', "")
    assert pydoc_prose(None).startswith(a.text.rstrip("\n"))  # a prefix of all the prose
    path = tmp_path / "text.txt"
    write_text(path, a)
    assert load_text(path).text == a.text and load_text(path).sha256 == a.sha256
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="UTF-8"):
        load_text(tmp_path / "bad.txt")


@pytest.mark.slow
def test_default_text_has_30k_tokens_with_the_default_tokenizer(smollm2_checkpoint):
    from jserve.text.tokenizer import Tokenizer

    tokens = Tokenizer.load(smollm2_checkpoint).encode(default_text().text)
    assert len(tokens) >= 30_000


# ------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(smollm2_checkpoint):
    from jserve.text.tokenizer import Tokenizer

    config, params = read_params(DATA / "arch" / "smollm2")  # vocab 256; the engine's detokenizer needs a tokenizer
    return EvalModel(config, {k: jnp.asarray(v) for k, v in params.items()}, Tokenizer.load(smollm2_checkpoint),
                     label="tiny")


def _perturbed(model: EvalModel, scale: float = 0.05) -> EvalModel:
    rng = np.random.default_rng(7)
    w = np.asarray(model.params["w_up"])
    params = {**model.params, "w_up": jnp.asarray(w + scale * rng.standard_normal(w.shape).astype(w.dtype))}
    return EvalModel(model.config, params, label="perturbed")


def _direct_nll(model: EvalModel, chunks) -> np.ndarray:
    """The next-token NLL at the scored positions from one plain-XLA forward per chunk."""
    config = model.config
    graphdef, state = model_graphdef(config), model_params(config, model.params)

    @jax.jit
    def log_probs(state, row):
        T = row.shape[0]
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        cache = init_cache(config.num_layers, 1, config.num_kv_heads, T, config.head_dim)
        logits, _ = nnx.merge(graphdef, state)(row[None], pos, cache, pos, XlaOps(DenseAttention()))
        return jax.nn.log_softmax(logits[0])

    out = []
    for row, target in zip(chunks.tokens, chunks.targets):
        lp = np.asarray(log_probs(state, jnp.asarray(row)))
        out.append(-lp[chunks.logit_positions, target])
    return np.concatenate(out)


TOKENS = [int(t) for t in np.random.default_rng(5).integers(3, 256, 16 * 7 + 5)]


def test_a_model_against_itself_and_a_perturbed_copy(tiny):
    same = evaluate(tiny, tiny, tokens=TOKENS, ctx=16, batch_size=4, greedy=False)
    assert same.chunks == 7 and same.scored_tokens == 7 * 7
    assert same.kl["max"] == 0.0 and same.top1_agreement == 1.0 and same.rms_delta_p == 0.0
    assert same.ppl["candidate"] == same.ppl["reference"] and same.ln_ppl_ratio == 0.0
    other = _perturbed(tiny)
    diff = evaluate(other, tiny, tokens=TOKENS, ctx=16, batch_size=4, greedy=False, max_chunks=6)
    assert diff.chunks == 6 and diff.kl["mean"] > 1e-4 and diff.kl["max"] >= diff.kl["p99"] >= diff.kl["median"] > 0
    assert diff.ppl["reference"] != diff.ppl["candidate"]
    chunks = chunk_tokens(TOKENS, 16, max_chunks=6)
    for model, key in ((other, "candidate"), (tiny, "reference")):
        assert diff.ppl[key] == pytest.approx(np.exp(_direct_nll(model, chunks).mean()), rel=2e-5)
    # BOS in each chunk's first slot changes the scored tokens' context, hence the perplexity
    bos = evaluate(tiny, None, tokens=TOKENS, bos=1, ctx=16, greedy=False, max_chunks=6)
    assert bos.bos == 1 and bos.kl is None and bos.ppl["reference"] is None
    assert bos.ppl["candidate"] != pytest.approx(diff.ppl["reference"], rel=1e-6)
    # several candidates against one reference, R run once: the same numbers as one at a time
    both = evaluate_many([tiny, other], tiny, tokens=TOKENS, ctx=16, batch_size=4, greedy=False, max_chunks=6)
    assert both[0].kl["max"] == 0.0 and both[1].kl == pytest.approx(diff.kl, rel=1e-9)
    assert both[1].ppl == pytest.approx(diff.ppl, rel=1e-9)
    # the report round-trips through its JSON
    again = EvalReport.from_json(json.loads(json.dumps(diff.to_json())))
    assert again == diff
    assert "KL(R||Q) mean" in diff.table() and "perturbed" in diff.table()
    with pytest.raises(ValueError, match="format_version"):
        EvalReport.from_json({**diff.to_json(), "format_version": 99})


def test_greedy_agreement(tiny):
    prompts = [[5, 17, 99], [200, 3], [42] * 6]
    a = greedy_mod.generate_greedy(tiny, prompts, 6, backend="cpu")
    assert [len(x) for x in a] == [6, 6, 6]
    assert greedy_mod.agreement(a, greedy_mod.generate_greedy(tiny, prompts, 6, backend="cpu"))["exact_match"] == 1.0
    g = greedy_mod.agreement([[1, 2, 3, 4], [1, 2]], [[1, 2, 9, 4], [1, 2]])
    assert g["exact_match"] == 0.5 and g["prefix_fractions"] == [0.5, 1.0] and g["mean_prefix_fraction"] == 0.75


def test_quantized_at_load_is_close_but_not_equal(tiny):
    quant = pytest.importorskip("jserve.model.quant")
    if not hasattr(quant, "quantize_params"):
        pytest.skip("jserve.model.quant.quantize_params is not there yet")
    q = quantized(tiny, quant.QuantSpec.parse("int8"))
    report = evaluate(q, tiny, tokens=TOKENS, ctx=16, greedy=False)
    assert report.candidate["quantization"]["scheme"] == "int8" and "int8" in report.candidate["weights"]
    assert 0 < report.kl["mean"] < 0.05


def test_cli_json_on_a_tiny_checkpoint(tmp_path, smollm2_checkpoint):
    from jserve.cli import main
    from jserve.model.checkpoint import save_params
    from jserve.model.config import ModelConfig
    from jserve.model.llama import param_shapes

    out = tmp_path / "tiny-smollm2"
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    params = {k: (np.ones(s) if k.endswith("norm") else rng.standard_normal(s) * 0.1).astype(np.float32)
              for k, s in param_shapes(config).items()}
    save_params(out / "params", params)
    (out / "config.json").write_text(config.to_json())
    for name in ("tokenizer.json", "jserve_tokenizer.json", "generation.json"):
        shutil.copy(smollm2_checkpoint / name, out / name)
    text = tmp_path / "text.txt"
    assert main(["eval", "--write-text", str(text)]) == 0
    assert text.read_text(encoding="utf-8") == default_text().text
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["eval", "--model", str(out), "--reference", str(out), "--text", str(text), "--ctx", "32",
                   "--max-chunks", "3", "--no-greedy", "--json"])
    assert rc == 0
    report = EvalReport.from_json(stdout.getvalue())
    assert report.chunks == 3 and report.scored_tokens == 3 * 15 and report.ctx == 32
    assert report.kl["max"] == 0.0 and report.top1_agreement == 1.0
    assert report.text["sha256"] == default_text().sha256 and report.text["tokens"] > 30_000
    assert report.ppl["candidate"] == report.ppl["reference"] > 1
    # --quantization: Q is the model quantized at load, R the model; --save stores the gate's report
    from jserve.model.quant import QuantSpec
    from jserve.model.quant_record import quality_report_path

    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["eval", "--model", str(out), "--quantization", "int8", "--text", str(text), "--ctx", "32",
                   "--max-chunks", "2", "--no-greedy", "--save"])
    assert rc == 0
    saved = EvalReport.from_json(quality_report_path(out, QuantSpec.parse("int8").label()).read_text())
    assert saved.candidate["quantization"]["scheme"] == "int8" and saved.reference["quantization"] is None
    assert saved.kl["mean"] > 0 and saved.chunks == 2


def test_compare_quality_parses_llama_perplexitys_summary():
    """benchmarks.quality.llamacpp reads llama-perplexity's logs (its printf formats, perplexity.cpp)."""
    from benchmarks.quality import llamacpp as mod

    base = ("perplexity: calculating perplexity over 69 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
            "[1]12.3456,[2]13.0000,\nFinal estimate: PPL = 14.2733 +/- 0.31234\n")
    assert mod.parse_llama_perplexity(base, kl=False) == {"chunks": 69, "ctx": 512, "ppl": 14.2733,
                                                          "ppl_err": 0.31234}
    kl = "\n".join([
        "kl_divergence: computing over 69 chunks, n_ctx=512, batch_size=2048, n_seq=4",
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS",
        "   1      12.3456 ±    0.1234       0.00123 ±    0.00045       0.00345 ±    0.00012     1.234 ±  0.1 %",
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   :  14.352012 ±   0.311111",
        "Mean PPL(base)                :  14.273301 ±   0.312340",
        "Cor(ln(PPL(Q)), ln(PPL(base))):  99.91%",
        "Mean ln(PPL(Q)/PPL(base))     :   0.005499 ±   0.000512",
        "====== KL divergence statistics ======",
        "Mean    KLD:   0.002690 ±   0.000050",
        "Maximum KLD:   0.018000",
        "99.9%   KLD:   0.015000",
        "99.0%   KLD:   0.010600",
        "95.0%   KLD:   0.007000",
        "90.0%   KLD:   0.005000",
        "Median  KLD:   0.002290",
        "10.0%   KLD:   0.000500",
        "====== Token probability statistics ======",
        "Mean    Δp: -0.012 ± 0.010 %",
        "RMS Δp    :  1.220 ± 0.020 %",
        "Same top p: 97.550 ± 0.100 %",
    ])
    got = mod.parse_llama_perplexity(kl, kl=True)
    assert got == {"chunks": 69, "ctx": 512, "ppl": 14.352012, "ppl_base": 14.273301, "ln_ppl_ratio": 0.005499,
                   "kl_mean": 0.00269, "kl_max": 0.018, "kl_p999": 0.015, "kl_p99": 0.0106, "kl_p90": 0.005,
                   "kl_median": 0.00229, "rms_delta_p": pytest.approx(0.0122), "same_top": pytest.approx(0.9755)}
    with pytest.raises(RuntimeError, match="kl_mean"):
        mod.parse_llama_perplexity(kl.replace("Mean    KLD", "Mean KL"), kl=True)
