"""The quality gate: a quantized model is served only after a measured evaluation passes.

A quantized checkpoint (`jserve convert --quantize`) stores the report of `jserve eval` against
its float source in generation.json's `quantization.report`; a float checkpoint quantized at load
(`LLM(quantization=...)`) finds it in `quality/<label>.json`, written by `jserve eval --save`.
`check` logs the report's summary and refuses a model with no report, or one beyond the
thresholds (mean KL from the float model, top-1 agreement), unless the gate is "warn" or "off".
The defaults per scheme come from docs/performance.md's "Quantization quality"; a GGUF's own
weights are checked against the same file read as floats (the kernels, not the quantization).
See docs/architecture.md, "Quantization".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

logger = logging.getLogger(__name__)

# scheme -> (largest mean KL, smallest top-1 agreement)
DEFAULT_THRESHOLDS: dict[str, tuple[float, float]] = {
    "int8": (0.01, 0.95),
    "fp8": (0.05, 0.85),
    "int4": (0.10, 0.85),
}


class QualityGateError(ValueError):
    """A quantized model the gate refuses (no report, or a report beyond the thresholds)."""


@dataclasses.dataclass(frozen=True)
class GateResult:
    passed: bool
    message: str
    max_kl: float
    min_top1: float


def thresholds(scheme: str, max_kl: float | None = None, min_top1: float | None = None) -> tuple[float, float]:
    """The gate's (max mean KL, min top-1 agreement) for a scheme, with the user's overrides."""
    kl, top1 = DEFAULT_THRESHOLDS.get(scheme, DEFAULT_THRESHOLDS["int4"])
    return (kl if max_kl is None else float(max_kl)), (top1 if min_top1 is None else float(min_top1))


def summary(report: Mapping[str, Any]) -> str:
    """One line of a report (`jserve.eval.EvalReport`'s JSON): KL, top-1 agreement, perplexities,
    greedy agreement, the text."""
    kl = report["kl"]
    parts = [f"KL mean {kl['mean']:.5f} (median {kl['median']:.5f}, p99 {kl['p99']:.4f}, max {kl['max']:.3f})",
             f"top-1 agreement {report['top1_agreement']:.4f}",
             f"ppl {report['ppl']['candidate']:.3f} vs {report['ppl']['reference']:.3f}"]
    greedy = report.get("greedy")
    if greedy:
        parts.append(f"greedy identical on {greedy['exact_match']:.0%} of {greedy['prompts']} prompts")
    text = report.get("text") or {}
    parts.append(f"{report.get('scored_tokens', '?')} scored tokens of {text.get('source', '?')}")
    return ", ".join(parts)


def evaluate(quantization: Mapping[str, Any], max_kl: float | None = None,
             min_top1: float | None = None) -> GateResult:
    """Whether a quantization record (generation.json's `quantization`) passes the thresholds."""
    label = quantization["label"]
    scheme = quantization["scheme"]
    kl_max, top1_min = thresholds(scheme, max_kl, min_top1)
    report = quantization.get("report")
    if not report:
        return GateResult(False, f"quantization {label!r} has no quality report", kl_max, top1_min)
    if report.get("kl") is None or report.get("top1_agreement") is None:
        return GateResult(False, f"quantization {label!r} has a quality report without a reference model "
                                 f"(no KL divergence to check)", kl_max, top1_min)
    kl, top1 = float(report["kl"]["mean"]), float(report["top1_agreement"])
    failures = []
    if not kl <= kl_max:
        failures.append(f"mean KL {kl:.5f} > {kl_max:g}")
    if not top1 >= top1_min:
        failures.append(f"top-1 agreement {top1:.4f} < {top1_min:g}")
    what = f"quantization {label!r}: {summary(report)}"
    if failures:
        return GateResult(False, f"{what}; beyond the gate: {', '.join(failures)}", kl_max, top1_min)
    return GateResult(True, f"{what}; passes the gate (mean KL <= {kl_max:g}, top-1 >= {top1_min:g})",
                      kl_max, top1_min)


def check(quantization: Mapping[str, Any] | None, *, gate: str = "enforce", max_kl: float | None = None,
          min_top1: float | None = None, how_to_evaluate: str = "") -> GateResult | None:
    """Log the report of a quantized model and apply the gate; None for a float model.

    Raises QualityGateError when `gate` is "enforce" and the report is missing or fails; "warn"
    logs a warning and serves; "off" logs the report (if any) and serves.
    """
    if quantization is None:
        return None
    result = evaluate(quantization, max_kl, min_top1)
    if result.passed:
        logger.info("%s", result.message)
        return result
    hint = f" {how_to_evaluate.rstrip('.')}." if how_to_evaluate else ""
    if gate == "enforce":
        raise QualityGateError(f"refusing to serve: {result.message}.{hint} To serve it anyway pass "
                               f"quality_gate='warn' (--quality-gate warn) or set the thresholds "
                               f"(--quality-max-kl, --quality-min-top1)")
    if gate == "warn":
        logger.warning("serving despite the quality gate: %s.%s", result.message, hint)
    else:
        logger.info("quality gate off: %s", result.message)
    return result
