"""Quantization quality side by side: jserve eval next to llama.cpp's own `llama-perplexity`, one run.

    python -m benchmarks.quality.llamacpp --out compare_quality.json            # the whole text
    python -m benchmarks.quality.llamacpp --max-chunks 24 --variants int8,int8-g32,int4  # bounded

On the default model (SmolLM2-135M-Instruct), all on the identical text file (`jserve eval
--write-text`: the pydoc_data/topics.py prose) and context (`--ctx`, default 512):

llama.cpp (built by benchmarks.serving.compare.ensure_llama_cpp: llama-perplexity and llama-quantize)
  F32   the shipped GGUF requantized to F32 (benchmarks.serving.compare.ensure_f32_gguf), run with
        `--kl-divergence-base FILE` (its perplexity, and the base log-probabilities)
  Q8_0  `llama-quantize F32 -> Q8_0`, run with `--kl-divergence-base FILE --kl-divergence`
  Q4_1  the shipped GGUF as it is, likewise
jserve (jserve.eval.evaluate_many, the reference run once)
  R = the float32 checkpoint; candidates `--variants` (default bfloat16,int8,int4): bfloat16
  weights, int8 per channel, int4 g32 asymmetric (Q4_1's layout), quantized at load with
  jserve.model.quant.quantize_params.

The table: perplexity, ln(PPL(Q)/PPL(R)), KL(R||Q) mean / median / p99 / max, top-1 agreement
(llama.cpp's "same top p"), RMS Δp, and for jserve greedy agreement on the golden prompts. The
JSON (`--out`) holds every row, the commands, the llama.cpp logs' summaries and the timings.

The two tokenizations are checked against each other: llama.cpp's token ids are read back from
its base file and compared with jserve's (the row `tokens equal`). llama.cpp's KL differs from
jserve's in its rounding only (jserve/eval/metrics.py): 16-bit base log-probabilities, entries
below p = 1.1e-7 dropped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import parser
from benchmarks.serving import compare as cs


def log(msg: str) -> None:
    print(f"[quality] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ llama.cpp

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
# The summary lines `kl_divergence` prints (tools/perplexity/perplexity.cpp), anchored at line starts.
_KL_PATTERNS = {
    "ppl": rf"^Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_base": rf"^Mean PPL\(base\)\s*:\s*{_NUM}",
    "ln_ppl_ratio": rf"^Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*{_NUM}",
    "kl_mean": rf"^Mean\s+KLD:\s*{_NUM}",
    "kl_max": rf"^Maximum KLD:\s*{_NUM}",
    "kl_p999": rf"^99\.9%\s+KLD:\s*{_NUM}",
    "kl_p99": rf"^99\.0%\s+KLD:\s*{_NUM}",
    "kl_p90": rf"^90\.0%\s+KLD:\s*{_NUM}",
    "kl_median": rf"^Median\s+KLD:\s*{_NUM}",
    "rms_delta_p_pct": rf"^RMS Δp\s*:\s*{_NUM}",
    "same_top_pct": rf"^Same top p:\s*{_NUM}",
}


def parse_llama_perplexity(output: str, kl: bool) -> dict:
    """The numbers of a llama-perplexity run's log (a base run's final PPL, or the KL summary)."""
    found: dict = {}
    m = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", output) or re.search(
        r"computing over (\d+) chunks, n_ctx=(\d+)", output)
    if m:
        found["chunks"], found["ctx"] = int(m.group(1)), int(m.group(2))
    if not kl:
        m = re.search(rf"Final estimate: PPL = {_NUM} \+/- {_NUM}", output)
        if not m:
            raise RuntimeError("no 'Final estimate: PPL = ...' in llama-perplexity's output:\n" + output[-3000:])
        found["ppl"], found["ppl_err"] = float(m.group(1)), float(m.group(2))
        return found
    for key, pattern in _KL_PATTERNS.items():
        m = re.search(pattern, output, re.M)
        if not m:
            raise RuntimeError(f"no {key} ({pattern}) in llama-perplexity's output:\n" + output[-3000:])
        found[key] = float(m.group(1))
    found["rms_delta_p"] = found.pop("rms_delta_p_pct") / 100
    found["same_top"] = found.pop("same_top_pct") / 100
    return found


def read_base_tokens(path: Path) -> tuple[int, int, np.ndarray]:
    """(n_ctx, n_vocab, tokens [n_chunk * n_ctx]) from a `--kl-divergence-base` file's header."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        tokens = np.frombuffer(f.read(4 * int(n_ctx) * int(n_chunk)), dtype=np.int32)
    return int(n_ctx), int(n_vocab), tokens


def run_llama_perplexity(cmd: list[str]) -> tuple[str, float]:
    log(" ".join(cmd))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    output = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}:\n{output[-3000:]}")
    return output, wall


def llama_cpp_rows(args, text_path: Path) -> tuple[list[dict], np.ndarray]:
    bindir = cs.ensure_llama_cpp(args.cache_dir)
    shipped = cs.default_gguf()
    f32 = cs.ensure_f32_gguf(args.cache_dir, bindir, shipped)
    q8 = cs.ensure_q8_gguf(args.cache_dir, bindir, shipped)  # llama-quantize F32 -> Q8_0
    exe = str(bindir / "llama-perplexity")
    common = ["-c", str(args.ctx), "-t", str(args.threads), "-tb", str(args.threads)]
    base = args.cache_dir / f"kld-base-ctx{args.ctx}-{args.max_chunks or 'all'}.bin"
    cmd = [exe, "-m", str(f32), "-f", str(text_path), "--kl-divergence-base", str(base), *common]
    if args.max_chunks:
        cmd += ["--chunks", str(args.max_chunks)]
    out, wall = run_llama_perplexity(cmd)
    found = parse_llama_perplexity(out, kl=False)
    rows = [{"system": "llama.cpp", "model": "F32 (R)", "file": f32.name, **found, "wall_s": wall,
             "command": " ".join(cmd), "log_tail": out[-1500:]}]
    _, _, tokens = read_base_tokens(base)
    for label, gguf in (("Q8_0", q8), ("Q4_1 (shipped)", shipped)):
        cmd = [exe, "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence", *common]
        out, wall = run_llama_perplexity(cmd)
        found = parse_llama_perplexity(out, kl=True)
        rows.append({"system": "llama.cpp", "model": label, "file": gguf.name, **found, "wall_s": wall,
                     "command": " ".join(cmd), "log_tail": out[out.find("====== Perplexity statistics"):][:4000]})
    if not args.keep_base:
        base.unlink()  # 16-bit log-probabilities: 2 bytes x 49k x 255 scored tokens = 25 MB per chunk
    return rows, tokens


# ------------------------------------------------------------------------------------ jserve


def jserve_rows(args, text) -> tuple[list[dict], list[int]]:
    from jserve.eval.evaluate import evaluate_many, text_tokens
    from jserve.eval.models import load_model, quantized
    from jserve.model.quant import QuantSpec

    reference = load_model(None, label="jserve float32 (R)")
    candidates = []
    for v in args.variants:
        if v == "bfloat16":
            candidates.append(load_model(None, dtype="bfloat16", label="jserve bfloat16"))
        elif v == "float32":
            candidates.append(load_model(None, label="jserve float32"))
        else:  # "int8", "int4", "fp8", or with a group size: "int8-g32"
            scheme, _, group = v.partition("-g")
            spec = QuantSpec.parse(scheme, int(group) if group else (32 if scheme == "int4" else None))
            candidates.append(quantized(reference, spec, label=f"jserve {spec.label()}"))
    tokens, _ = text_tokens(reference, text)
    reports = evaluate_many(candidates, reference, text=text, ctx=args.ctx, max_chunks=args.max_chunks,
                            batch_size=args.batch_size, greedy=not args.no_greedy, log=log)
    rows = [{"system": "jserve", "model": "float32 (R)", "ppl": reports[0].ppl["reference"],
             "chunks": reports[0].chunks, "ctx": reports[0].ctx,
             "top1_accuracy": reports[0].top1_accuracy["reference"]}]
    for r in reports:
        rows.append({"system": "jserve", "model": r.candidate["label"].removeprefix("jserve "),
                     "weights": r.candidate["weights"], "chunks": r.chunks, "ctx": r.ctx, "ppl": r.ppl["candidate"],
                     "ppl_base": r.ppl["reference"], "ln_ppl_ratio": r.ln_ppl_ratio,
                     **{f"kl_{k}": v for k, v in r.kl.items()}, "same_top": r.top1_agreement,
                     "rms_delta_p": r.rms_delta_p, "greedy": r.greedy, "report": r.to_json()})
    rows[0]["wall_s"] = reports[0].timings_s.get("score")
    return rows, tokens


# ------------------------------------------------------------------------------------ table


def table(rows: list[dict]) -> str:
    head = ["system", "model", "PPL", "ln(Q/R)", "KL mean", "KL median", "KL p99", "KL max", "same top",
            "RMS dp", "greedy ="]

    def f(x, d):
        return "" if x is None else f"{x:.{d}f}"

    lines = []
    for r in rows:
        g = r.get("greedy")
        lines.append([r["system"], r["model"], f(r.get("ppl"), 4), f(r.get("ln_ppl_ratio"), 5),
                      f(r.get("kl_mean"), 5), f(r.get("kl_median"), 5), f(r.get("kl_p99"), 4),
                      f(r.get("kl_max"), 3), f(100 * r["same_top"], 2) + " %" if r.get("same_top") is not None else "",
                      f(100 * r["rms_delta_p"], 2) + " %" if r.get("rms_delta_p") is not None else "",
                      f"{g['exact_match'] * g['prompts']:.0f}/{g['prompts']}" if g else ""])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("JSERVE_BENCH_CACHE", Path.home() / ".cache" / "jserve-bench")))
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-chunks", type=int, default=None, help="score only the first N chunks (both systems)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's -t and -tb")
    p.add_argument("--batch-size", type=int, default=4, help="jserve: chunks per forward pass")
    p.add_argument("--variants", default="bfloat16,int8,int4",
                   type=lambda s: [v for v in s.split(",") if v],
                   help="jserve candidates against jserve float32: bfloat16, float32, int8, int4, fp8, "
                   "or a scheme with a group size (int8-g32, int4-g64)")
    p.add_argument("--no-greedy", action="store_true", help="skip jserve's greedy agreement")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-jserve", action="store_true")
    p.add_argument("--keep-base", action="store_true", help="keep llama.cpp's base log-probability file")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)

    from jserve.eval.text import write_text

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    text_path = args.cache_dir / "eval_text.txt"
    text = write_text(text_path)
    log(f"text: {text_path} ({text.source}, sha256 {text.sha256[:16]})")
    result: dict = {"text": {**text.describe(), "path": str(text_path)}, "ctx": args.ctx,
                    "max_chunks": args.max_chunks, "rows": [], "load_before": os.getloadavg()}
    llama_tokens = jserve_tokens = None
    if not args.skip_llama:
        rows, llama_tokens = llama_cpp_rows(args, text_path)
        result["rows"] += rows
    if not args.skip_jserve:
        rows, jserve_tokens = jserve_rows(args, text)
        result["rows"] += rows
    if llama_tokens is not None and jserve_tokens is not None:
        ours = np.asarray(jserve_tokens[:len(llama_tokens)], np.int32)
        same = len(ours) == len(llama_tokens) and bool(np.array_equal(ours, llama_tokens))
        result["tokens_equal"] = same
        result["tokens_compared"] = int(len(llama_tokens))
        if not same:
            n = min(len(ours), len(llama_tokens))
            result["first_token_mismatch"] = int(np.argmax(ours[:n] != llama_tokens[:n]))
    result["load_after"] = os.getloadavg()
    print(table(result["rows"]))
    if "tokens_equal" in result:
        print(f"tokens equal (llama.cpp's {result['tokens_compared']} evaluated ids vs jserve's): "
              f"{result['tokens_equal']}")
    print(f"text: {text.source}, sha256 {text.sha256[:16]}; ctx {args.ctx}; "
          f"chunks {args.max_chunks or 'all'}; load average {result['load_before'][0]:.1f} -> "
          f"{result['load_after'][0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
