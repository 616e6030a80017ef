"""Speculative decoding on the real default model: the golden cases unchanged with n-gram
speculation on, an input-copying request as fast in steps as speculation promises and identical
to plain decoding, through the offline API, the OpenAI server (with its /metrics) and the CLI."""

from __future__ import annotations

import json
import re

import pytest

from jserve import SamplingParams
from test_golden import _confident_prefix

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow.")
COPY = [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + PASSAGE}]


@pytest.fixture(scope="module")
def spec_llm(smollm2_checkpoint):
    from jserve import LLM

    return LLM(str(smollm2_checkpoint), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,
               speculative_config=SPEC)


def test_golden_cases_with_speculation(spec_llm, golden):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)
    outs = spec_llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]], params)
    for case, out in zip(golden["cases"], outs):
        n = _confident_prefix(case)
        assert out.outputs[0].token_ids[:n] == case["greedy_ids"][:n], case.get("prompt") or case["messages"]
    # one by one as well: a single stream is where the verify step runs (the batch of 8 may too)
    for case in golden["cases"][:3]:
        out = spec_llm.generate({"prompt_token_ids": case["prompt_ids"]}, params)[0]
        n = _confident_prefix(case)
        assert out.outputs[0].token_ids[:n] == case["greedy_ids"][:n]
    assert spec_llm.engine.stats()["compilations_after_warmup"] == 0


def test_copying_is_identical_and_takes_fewer_steps(spec_llm, smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = smollm2_llm.chat(COPY, params)[0].outputs[0]
    before = spec_llm.engine.stats()
    out = spec_llm.chat(COPY, params)[0].outputs[0]
    after = spec_llm.engine.stats()
    assert out.token_ids == plain.token_ids and out.text == plain.text
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    steps = after["num_steps"] - before["num_steps"]
    assert accepted / proposed > 0.7, (accepted, proposed)
    assert steps < len(out.token_ids) / 2, steps  # >= 2 tokens per step on a copying request
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=48)
    with_spec, without = (llm.chat(COPY, sampled)[0].outputs[0].token_ids for llm in (spec_llm, smollm2_llm))
    assert with_spec == without


def test_server_with_speculation_reports_it_in_metrics(spec_llm, smollm2_llm):
    from jserve.engine.async_engine import AsyncLLMEngine
    from jserve.server.app import ServerState
    from test_server import Server, request

    plain = smollm2_llm.chat(COPY, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    aengine = AsyncLLMEngine(spec_llm.engine)
    state = ServerState("smollm2")
    state.attach(aengine)
    srv = Server(state)
    try:
        status, _, body = request(srv, "POST", "/v1/chat/completions",
                                  {"model": "smollm2", "messages": COPY, "max_tokens": 40, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == plain
        status, _, text = request(srv, "GET", "/metrics")
        values = dict(re.findall(r"^(jserve_spec_\w+) ([0-9.e+-]+)$", text.decode(), re.M))
        assert float(values["jserve_spec_accepted_tokens"]) > 0
        assert 0 < float(values["jserve_spec_acceptance_rate"]) <= 1
        assert float(values["jserve_spec_mean_accepted_length"]) > 1
    finally:
        srv.close()
        assert aengine.shutdown(timeout=30)


def test_cli_generate_takes_a_speculative_config(smollm2_checkpoint, capsys):
    from jserve import cli

    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--chat", "--prompt", COPY[0]["content"],
                   "--max-tokens", "24", "--max-model-len", "256", "--temperature", "0", "--json",
                   "--speculative-config", json.dumps(SPEC)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("The quick brown fox")
    # The README's draft-model command: the default model's 4-bit GGUF weights draft for it.
    draft = {"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "gguf",
             "num_speculative_tokens": 3}
    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--prompt", "The capital of France is",
                   "--max-tokens", "12", "--max-model-len", "256", "--json", "--speculative-config", json.dumps(draft)])
    assert rc == 0 and "Paris" in json.loads(capsys.readouterr().out)["text"]
    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--prompt", "x", "--max-model-len", "256",
                   "--speculative-config", '{"method": "ngram", "k": 3}'])
    assert rc == 2 and "unknown speculative_config key 'k'" in capsys.readouterr().err


def test_readme_python_example_works_as_written(spec_llm):
    """The README's speculative-decoding Python block, run as written (its `LLM(...)` is this module's)."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "speculative_config" in b)
    printed = []
    code = block.replace("from jserve import LLM,", "from jserve import")
    exec(compile(code, "README.md", "exec"), {"print": printed.append, "LLM": lambda *a, **k: spec_llm,
                                              "__name__": "x"})
    assert printed[0].startswith("Sphinx of black quartz, judge my vow.")
    assert printed[1] > 0.5
