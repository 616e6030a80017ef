"""`evaluate`: a candidate model Q against a reference R on one text, as llama.cpp's
`llama-perplexity --kl-divergence` measures it, plus greedy agreement on fixed prompts."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from jserve.eval import greedy as greedy_mod
from jserve.eval.chunks import chunk_tokens
from jserve.eval.metrics import summarize, token_stats
from jserve.eval.models import EvalModel
from jserve.eval.report import EvalReport
from jserve.eval.scoring import ScoringModel, iter_logits
from jserve.eval.text import EvalText, default_text

DEFAULT_CTX = 512  # llama-perplexity's default -c
DEFAULT_BATCH = 4  # chunks per forward: [4, 255, 49152] float32 logits are 200 MB per model


def text_tokens(model: EvalModel, text: EvalText) -> tuple[list[int], int | None]:
    """The text's tokens with the model's tokenizer (BOS first where it adds one), and that BOS id
    (None where the tokenizer adds none), as llama.cpp's `common_tokenize(ctx, text, true)`."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.label} has no tokenizer: give the text's token ids")
    return tok.encode(text.text), (tok.bos_token_id if tok.add_bos else None)


def evaluate(candidate: EvalModel, reference: EvalModel | None = None, *, text: EvalText | None = None,
             tokens: Sequence[int] | None = None, bos: int | None = None, ctx: int = DEFAULT_CTX,
             max_chunks: int | None = None, batch_size: int = DEFAULT_BATCH, backend: Any = None,
             greedy: bool = True, log: Callable[[str], None] | None = None) -> EvalReport:
    """Score `candidate` (and `reference`) on `text` (default: the pydoc prose) or on given
    `tokens` (then `bos` is the id llama.cpp would put first in each chunk, or None).

    Without a reference only the candidate's perplexity (and top-1 accuracy) is measured.
    `backend`: the backend name both run on (None: the platform's, as the engine picks).
    """
    log = log or (lambda msg: None)
    timings: dict[str, float] = {}
    models = [candidate] + ([reference] if reference is not None else [])
    vocab = {m.config.vocab_size for m in models}
    if len(vocab) != 1:
        raise ValueError(f"the models' vocabularies differ ({sorted(vocab)}): KL needs the same one")
    if tokens is None:
        text = text or default_text()
        tokens, bos = text_tokens(candidate, text)
        if reference is not None and reference.tokenizer is not None:
            ref_tokens, _ = text_tokens(reference, text)
            if ref_tokens != tokens:
                raise ValueError("the two models' tokenizers tokenize the text differently")
        text_info = {**text.describe(), "tokens": len(tokens)}
    else:
        tokens = [int(t) for t in tokens]
        text_info = {**(text.describe() if text else {"source": "token ids", "sha256": "", "chars": 0}),
                     "tokens": len(tokens)}
    chunks = chunk_tokens(tokens, ctx, bos=bos, max_chunks=max_chunks)
    log(f"{len(tokens)} tokens -> {chunks.num_chunks} chunks of {ctx}, scoring {chunks.num_scored} "
        f"tokens each")

    t0 = time.perf_counter()
    scorers = [ScoringModel(m.config, m.params, backend, m.label) for m in models]
    timings["prepare"] = time.perf_counter() - t0
    backend_name = scorers[0].backend.name
    parts: list[dict[str, np.ndarray]] = []
    t0 = time.perf_counter()
    streams = [iter_logits(s, chunks, batch_size) for s in scorers]
    for batches in zip(*streams):
        start = batches[0][0]
        logits = [b[1].reshape(-1, b[1].shape[-1]) for b in batches]
        n = batches[0][1].shape[0]
        targets = chunks.targets[start:start + n].reshape(-1)
        parts.append(token_stats(logits[0], targets, logits[1] if len(logits) > 1 else None))
        done = start + n
        log(f"chunks {done}/{chunks.num_chunks} ({time.perf_counter() - t0:.0f} s)")
    timings["score"] = time.perf_counter() - t0
    del scorers, streams
    stats = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    summary = summarize(stats, chunks.targets.reshape(-1))

    greedy_result = None
    if greedy and reference is not None:
        t0 = time.perf_counter()
        source, prompts, max_tokens = greedy_mod.prompts_for(reference)
        log(f"greedy generation: {len(prompts)} prompts x {max_tokens} tokens ({source})")
        outs = [greedy_mod.generate_greedy(m, prompts, max_tokens, backend) for m in (candidate, reference)]
        greedy_result = {"source": source, "max_tokens": max_tokens, **greedy_mod.agreement(*outs)}
        timings["greedy"] = time.perf_counter() - t0

    from jserve import __version__

    has_r = reference is not None
    return EvalReport(
        candidate=candidate.describe(), reference=reference.describe() if has_r else None, text=text_info,
        ctx=ctx, first=chunks.first, bos=bos, chunks=chunks.num_chunks, scored_tokens=summary["scored_tokens"],
        ppl={"candidate": summary["ppl_q"], "reference": summary.get("ppl_r")},
        nll={"candidate": summary["nll_q"], "reference": summary.get("nll_r")},
        top1_accuracy={"candidate": summary["top1_accuracy_q"], "reference": summary.get("top1_accuracy_r")},
        ln_ppl_ratio=summary.get("ln_ppl_ratio"), kl=summary.get("kl"), top1_agreement=summary.get("top1_agreement"),
        rms_delta_p=summary.get("rms_delta_p"), greedy=greedy_result, timings_s=timings,
        backend=backend_name, jserve_version=__version__)
