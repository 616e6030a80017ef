"""`evaluate`: a candidate model Q against a reference R on one text, as llama.cpp's
`llama-perplexity --kl-divergence` measures it, plus greedy agreement on fixed prompts;
`evaluate_many`: several candidates against one reference, R run once."""

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


def evaluate(candidate: EvalModel, reference: EvalModel | None = None, **kwargs: Any) -> EvalReport:
    """Score `candidate` (and `reference`): see `evaluate_many`."""
    return evaluate_many([candidate], reference, **kwargs)[0]


def evaluate_many(candidates: Sequence[EvalModel], reference: EvalModel | None = None, *,
                  text: EvalText | None = None, tokens: Sequence[int] | None = None, bos: int | None = None,
                  ctx: int = DEFAULT_CTX, max_chunks: int | None = None, batch_size: int = DEFAULT_BATCH,
                  backend: Any = None, greedy: bool = True,
                  log: Callable[[str], None] | None = None) -> list[EvalReport]:
    """One report per candidate, each against `reference`, on `text` (default: the pydoc prose)
    or on given `tokens` (then `bos` is the id llama.cpp would put first in each chunk, or None).

    The models run batch by batch in lockstep (R once per batch), keeping only per-token
    statistics. Without a reference only the candidates' perplexities (and top-1 accuracies) are
    measured. `backend`: the backend name all run on (None: the platform's, as the engine picks).
    """
    log = log or (lambda msg: None)
    if not candidates:
        raise ValueError("evaluate_many needs at least one candidate")
    models = list(candidates) + ([reference] if reference is not None else [])
    vocab = {m.config.vocab_size for m in models}
    if len(vocab) != 1:
        raise ValueError(f"the models' vocabularies differ ({sorted(vocab)}): KL needs the same one")
    tokens, bos, text_info = _eval_tokens(models, text, tokens, bos)
    chunks = chunk_tokens(tokens, ctx, bos=bos, max_chunks=max_chunks)
    log(f"{len(tokens)} tokens -> {chunks.num_chunks} chunks of {ctx}, scoring {chunks.num_scored} tokens each, "
        f"{len(models)} models")
    summaries, backend_name, timings = _score(models, len(candidates), reference is not None, chunks,
                                              batch_size, backend, log)
    greedy_results: list[dict | None] = [None] * len(candidates)
    greedy_s = [0.0] * len(candidates)
    if greedy and reference is not None:
        greedy_results, greedy_s = _greedy(candidates, reference, backend, log)

    from jserve import __version__

    reports = []
    for i, (c, s) in enumerate(zip(candidates, summaries)):
        report_timings = {**timings, **({"greedy": greedy_s[i]} if greedy_results[i] is not None else {})}
        reports.append(EvalReport(
            candidate=c.describe(), reference=reference.describe() if reference is not None else None,
            text=text_info, ctx=ctx, first=chunks.first, bos=bos, chunks=chunks.num_chunks,
            scored_tokens=s["scored_tokens"],
            ppl={"candidate": s["ppl_q"], "reference": s.get("ppl_r")},
            nll={"candidate": s["nll_q"], "reference": s.get("nll_r")},
            top1_accuracy={"candidate": s["top1_accuracy_q"], "reference": s.get("top1_accuracy_r")},
            ln_ppl_ratio=s.get("ln_ppl_ratio"), kl=s.get("kl"), top1_agreement=s.get("top1_agreement"),
            rms_delta_p=s.get("rms_delta_p"), greedy=greedy_results[i], timings_s=report_timings,
            backend=backend_name, jserve_version=__version__))
    return reports


def _eval_tokens(models: list[EvalModel], text: EvalText | None, tokens: Sequence[int] | None,
                 bos: int | None) -> tuple[list[int], int | None, dict[str, Any]]:
    """(tokens, bos, the report's text description): the given tokens, or `text` (default: the
    pydoc prose) in the first model's tokenizer, which every other model's must match."""
    if tokens is None:
        text = text or default_text()
        tokens, bos = text_tokens(models[0], text)
        for m in models[1:]:
            if m.tokenizer is not None and m.tokenizer is not models[0].tokenizer and text_tokens(m, text)[0] != tokens:
                raise ValueError(f"{m.label} and {models[0].label} tokenize the text differently")
        return tokens, bos, {**text.describe(), "tokens": len(tokens)}
    tokens = [int(t) for t in tokens]
    return tokens, bos, {**(text.describe() if text else {"source": "token ids", "sha256": "", "chars": 0}),
                         "tokens": len(tokens)}


def _score(models: list[EvalModel], num_candidates: int, with_reference: bool, chunks: Any, batch_size: int,
           backend: Any, log: Callable[[str], None]) -> tuple[list[dict], str, dict[str, float]]:
    """Run every model over the chunks in lockstep (the reference last in `models`): each
    candidate's `summarize`d statistics, the backend's name and the prepare / score seconds."""
    t0 = time.perf_counter()
    scorers = [ScoringModel(m.config, m.params, backend, m.label) for m in models]
    prepare_s = time.perf_counter() - t0
    backend_name = scorers[0].backend.name
    parts: list[list[dict[str, np.ndarray]]] = [[] for _ in range(num_candidates)]
    t0 = time.perf_counter()
    for batches in zip(*(iter_logits(s, chunks, batch_size) for s in scorers)):
        start, first_logits = batches[0]
        n, vocab_size = first_logits.shape[0], first_logits.shape[-1]
        targets = chunks.targets[start:start + n].reshape(-1)
        ref = batches[-1][1].reshape(-1, vocab_size) if with_reference else None
        for i in range(num_candidates):
            parts[i].append(token_stats(batches[i][1].reshape(-1, vocab_size), targets, ref))
        log(f"chunks {start + n}/{chunks.num_chunks} ({time.perf_counter() - t0:.0f} s)")
    score_s = time.perf_counter() - t0
    del scorers
    all_targets = chunks.targets.reshape(-1)
    summaries = [summarize({k: np.concatenate([p[k] for p in ps]) for k in ps[0]}, all_targets) for ps in parts]
    return summaries, backend_name, {"prepare": prepare_s, "score": score_s}


def _greedy(candidates: Sequence[EvalModel], reference: EvalModel, backend: Any,
            log: Callable[[str], None]) -> tuple[list[dict | None], list[float]]:
    """Each candidate's greedy agreement with `reference` on the fixed prompts, and its seconds
    (the reference's generation included)."""
    source, prompts, max_tokens = greedy_mod.prompts_for(reference)
    log(f"greedy generation: {len(prompts)} prompts x {max_tokens} tokens ({source})")
    t0 = time.perf_counter()
    ref_out = greedy_mod.generate_greedy(reference, prompts, max_tokens, backend)
    ref_s = time.perf_counter() - t0
    results: list[dict | None] = []
    seconds = []
    for c in candidates:
        t0 = time.perf_counter()
        out = greedy_mod.generate_greedy(c, prompts, max_tokens, backend)
        results.append({"source": source, "max_tokens": max_tokens, **greedy_mod.agreement(out, ref_out)})
        seconds.append(ref_s + time.perf_counter() - t0)
    return results, seconds
