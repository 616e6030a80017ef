"""`jserve eval`: the quality of a model (a quantized one) against a reference, as a table or JSON.

    jserve eval --model Q [--reference R] [--text FILE] [--ctx 512] [--max-chunks N] [--json]
    jserve eval --model R --quantization int4 [--group-size 32]     # Q is R quantized at load
    jserve eval --model M --dtype bfloat16 --reference M             # bfloat16 against the float32 checkpoint
    jserve eval --write-text PATH                                    # the default text, for llama-perplexity -f
    jserve eval --model M --serving-vs-forward [--max-chunks 4]      # the engine's token logprobs against the
                                                                     # model's plain forward (max-abs-diff, KL)

`--save` stores the report where the quality gate reads it: with `--quantization`, in the float
checkpoint's quality/<label>.json (for `LLM(quantization=...)`); for a quantized checkpoint, in its
generation.json (its reference defaults to the float source it was quantized from).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval", help="perplexity, KL divergence and greedy agreement against a reference (llama-perplexity's "
        "definitions)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the candidate Q: checkpoint, HF folder, .gguf or name "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--reference", default=None, help="the reference R (default: with --quantization, the "
                   "model itself unquantized; else none: perplexity only)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8"],
                   help="Q is the model quantized at load with this scheme")
    p.add_argument("--group-size", type=int, default=None, help="int4's group size (32, 64 or 128)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="Q's float dtype "
                   "(default: the checkpoint's)")
    p.add_argument("--reference-dtype", default=None, choices=["float32", "bfloat16"],
                   help="R's float dtype (default: the checkpoint's)")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the prose of the standard "
                   "library's pydoc_data/topics.py, see jserve/eval/text.py)")
    p.add_argument("--write-text", metavar="PATH", default=None,
                   help="write the evaluation text to PATH and exit (for llama-perplexity -f)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c; default 512)")
    p.add_argument("--max-chunks", type=int, default=None, help="score only the first N chunks "
                   "(llama-perplexity's --chunks)")
    p.add_argument("--batch-size", type=int, default=4, help="chunks per forward pass (memory: ~50 MB of "
                   "logits per chunk and model at a 49k vocabulary)")
    p.add_argument("--backend", "--attention-backend", dest="backend", default=None,
                   help="execution backend, as serve's --backend (default: the platform's)")
    p.add_argument("--serving-vs-forward", action="store_true", help="compare the serving path's token logprobs "
                   "(LLM.token_logprobs) with the model's plain dense forward on the text's first chunks "
                   "(--max-chunks, default 4): max-abs-diff and KL over the top 20 tokens")
    p.add_argument("--no-greedy", action="store_true", help="skip greedy agreement on the golden prompts")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    p.add_argument("--save", action="store_true", help="store the report where the quality gate reads it "
                   "(see above)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from jserve.eval.text import load_text, write_text

    text = load_text(args.text)
    if args.write_text:
        write_text(args.write_text, text)
        print(f"wrote {len(text.text)} characters ({text.source}, sha256 {text.sha256}) to {args.write_text}",
              file=sys.stderr)
        return 0
    if args.serving_vs_forward:
        return _serving_vs_forward(args, text.text)
    from jserve.eval.evaluate import evaluate
    from jserve.eval.models import load_model, parse_quantization, quantized
    from jserve.model.checkpoint import read_quantization

    def log(msg: str) -> None:
        print(f"[eval] {msg}", file=sys.stderr, flush=True)

    spec = parse_quantization(args.quantization, args.group_size)
    t0 = time.perf_counter()
    candidate = load_model(args.model, dtype=args.dtype)
    record = read_quantization(candidate.path) if candidate.path else None
    if args.reference is None and record is not None and spec is None and record.get("source"):
        args.reference = record["source"]  # a quantized checkpoint against its float source
        log(f"reference: {args.reference} (the checkpoint's float source)")
    if args.save and args.reference is None and spec is None:
        raise ValueError("--save needs a reference: --reference R, or --quantization (R is the model itself)")
    if args.save and spec is None and record is None:
        raise ValueError(f"--save: {candidate.path} is not a quantized checkpoint (and no --quantization given)")
    reference = None
    if args.reference is not None:
        reference = load_model(args.reference, dtype=args.reference_dtype, label=f"{Path(args.reference).name} (R)")
    elif spec is not None:
        reference = candidate if args.reference_dtype in (None, candidate.dtype) else load_model(
            args.model, dtype=args.reference_dtype)
        reference = _relabel(reference, f"{reference.label} {reference.dtype} (R)")
    if spec is not None:
        log(f"quantizing {candidate.label} ({spec.label()})")
        candidate = quantized(candidate, spec)
    load_s = time.perf_counter() - t0
    report = evaluate(candidate, reference, text=text, ctx=args.ctx, max_chunks=args.max_chunks,
                      batch_size=args.batch_size, backend=args.backend, greedy=not args.no_greedy, log=log)
    report.timings_s = {"load": load_s, **report.timings_s}
    if args.out:
        Path(args.out).write_text(report.dumps() + "\n")
    if args.save:
        _save(candidate.path, spec, report, log)
    print(report.dumps() if args.json else report.table())
    return 0


def _serving_vs_forward(args: argparse.Namespace, text: str) -> int:
    import json

    from jserve.eval import serving_vs_forward as svf

    if args.reference or args.quantization or args.save:
        raise ValueError("--serving-vs-forward compares one model with itself: no --reference, --quantization "
                         "or --save")
    report = svf.checkpoint_report(args.model, text, ctx=args.ctx, chunks=args.max_chunks or 4, dtype=args.dtype,
                                   backend=args.backend, log=lambda msg: print(f"[eval] {msg}", file=sys.stderr))
    dumped = json.dumps({"serving_vs_forward": report}, indent=2)
    if args.out:
        Path(args.out).write_text(dumped + "\n")
    print(dumped if args.json else svf.table(report))
    return 0


def _save(path, spec, report, log) -> None:
    from jserve.model.quant_record import write_load_report, write_quality_report

    if spec is not None:
        out = write_load_report(path, spec.label(), report.to_json())
        log(f"saved the report to {out}")
    else:
        write_quality_report(path, report.to_json())
        log(f"saved the report in {Path(path) / 'generation.json'}")


def _relabel(model, label):
    import dataclasses

    return dataclasses.replace(model, label=label)
