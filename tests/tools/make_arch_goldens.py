#!/usr/bin/env python3
"""Generate tiny Hugging Face reference checkpoints + golden outputs for jserve.

For every supported architecture this writes a TINY random-weight float32
model (hidden 64, 2 layers, vocab 256, intermediate 128, max positions 256)
to ``tests/data/arch/<name>/`` as ``config.json`` + ``model.safetensors``
(exactly what ``save_pretrained(..., safe_serialization=True)`` writes;
``generation_config.json`` is deleted because nothing reads it), plus
``reference.npz`` with:

* ``input_ids``  int32   [2, 24]       fixed random ids (numpy seed)
* ``logits``     float32 [2, 24, 256]  one forward pass, attention_mask all ones
* ``greedy_ids`` int32   [1, 8]        the 8 NEW tokens of
  ``model.generate(input_ids[:1, :10], max_new_tokens=8, do_sample=False)``
  with eos disabled (generation never stops early; the ids may contain the
  config's eos id, a serving engine must ignore eos to reproduce them)

All runs use ``attn_implementation="eager"`` and one CPU thread. Every
RMSNorm weight (incl. Qwen3 q_norm/k_norm) is drawn from U(0.5, 1.5) and
every bias from N(0, 0.2), so norm/bias bugs change the logits.

Cases: llama2, llama3, llama_bias, mistral, qwen2, qwen3, smollm2, gemma2,
gemma3, the mixtures of experts qwen3_moe, mixtral, qwen2_moe, and phi3,
phi3_longrope (see ``CASES`` below and tests/data/arch/README.md;
phi3_longrope's reference.npz adds ``logits_short`` [2, 12, 256], the first
12 tokens alone, and ``greedy_long_ids`` [1, 8], after a 16-token prompt). Self-checks run each time:
the saved folder reloads to bit-identical logits, the greedy ids equal a
no-cache argmax loop, logits std > 1e-2, biases/norms are not trivial,
llama3's rope scaling changes the logits versus an unscaled copy (with
head_dim 16, rope_theta 500000 and original_max_position_embeddings 64 the
8 rotary frequencies fall into all three llama3 bands: 1 unchanged
high-frequency, 1 smoothed, 6 divided by ``factor``; the script asserts
this), mistral's sliding_window 8 changes the logits versus
sliding_window None, and for Gemma: the sliding layers' window 8 changes the
logits at positions >= 8 only (vs a 4096 window), query_pre_attn_scalar
differs from head_dim and matters, Gemma 2's attention and final logit
soft-capping each change the logits, and Gemma 3's local rotary base and its
global layers' linear scaling each do. Gemma's RMSNorm scales by (1 + w), so
its norm weights are drawn from U(-0.5, 0.5) instead. Phi-3: the sliding window
8 changes the logits at positions >= 8 only; LongRoPE's long factors, short
factors and attention factor each change the logits, the first 12 tokens' logits
differ from the same positions' in the 24-token forward (short vs long factors),
and generate() is seen recomputing positions 0..12 when the sequence passes 12.

The test suite never needs torch; only this generator does. Set up its own
virtualenv (Python 3.11, CPU torch wheel that lies on the dev machine's disk;
install torch FIRST and pinned so pip never pulls a CUDA build)::

    cd /work/main   # repo root
    PYENV_VERSION=3.11.7 python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0
    .venv-ref/bin/pip install transformers safetensors numpy

Run (regenerates tests/data/arch/ in place; deterministic, byte-identical
across runs on the same torch/transformers versions)::

    .venv-ref/bin/python tests/tools/make_arch_goldens.py
    .venv-ref/bin/python tests/tools/make_arch_goldens.py --out /tmp/arch --only llama3 mistral

Generated with torch 2.13.0+cpu and transformers 5.24.0.

This script writes the folders and the README; the cases and how their models are built are in
arch_cases.py, the reference computations in arch_reference.py, the self-checks in arch_checks.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arch_cases  # noqa: E402, F401  (first: it sets Hugging Face's offline flags before transformers loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from arch_cases import (  # noqa: E402
    BATCH,
    CASES,
    DEFAULT_OUT,
    INPUT_SEED,
    LONG_PROMPT_LEN,
    LONGROPE_ORIG,
    NEW_TOKENS,
    PROMPT_LEN,
    SEQ,
    VOCAB,
    build,
)
from arch_checks import checks  # noqa: E402
from arch_reference import cached_loop, forward_logits, greedy, make_input_ids, rotary_positions, shorter_logits  # noqa: E402


def write_case(name: str, out_dir: Path) -> dict:
    model = build(name)
    ids = make_input_ids()
    logits = forward_logits(model, ids)
    greedy_ids = greedy(model, ids[:1, :PROMPT_LEN])
    notes = checks(name, model, ids, logits)

    d = out_dir / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    gc_path = d / "generation_config.json"
    if gc_path.exists():
        gc_path.unlink()
    extra = {}
    if name == "phi3_longrope":
        extra = dict(logits_short=shorter_logits(model, ids).astype(np.float32),
                     greedy_long_ids=greedy(model, ids[:1, :LONG_PROMPT_LEN]))
        seen = rotary_positions(model, ids[:1, :PROMPT_LEN])
        assert list(range(LONGROPE_ORIG + 1)) in seen, seen  # generate() recomputed at the crossing
        short_cache = cached_loop(model, ids[:1, :PROMPT_LEN])  # what keeping the cache would give
        notes.append(f"generate() recomputes positions 0..{LONGROPE_ORIG} when the sequence passes "
                     f"{LONGROPE_ORIG} tokens; keeping the short-rotated cache instead would give "
                     f"{short_cache[0].tolist()} (vs {greedy_ids[0].tolist()})")
    np.savez(d / "reference.npz", input_ids=ids, logits=logits.astype(np.float32),
             greedy_ids=greedy_ids, **extra)

    # Round trip: the saved folder must reproduce the logits exactly.
    model_cls = CASES[name][0]
    reloaded = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    re_logits = forward_logits(reloaded, ids)
    assert np.array_equal(re_logits, logits), (name, np.abs(re_logits - logits).max())
    assert np.array_equal(greedy(reloaded, ids[:1, :PROMPT_LEN]), greedy_ids), name
    for key, value in extra.items():
        if key == "logits_short":
            assert np.array_equal(shorter_logits(reloaded, ids), value), name

    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in d.iterdir())
    return dict(name=name, params=n_params, std=float(logits.std()),
                maxabs=float(np.abs(logits).max()), size_kb=size / 1024,
                greedy=greedy_ids[0].tolist(), notes=notes,
                eos=model.config.eos_token_id,
                files=sorted(f.name for f in d.iterdir()))


def write_readme(out_dir: Path, rows: list[dict]) -> None:
    lines = [
        "# Tiny architecture goldens",
        "",
        "Generated by `tests/tools/make_arch_goldens.py` with "
        f"torch {torch.__version__} and transformers {transformers.__version__} "
        "(float32, CPU, eager attention, 1 thread). Random weights, fixed seeds; "
        "every RMSNorm weight ~ U(0.5, 1.5) (Gemma's, which scale by 1 + w, ~ U(-0.5, 0.5)) "
        "and every bias ~ N(0, 0.2).",
        "",
        "Each folder holds `config.json` + `model.safetensors` exactly as "
        "`save_pretrained(..., safe_serialization=True)` writes them "
        "(`generation_config.json` deleted; tied models store no `lm_head.weight`) "
        "and `reference.npz`:",
        "",
        f"- `input_ids` int32 [{BATCH}, {SEQ}]: fixed ids, `numpy.random.default_rng({INPUT_SEED})`",
        f"- `logits` float32 [{BATCH}, {SEQ}, {VOCAB}]: one forward pass, attention_mask all ones",
        f"- `greedy_ids` int32 [1, {NEW_TOKENS}]: the {NEW_TOKENS} new tokens of "
        f"`generate(input_ids[:1, :{PROMPT_LEN}], max_new_tokens={NEW_TOKENS}, do_sample=False)` "
        "with eos disabled (ignore eos when reproducing them)",
        "",
        "Common config: hidden_size 64, 2 layers (gemma2 3, gemma3 4), vocab_size 256, intermediate_size 128, "
        "max_position_embeddings 256, initializer_range 0.1, rms_norm_eps 1e-6 unless noted.",
        "",
        "Transformers 5 writes rope settings as `rope_parameters` "
        "(`{\"rope_type\": ..., \"rope_theta\": ..., <scaling keys>}`); there is no "
        "top-level `rope_theta` or `rope_scaling` in these config.json files. "
        "Checkpoints written by transformers 4.x use top-level `rope_theta` and `rope_scaling`.",
        "",
        "| case | class | what it covers | params | logits std | max abs logit |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        cls, desc = CASES[r["name"]][0].__name__, CASES[r["name"]][4]
        lines.append(f"| `{r['name']}` | {cls} | {desc} | {r['params']:,} | "
                     f"{r['std']:.3f} | {r['maxabs']:.3f} |")
    eos_hits = [f"`{r['name']}` (eos {r['eos']})" for r in rows
                if r["eos"] is not None and r["eos"] in r["greedy"]]
    if eos_hits:
        lines += ["", "greedy_ids that contain the config's eos_token_id (a reproducer must not "
                  "stop at eos): " + ", ".join(eos_hits) + "."]
    lines += [
        "",
        "Checked by the generator on every run: the saved folder reloads to bit-identical logits; "
        "greedy ids equal a cache-free argmax loop; llama3's scaling changes logits vs an "
        "unscaled copy (rotary frequencies land in all three llama3 bands at head_dim 16 with "
        "original_max_position_embeddings 64); mistral's sliding window (key j visible to query "
        "i iff i-8 < j <= i) changes logits at positions >= 8 only; so does Gemma's on its "
        "sliding layers (vs a 4096 window); Gemma 2's attention and final soft-capping, "
        "query_pre_attn_scalar (vs head_dim), and Gemma 3's local rotary base and global "
        "linear scaling each change the logits. The MoE cases (qwen3_moe, mixtral, qwen2_moe): in every "
        "layer the 48 tokens use at least 7 of the 8 experts, no expert takes 60% of them, at least 8 "
        "distinct top-2 sets occur, the 2nd and 3rd router probabilities never come within 1e-5 (so "
        "rounding cannot flip a choice), and top-1 routing (and flipping norm_topk_prob, for the Qwens) "
        "changes the logits. phi3: its sliding window changes logits at positions >= 8 only. phi3_longrope "
        f"(LongRoPE, original_max_position_embeddings {LONGROPE_ORIG}): transformers rotates a sequence of "
        f"more than {LONGROPE_ORIG} tokens by the long factors at every position, so `logits` (24 tokens) are "
        f"long throughout; `reference.npz` adds `logits_short` [{BATCH}, {LONGROPE_ORIG}, {VOCAB}] (the first "
        f"{LONGROPE_ORIG} tokens alone: short factors) and `greedy_long_ids` [1, {NEW_TOKENS}] (after a "
        f"{LONG_PROMPT_LEN}-token prompt); `greedy_ids` cross over at {LONGROPE_ORIG} tokens, where generate() "
        "recomputes the cache with the long factors (the generator sees it do so), so they equal a cache-free "
        "loop's. The long factors, the short factors and the attention factor each change the logits.",
        "",
        "Another CPU may give float32 logits that differ in their last bits (up to ~1.5e-6 "
        "was seen for these folders, well inside the tests' 1e-4); a regeneration that only adds "
        "a case can keep the other folders as committed.",
        "",
        "Regenerate (from the repo root; venv setup is in the script's docstring):",
        "",
        "```sh",
        "PYENV_VERSION=3.11.7 python3 -m venv .venv-ref",
        ".venv-ref/bin/pip install torch==2.13.0",
        ".venv-ref/bin/pip install transformers safetensors numpy",
        ".venv-ref/bin/python tests/tools/make_arch_goldens.py",
        "```",
        "",
    ]
    (out_dir / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), default=None)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)

    names = args.only or list(CASES)
    rows = [write_case(n, args.out) for n in names]
    if not args.no_readme and args.only is None:
        write_readme(args.out, rows)

    print(f"torch {torch.__version__}, transformers {transformers.__version__} -> {args.out}")
    print(f"{'name':<11} {'params':>8} {'logits std':>10} {'max|logit|':>10} {'KB':>6}  greedy_ids")
    for r in rows:
        print(f"{r['name']:<11} {r['params']:>8,} {r['std']:>10.4f} {r['maxabs']:>10.4f} "
              f"{r['size_kb']:>6.0f}  {r['greedy']}")
        for n in r["notes"]:
            print(f"{'':<11} - {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
