"""Scoring token sequences on the serving path (`LLM.token_logprobs`) against the same model's plain
forward pass (`jserve.eval.serving_vs_forward`): the tiny llama3 checkpoint on both backends and
the real default model in float32, chunked prefill included; a reference shifted by one position
or on other weights fails the tolerance. Prefix-cache hits drop no logprob, other requests are
undisturbed, every page comes back, bad ids are named."""

from __future__ import annotations

import numpy as np
import pytest

from jserve.core.request import SamplingParams
from jserve.engine.scoring import scoring_params
from jserve.eval.serving_vs_forward import compare, forward_logprobs, serving_vs_forward
from jserve.model.checkpoint import load_checkpoint
from test_update_weights import SETTINGS as WARM_SETTINGS
from test_update_weights import checkpoints  # noqa: F401 - the fixture

# No test here checks compilation: each LLM compiles only the shapes it runs, not every bucket.
SETTINGS = {**WARM_SETTINGS, "warmup": False}

TOL = 1e-4  # float32: the serving path's kernels and the dense forward differ by rounding only (~2e-6)
LENGTHS = (1, 2, 9, 40, 63)  # 40 and 63 run as several prefill chunks (max_num_batched_tokens 32)


def _sequences(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _wrong_references(config, params, perturbed, seqs, served):
    """The reference shifted by one position, and on other weights: both must fail TOL."""
    ref = forward_logprobs(config, params, seqs)
    shifted = [r.__class__(r.token_ids, np.concatenate([r.logprobs[1:], r.logprobs[:1]])) for r in ref]
    other = forward_logprobs(config, perturbed, seqs)
    return compare(served, shifted)["max_abs_diff"], compare(served, other)["max_abs_diff"]


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_serving_logprobs_match_the_plain_forward(checkpoints, backend):  # noqa: F811
    from jserve import LLM

    base, _, perturbed = checkpoints
    llm = LLM(str(base), backend=backend, **SETTINGS)
    _, params, _ = load_checkpoint(base, dtype="float32")
    seqs = _sequences(llm.config.vocab_size)
    report = serving_vs_forward(llm, params, seqs)
    assert report["tokens"] == sum(n - 1 for n in LENGTHS)
    assert report["max_abs_diff"] < TOL, report
    assert report["max_abs_diff_top"] < TOL and report["mean_kl_top"] < 1e-8, report
    assert report["top1_agreement"] == 1.0
    served = llm.token_logprobs(seqs, top_k=3)
    assert [s.logprobs.shape for s in served] == [(n - 1,) for n in LENGTHS]
    assert all(s.logprobs.dtype == np.float32 and s.top_ids.shape == (n - 1, 3) for s, n in zip(served, LENGTHS))
    assert all(np.all(np.diff(s.top_logprobs, axis=1) <= 0) for s in served)
    shifted, other = _wrong_references(llm.config, params, perturbed, seqs, served)
    assert shifted > 100 * TOL and other > 100 * TOL, (shifted, other)
    stats = llm.stats()
    assert stats["pages_in_use"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    llm.close()


def test_prefix_cache_hits_drop_no_logprob_and_others_run_undisturbed(checkpoints):  # noqa: F811
    from jserve import LLM

    llm = LLM(str(checkpoints[0]), enable_prefix_caching=True, **SETTINGS)
    seqs = _sequences(llm.config.vocab_size, (40, 17))
    alone = [llm.token_logprobs([s])[0].logprobs for s in seqs]
    # The sequences' prefixes are cached by plain requests first: scoring still computes every position.
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": s[:33]} for s in seqs], greedy)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([{"prompt_token_ids": s[:33]} for s in seqs], greedy)
    assert llm.stats()["prefix_cache_hit_tokens"] > hits  # the cache does hit for plain requests
    again = [s.logprobs for s in llm.token_logprobs(seqs)]
    assert [a.shape for a in again] == [(39,), (16,)]
    for a, b in zip(again, alone):
        np.testing.assert_allclose(a, b, atol=TOL)
    # A generation running beside scoring requests gives the tokens it gives alone.
    engine = llm.engine
    want = llm.generate([{"prompt_token_ids": seqs[1]}], greedy)[0].outputs[0].token_ids
    engine.add_request("gen", seqs[1], greedy)
    for i, s in enumerate(seqs):
        engine.add_request(f"score-{i}", s, scoring_params(2))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["gen"].outputs[0].token_ids == want
    assert len(outs["score-0"].prompt_logprobs) == 40
    stats = llm.stats()
    assert stats["pages_in_use"] == 0
    llm.close()


def test_bad_ids_are_named(checkpoints):  # noqa: F811
    from jserve import LLM

    llm = LLM(str(checkpoints[0]), **SETTINGS)
    vocab = llm.config.vocab_size
    cases = {"[[1, 2], [3, %d]]" % vocab: [[1, 2], [3, vocab]], "[[-1]]": [[-1]], "[[1, 2.5]]": [[1, 2.5]],
             "[[]]": [[]], "[]": [], "[5]": [5], "'ab'": "ab", "[[0] * 64]": [[0] * 64]}
    messages = {}
    for name, ids in cases.items():
        with pytest.raises(ValueError) as err:
            llm.token_logprobs(ids)
        messages[name] = str(err.value)
    assert messages["[[1, 2], [3, %d]]" % vocab] == f"token_ids[1][1] = {vocab} is outside the vocabulary [0, {vocab})"
    assert "token_ids[0][0] = -1" in messages["[[-1]]"] and "token_ids[0][1]" in messages["[[1, 2.5]]"]
    assert "token_ids[0] is empty" in messages["[[]]"] and "non-empty" in messages["[]"]
    assert "token_ids[0] must be a sequence" in messages["[5]"] and "64 tokens" in messages["[[0] * 64]"]
    with pytest.raises(ValueError, match="top_k must be an integer in"):
        llm.token_logprobs([[1, 2]], top_k=21)
    assert llm.stats()["num_waiting"] == llm.stats()["num_running"] == 0
    llm.close()


def test_the_default_model_matches_its_plain_forward(smollm2_llm):
    """float32; 300 tokens run as three prefill chunks (max_num_batched_tokens 128)."""
    llm = smollm2_llm
    _, params, _ = load_checkpoint(llm.path, dtype=llm.dtype)
    text = ("The quick brown fox jumps over the lazy dog. " * 3 + "Paris is the capital of France; "
            "Berlin is the capital of Germany. ") * 12
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 300
    seqs = [ids[:300], ids[:37]]
    report = serving_vs_forward(llm, params, seqs)
    print(report)
    assert report["tokens"] == 299 + 36
    assert report["max_abs_diff"] < 1e-3 and report["mean_kl_top"] < 1e-6, report
    served = llm.token_logprobs(seqs)
    shifted, other = _wrong_references(llm.config, params, {k: v * 1.01 for k, v in params.items()}, seqs, served)
    assert shifted > 0.1 and other > 10 * 1e-3, (shifted, other)
    assert llm.stats()["pages_in_use"] == 0


def test_eval_cli_reports_serving_vs_forward(checkpoints, tmp_path, capsys):  # noqa: F811
    import json

    from jserve.cli import main

    text = tmp_path / "text.txt"
    text.write_text("0123 4567 89 3141 5926 " * 12)  # digits and spaces: ids inside the tiny vocabulary
    out = tmp_path / "report.json"
    assert main(["eval", "--model", str(checkpoints[0]), "--serving-vs-forward", "--text", str(text), "--ctx", "48",
                 "--max-chunks", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["serving_vs_forward"]
    assert report["sequences"] == 2 and report["tokens"] == 2 * 47 and report["max_abs_diff"] < TOL, report
    assert "max_abs_diff" in capsys.readouterr().out
    assert main(["eval", "--model", str(checkpoints[0]), "--serving-vs-forward", "--quantization", "int8"]) == 2
    assert "no --reference, --quantization or --save" in capsys.readouterr().err
