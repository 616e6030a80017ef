"""The real default model (SmolLM2-135M-Instruct) under every schema of tests/structured_schemas.py,
through the offline API (`SamplingParams(structured_outputs=...)`): greedy and sampled, every
output that ends on its own validates with the `jsonschema` library, and every bounded schema's
output ends on its own within max_tokens; an unbounded one cut by max_tokens says "length"."""

from __future__ import annotations

import pytest

from jserve.core.request import SamplingParams, StructuredOutputsParams
from schema_validation import validate
from structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_schema_validates_on_the_real_model(smollm2_llm, temperature):
    conversations = [[{"role": "system", "content": "Reply with JSON only."},
                      {"role": "user", "content": case.prompt}] for case in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400 if case.bounded else 48,
                             structured_outputs=StructuredOutputsParams(json=case.schema))
              for i, case in enumerate(SCHEMAS)]
    outputs = smollm2_llm.chat(conversations, params)
    failures = []
    for case, out in zip(SCHEMAS, outputs):
        o = out.outputs[0]
        if o.finish_reason == "length":
            if case.bounded:
                failures.append((case.name, "ran to max_tokens", o.text[-80:]))
            continue
        assert o.finish_reason == "stop", (case.name, o.finish_reason)
        try:
            validate(case, o.text)
        except Exception as e:  # noqa: BLE001 - collected, reported together
            failures.append((case.name, repr(e)[:200], o.text[:200]))
    assert not failures, failures
    assert smollm2_llm.stats()["grammar_errors"] == 0


def test_readme_python_example_works_as_written(smollm2_llm):
    """The README's structured-outputs Python block, run as written (its `LLM()` is the session's)."""
    import re
    from pathlib import Path

    import jserve

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "StructuredOutputsParams" in b)
    printed = []
    namespace = {"print": printed.append}
    code = block.replace("from jserve import LLM,", "from jserve import")
    exec(compile(code, "README.md", "exec"), {**namespace, "LLM": lambda *a, **k: smollm2_llm, "__name__": "x"})
    import json

    assert json.loads(printed[0])["color"] in ("red", "green", "blue")
    assert jserve.StructuredOutputsParams is StructuredOutputsParams


def test_cli_generate_with_a_json_schema(smollm2_checkpoint, capsys):
    import json

    from jserve import cli

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--chat", "--prompt", "Name a city.",
                   "--max-tokens", "40", "--max-model-len", "256", "--json-schema", json.dumps(schema), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"city"}
    rc = cli.main(["generate", "--model", str(smollm2_checkpoint), "--prompt", "x", "--regex", "a(b",
                   "--max-model-len", "256"])
    assert rc == 2 and "unclosed group" in capsys.readouterr().err
