"""The evaluation's result: `EvalReport`, its JSON (stored in quantized checkpoints and read by the
quality gate) and its terminal table.

`EvalReport`'s docstring gives the JSON schema (format_version 1). See docs/architecture.md,
"Quantization".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

FORMAT_VERSION = 1


@dataclasses.dataclass
class EvalReport:
    """JSON schema (format_version 1; every float a plain number, None where not measured):

        {"format_version": 1,
         "candidate": {"label", "path", "dtype", "quantization" (QuantSpec JSON or null), "weights"},
         "reference": the same, or null when only the candidate's perplexity was measured,
         "text": {"source", "sha256", "chars", "tokens"},
         "ctx": 512, "first": 256, "bos": null or the BOS id put first in each chunk,
         "chunks": N, "scored_tokens": N * (ctx - 1 - first),
         "ppl": {"candidate", "reference"}, "nll": {"candidate", "reference"},
         "ln_ppl_ratio": mean nll(Q) - mean nll(R),
         "kl": {"mean", "median", "p90", "p99", "p999", "max"} (KL(R || Q) per scored token, nats),
         "top1_agreement": fraction of scored tokens where both argmaxes agree (llama.cpp's "same top p"),
         "top1_accuracy": {"candidate", "reference"}: argmax == the text's next token,
         "rms_delta_p": RMS of p_Q(next) - p_R(next),
         "greedy": {"source", "prompts", "max_tokens", "exact_match", "mean_prefix_fraction",
                    "prefix_fractions"} or null,
         "timings_s": {...}, "backend": "...", "jserve_version": "..."}
    """
    candidate: dict[str, Any]
    reference: dict[str, Any] | None
    text: dict[str, Any]
    ctx: int
    first: int
    bos: int | None
    chunks: int
    scored_tokens: int
    ppl: dict[str, float | None]
    nll: dict[str, float | None]
    top1_accuracy: dict[str, float | None]
    ln_ppl_ratio: float | None = None
    kl: dict[str, float] | None = None
    top1_agreement: float | None = None
    rms_delta_p: float | None = None
    greedy: dict[str, Any] | None = None
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    backend: str | None = None
    jserve_version: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, d: dict[str, Any] | str) -> "EvalReport":
        if isinstance(d, str):
            d = json.loads(d)
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"quality report format_version {version!r}; this jserve reads {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown quality report fields {sorted(unknown)}")
        return cls(**d)

    def table(self) -> str:
        """Q and R side by side."""
        q, r = self.candidate, self.reference
        rows: list[tuple[str, str, str]] = [
            ("model", q["label"], r["label"] if r else "-"),
            ("weights", q["weights"], r["weights"] if r else "-"),
            ("perplexity", _f(self.ppl["candidate"], 4), _f(self.ppl.get("reference"), 4)),
            ("mean NLL (nats)", _f(self.nll["candidate"], 5), _f(self.nll.get("reference"), 5)),
            ("top-1 accuracy", _pct(self.top1_accuracy["candidate"]), _pct(self.top1_accuracy.get("reference"))),
        ]
        if self.kl is not None:
            rows += [
                ("ln(PPL(Q)/PPL(R))", _f(self.ln_ppl_ratio, 6), ""),
                ("KL(R||Q) mean", _f(self.kl["mean"], 6), ""),
                ("KL median", _f(self.kl["median"], 6), ""),
                ("KL p99", _f(self.kl["p99"], 6), ""),
                ("KL p99.9", _f(self.kl["p999"], 6), ""),
                ("KL max", _f(self.kl["max"], 6), ""),
                ("top-1 agreement", _pct(self.top1_agreement), ""),
                ("RMS delta p", _pct(self.rms_delta_p), ""),
            ]
        if self.greedy is not None:
            g = self.greedy
            rows += [(f"greedy exact ({g['prompts']} prompts)", _pct(g["exact_match"]), ""),
                     ("greedy common prefix", _pct(g["mean_prefix_fraction"]), "")]
        w0 = max(len(a) for a, _, _ in rows)
        w1 = max(len("candidate (Q)"), *(len(b) for _, b, _ in rows))
        lines = [f"{'':<{w0}}  {'candidate (Q)':<{w1}}  reference (R)"]
        lines += [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
        t = self.text
        lines.append(f"text: {t['source']}, {t['tokens']} tokens, sha256 {t['sha256'][:12]}; ctx {self.ctx}, "
                     f"{self.chunks} chunks, {self.scored_tokens} scored tokens (the second half of each chunk)")
        if self.timings_s:
            lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings_s.items()))
        return "\n".join(lines)


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"
