"""Per-token statistics from two models' logits, and their summaries, as llama.cpp reports them.

`token_stats` (nll, KL(R || Q), argmaxes, target probabilities per scored token, in float64) and
`summarize` (llama.cpp's `kl_divergence` statistics; its docstring says where llama.cpp's rounded
16-bit base log-probabilities make its values differ slightly). See docs/architecture.md,
"Quantization".
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_BLOCK = 256  # rows per float64 block: [256, 49152] float64 is 100 MB


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """Float64 log-softmax over the last axis."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_stats(logits_q: np.ndarray, targets: np.ndarray, logits_r: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-token statistics of logits [N, vocab] (Q's, and R's when given) for next tokens [N].

    Returns float64/int arrays [N]: nll_q, top_q, p_q, and with R: nll_r, top_r, p_r, kl.
    Computed in blocks of ROW_BLOCK rows, so memory stays bounded whatever N.

    Per scored token (`token_stats`), from float64 log-softmaxes of the full vocabulary:

    - nll: -log p(target) for each model (perplexity = exp(mean nll));
    - kl: KL(R || Q) = sum_v p_R(v) (log p_R(v) - log p_Q(v)), R the reference (llama.cpp's "base");
    - top: each model's argmax (the first index on ties, as llama.cpp's loop);
    - p: each model's probability of the target (llama.cpp's Δp = p_Q - p_R).
    """
    logits_q = np.asarray(logits_q)
    targets = np.asarray(targets, np.int64)
    N = logits_q.shape[0]
    if targets.shape != (N,):
        raise ValueError(f"targets {targets.shape} do not match logits {logits_q.shape}")
    keys = ["nll_q", "top_q", "p_q"] + (["nll_r", "top_r", "p_r", "kl"] if logits_r is not None else [])
    out = {k: np.empty(N, np.int64 if k.startswith("top") else np.float64) for k in keys}
    for s in range(0, N, ROW_BLOCK):
        e = min(N, s + ROW_BLOCK)
        t = targets[s:e]
        rows = np.arange(e - s)
        lq = log_softmax64(logits_q[s:e])
        out["nll_q"][s:e] = -lq[rows, t]
        out["p_q"][s:e] = np.exp(lq[rows, t])
        out["top_q"][s:e] = np.argmax(logits_q[s:e], axis=-1)
        if logits_r is not None:
            lr = log_softmax64(logits_r[s:e])
            out["nll_r"][s:e] = -lr[rows, t]
            out["p_r"][s:e] = np.exp(lr[rows, t])
            out["top_r"][s:e] = np.argmax(logits_r[s:e], axis=-1)
            pr = np.exp(lr)
            with np.errstate(invalid="ignore"):  # entries with p_R = 0 contribute 0 (0 * log 0 := 0)
                kl = np.sum(np.where(pr > 0, pr * (lr - lq), 0.0), axis=-1)
            out["kl"][s:e] = np.maximum(kl, 0.0)  # float rounding can give -1e-17 for equal rows
    return out


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation between sorted values at fraction * (n - 1)."""
    v = np.sort(np.asarray(values, np.float64))
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


def perplexity(nll: np.ndarray) -> float:
    return float(np.exp(np.mean(nll)))


def kl_summary(kl: np.ndarray) -> dict[str, float]:
    """Mean, median, p90, p99, p99.9 and max of per-token KL divergences (llama.cpp's statistics)."""
    kl = np.asarray(kl, np.float64)
    return {"mean": float(kl.mean()), "median": float(np.median(kl)), "p90": percentile(kl, 0.90),
            "p99": percentile(kl, 0.99), "p999": percentile(kl, 0.999), "max": float(kl.max())}


def summarize(stats: dict[str, np.ndarray], targets: np.ndarray) -> dict[str, Any]:
    """The report's numbers from `token_stats` over all scored tokens.

    Summaries (`summarize`) follow llama.cpp's `kl_divergence` (tools/perplexity/perplexity.cpp):
    mean, median (the mean of the two middle values for an even count), percentiles by linear
    interpolation between the sorted values at fraction * (n - 1), maximum; "same top p" is the
    fraction of tokens with equal argmaxes; RMS Δp; ln(PPL(Q) / PPL(R)) = mean nll_Q - mean nll_R.

    Where llama.cpp differs: it stores the base model's log-probabilities as 16-bit codes over
    [max - 16, max] (`--kl-divergence-base`), and its KL sums only the vocabulary entries whose base
    log-probability is above -16 (p > 1.1e-7), with the base log-probs so rounded; its base argmax
    (for "same top p") is taken over the rounded codes. Here everything is exact float64, so values
    agree with llama.cpp's to about the rounding of its codes (a step of 16 / 65535 in log-probability).
    """
    targets = np.asarray(targets)
    out: dict[str, Any] = {
        "scored_tokens": int(len(targets)),
        "ppl_q": perplexity(stats["nll_q"]),
        "nll_q": float(np.mean(stats["nll_q"])),
        "top1_accuracy_q": float(np.mean(stats["top_q"] == targets)),
    }
    if "kl" in stats:
        dp = stats["p_q"] - stats["p_r"]
        out.update({
            "ppl_r": perplexity(stats["nll_r"]),
            "nll_r": float(np.mean(stats["nll_r"])),
            "top1_accuracy_r": float(np.mean(stats["top_r"] == targets)),
            "ln_ppl_ratio": float(np.mean(stats["nll_q"]) - np.mean(stats["nll_r"])),
            "kl": kl_summary(stats["kl"]),
            "top1_agreement": float(np.mean(stats["top_q"] == stats["top_r"])),
            "rms_delta_p": float(np.sqrt(np.mean(dp * dp))),
        })
    return out
