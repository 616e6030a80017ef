"""A quantized model's record and quality report, where the quality gate reads them.

A quantized checkpoint's generation.json carries `quantization`: its label, scheme (the gate's
thresholds are per scheme), spec, each quantized weight's format, bits per weight, the float
source it came from (None where the checkpoint holds no float reference: AWQ, GPTQ) and the
`jserve eval` report (`write_quality_report`). A float checkpoint quantized at load keeps the
report of each quantization it was evaluated at in `quality/<label>.json`
(`write_load_report` / `read_load_report`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from jserve.model import quant


def quantization_record(label: str, scheme: str, spec: Mapping[str, Any], params: Mapping[str, Any], *,
                        source: str | None) -> dict[str, Any]:
    """generation.json's `quantization`, with no report yet."""
    weights = {name: {"scheme": w.scheme, "group_size": w.group_size, "symmetric": w.symmetric}
               for name, w in params.items() if quant.is_quantized(w)}
    return {"label": label, "scheme": scheme, "spec": dict(spec), "weights": weights, "source": source,
            "bits_per_weight": round(8 * quant.param_bytes(params) / quant.param_count(params), 3),
            "report": None}


def prequantized_scheme(params: Mapping[str, Any]) -> str:
    """The gate's scheme for pre-quantized weights (GGUF, AWQ, GPTQ): int4 if any matmul is 4-bit,
    else int8."""
    return "int4" if any(quant.is_quantized(w) and w.scheme == "int4" for w in params.values()) else "int8"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.rename(path)


def write_quality_report(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Store a quality report (`jserve.eval`'s JSON) in a quantized checkpoint's generation.json."""
    gen_path = Path(path) / "generation.json"
    generation = json.loads(gen_path.read_text())
    if "quantization" not in generation:
        raise ValueError(f"{path} is not a quantized checkpoint")
    generation["quantization"]["report"] = dict(report)
    _write_json(gen_path, generation)


def quality_report_path(path: str | os.PathLike, label: str) -> Path:
    """Where a float checkpoint keeps the report of its quantization `label` at load
    (`LLM(quantization=...)`): `quality/<label>.json` beside its params."""
    return Path(path) / "quality" / (label.replace(" ", "_") + ".json")


def write_load_report(path: str | os.PathLike, label: str, report: Mapping[str, Any]) -> Path:
    out = quality_report_path(path, label)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(out, dict(report))
    return out


def read_load_report(path: str | os.PathLike, label: str) -> dict[str, Any] | None:
    out = quality_report_path(path, label)
    return json.loads(out.read_text()) if out.is_file() else None
