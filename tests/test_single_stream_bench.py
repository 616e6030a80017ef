"""benchmarks.step.single_stream: the per-step breakdown of a batch-1 decode adds up (on a tiny
model with dummy weights), with single steps and with multi-step decode."""

from __future__ import annotations

import json
from pathlib import Path

ARCH = Path(__file__).parent / "data" / "arch"


def test_breakdown_parts_add_up_to_the_step(tmp_path):
    from benchmarks.step import single_stream

    model = str(ARCH / "llama3")
    out = tmp_path / "single.json"
    spec = f'{model}@load_format="dummy",dtype="float32"'
    assert single_stream.main(["--models", f"{spec};{spec},num_scheduler_steps=4", "--max-tokens", "12",
                               "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == [spec, f"{spec},num_scheduler_steps=4"]
    single, multi = rows
    for row in rows:
        assert row["tok/s"] > 0 and row["step ms"] > 0 and row["floor ms"] > 0
        assert row["forward alone ms"] > 0 and row["sample alone ms"] > 0
    # A single step: the forward and the sampler are timed inside it, the rest is what is left.
    parts = sum(single[f"{p} ms"] for p in single_stream.PARTS)
    assert 0 < single["forward ms"] and 0 < single["sample ms"] and parts <= single["timed step ms"] + 0.02
    assert abs(parts + single["rest ms"] - single["timed step ms"]) < 0.05
    # Four tokens a call: no separate forward or sampler call, the step counted per token.
    assert multi["forward ms"] == 0 and multi["sample ms"] == 0
