"""benchmarks.step.decode: each variant's step compiles and runs with the runner's own call (its
arguments as `Runner.device_step` passes them), on the default model (the benchmark loads a
checkpoint with its tokenizer)."""

from __future__ import annotations

import json


def test_variants_run_and_report_against_the_floor(tmp_path):
    from benchmarks.step import decode

    out = tmp_path / "decode.json"
    decode.main(["--batch", "1", "2", "--context", "8", "--variants", "native", "native/unfused", "--runs", "2",
                 "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert sorted((r["batch"], r["variant"]) for r in results) == [
        (1, "native"), (1, "native/unfused"), (2, "native"), (2, "native/unfused")]
    assert all(r["median_ms"] > 0 and r["floor_ms"] > 0 and r["tokens_per_s"] > 0 for r in results)
