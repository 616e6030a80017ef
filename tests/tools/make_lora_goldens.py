#!/usr/bin/env python3
"""Generate PEFT LoRA adapters for the tiny arch checkpoints and their reference outputs.

For each of the tiny random models ``tests/data/arch/llama3`` and ``tests/data/arch/qwen2`` this
makes three LoRA adapters with Hugging Face PEFT (fixed seeds; lora_A and lora_B both drawn from
N(0, ``LORA_STD``), since PEFT starts B at zero and the adapter would change nothing) and writes

* ``tests/data/lora/<model>/<adapter>/``: ``adapter_config.json`` + ``adapter_model.safetensors``,
  as PEFT's ``save_pretrained`` writes them (its ``README.md`` model card deleted; in the config,
  ``target_modules`` sorted and ``base_model_name_or_path`` made relative to the repo root)
* ``tests/data/lora/<model>/reference.npz``: for the base model (``base``) and each adapter ``x``,
  ``logits_<x>`` float32 [2, 24, 256] over the arch golden's ``input_ids`` (one forward pass,
  attention_mask all ones) and ``greedy_<x>`` int32 [1, 8], the new tokens of
  ``generate(input_ids[:1, :10], max_new_tokens=8, do_sample=False)`` with eos disabled

The adapters (``ADAPTERS``): ``a`` r 8, alpha 16 on every linear; ``b`` r 4, alpha 8, rsLoRA, q_proj
and v_proj only; ``c`` r 16, alpha 16 on every linear, with a rank_pattern entry (layer 1's
down_proj: r 4) and an alpha_pattern entry (layer 0's o_proj: alpha 64).

Self-checks on every run: the base model's greedy ids equal the arch golden's (reference.npz
there), its logits within 1e-5, each adapter's greedy ids equal a cache-free argmax loop, each adapter
changes the logits clearly and its greedy ids, the saved folder reloads (``PeftModel.from_pretrained``
on a fresh base) to bit-identical logits, no greedy step is a near tie (top-2 gap > 1e-4),
``merge_and_unload`` (W + scaling * B @ A) gives the same logits within 1e-4, and the rank / alpha
pattern entries took effect.

Runs in its own virtualenv with torch, transformers and peft (the test suite needs none of them)::

    python3 -m venv /tmp/peftenv
    /tmp/peftenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl  # CPU torch
    /tmp/peftenv/bin/pip install transformers peft safetensors numpy
    /tmp/peftenv/bin/python tests/tools/make_lora_goldens.py [--out DIR] [--only llama3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arch_cases as arch  # noqa: E402  (sets Hugging Face's offline flags before transformers loads)
import arch_reference as ref  # noqa: E402
import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

REPO = arch.REPO
ARCH = REPO / "tests" / "data" / "arch"
DEFAULT_OUT = REPO / "tests" / "data" / "lora"
MODELS = {"llama3": 201, "qwen2": 202}  # model -> seed base (the adapter's index is added)
LORA_STD = 0.05
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# adapter -> (LoraConfig kwargs, description)
ADAPTERS = {
    "a": (dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR), "r 8, alpha 16, every linear"),
    "b": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
          "r 4, alpha 8, use_rslora (scaling 8 / sqrt 4 = 4), q_proj and v_proj only"),
    "c": (dict(r=16, lora_alpha=16, target_modules=ALL_LINEAR,
               rank_pattern={"model.layers.1.mlp.down_proj": 4},
               alpha_pattern={"model.layers.0.self_attn.o_proj": 64}),
          "r 16, alpha 16, every linear; rank_pattern: layer 1's down_proj r 4 (scaling 4); "
          "alpha_pattern: layer 0's o_proj alpha 64 (scaling 4)"),
}


def load_base(model: str):
    cls = getattr(transformers, arch.CASES[model][0].__name__)
    return cls.from_pretrained(ARCH / model, attn_implementation="eager", dtype=torch.float32).eval()


def make_adapter(model: str, adapter: str):
    """A PeftModel over a fresh base with `adapter`'s config and random lora_A / lora_B."""
    kwargs, _ = ADAPTERS[adapter]
    peft_model = get_peft_model(load_base(model), LoraConfig(lora_dropout=0.0, bias="none", **kwargs))
    gen = torch.Generator().manual_seed(MODELS[model] * 10 + list(ADAPTERS).index(adapter))
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * LORA_STD)
    return peft_model.eval()


def pattern_checks(peft_model) -> list[str]:
    """Adapter c's rank and alpha pattern entries are in the modules PEFT built (and only there)."""
    mods = dict(peft_model.named_modules())
    down = mods["base_model.model.model.layers.1.mlp.down_proj"]
    down0 = mods["base_model.model.model.layers.0.mlp.down_proj"]
    o0 = mods["base_model.model.model.layers.0.self_attn.o_proj"]
    o1 = mods["base_model.model.model.layers.1.self_attn.o_proj"]
    assert down.r["default"] == 4 and down.scaling["default"] == 4.0, (down.r, down.scaling)
    assert down0.r["default"] == 16 and down0.scaling["default"] == 1.0
    assert o0.r["default"] == 16 and o0.scaling["default"] == 4.0, (o0.r, o0.scaling)
    assert o1.scaling["default"] == 1.0
    return ["layer 1 down_proj r 4 scaling 4, layer 0 o_proj scaling 4, the others r 16 scaling 1"]


def tidy_config(path: Path, model: str) -> None:
    """PEFT writes target_modules in set order (varies per run) and the base model's absolute path:
    sorted, and the path relative to the repo root, so that a rerun writes the same bytes."""
    cfg = json.loads(path.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = f"tests/data/arch/{model}"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def greedy_gap(model, ids: np.ndarray, greedy: np.ndarray) -> float:
    """The smallest top-1 minus top-2 logit over the greedy tokens' steps (a near tie could flip
    under another implementation's rounding)."""
    seq = np.concatenate([ids[:1, :arch.PROMPT_LEN], greedy], axis=1)
    logits = ref.forward_logits(model, seq)[0, arch.PROMPT_LEN - 1:-1]
    top = np.sort(logits, axis=-1)
    gap = float((top[:, -1] - top[:, -2]).min())
    assert gap > 1e-4, gap
    return gap


@torch.no_grad()
def write_adapter(model: str, adapter: str, ids: np.ndarray, base: dict, out: Path) -> dict:
    peft_model = make_adapter(model, adapter)
    logits = ref.forward_logits(peft_model, ids)
    greedy = ref.greedy(peft_model, ids[:1, :arch.PROMPT_LEN])
    diff = float(np.abs(logits - base["logits"]).max())
    assert diff > 0.3 and np.abs(logits).max() < 20, (model, adapter, diff, np.abs(logits).max())
    assert not np.array_equal(greedy, base["greedy"]), (model, adapter, greedy)
    notes = pattern_checks(peft_model) if adapter == "c" else []
    notes.append(f"min top-2 gap on the greedy path {greedy_gap(peft_model, ids, greedy):.1e}")

    d = out / adapter
    if d.exists():
        shutil.rmtree(d)
    peft_model.save_pretrained(d, safe_serialization=True)
    (d / "README.md").unlink(missing_ok=True)
    tidy_config(d / "adapter_config.json", model)
    reloaded = PeftModel.from_pretrained(load_base(model), d).eval()
    assert np.array_equal(ref.forward_logits(reloaded, ids), logits), (model, adapter)
    merged = ref.forward_logits(reloaded.merge_and_unload(), ids)
    merge_err = float(np.abs(merged - logits).max())
    assert merge_err < 1e-4, (model, adapter, merge_err)
    notes.append(f"max abs dlogit vs base {diff:.3f}, merged vs unmerged {merge_err:.1e}")
    return dict(adapter=adapter, logits=logits, greedy=greedy, diff=diff, notes=notes,
                kb=sum(f.stat().st_size for f in d.iterdir()) / 1024)


def write_model(model: str, out_root: Path) -> list[dict]:
    golden = np.load(ARCH / model / "reference.npz")
    ids = golden["input_ids"]
    base_model = load_base(model)
    base = dict(logits=ref.forward_logits(base_model, ids), greedy=ref.greedy(base_model, ids[:1, :arch.PROMPT_LEN]))
    base_err = float(np.abs(base["logits"] - golden["logits"]).max())
    assert base_err < 1e-5 and np.array_equal(base["greedy"], golden["greedy_ids"]), (model, base_err)
    out = out_root / model
    out.mkdir(parents=True, exist_ok=True)
    rows = [write_adapter(model, a, ids, base, out) for a in ADAPTERS]
    arrays = {"logits_base": base["logits"].astype(np.float32), "greedy_base": base["greedy"].astype(np.int32)}
    for r in rows:
        arrays[f"logits_{r['adapter']}"] = r["logits"].astype(np.float32)
        arrays[f"greedy_{r['adapter']}"] = r["greedy"].astype(np.int32)
    np.savez(out / "reference.npz", **arrays)
    base_row = dict(adapter="base", greedy=base["greedy"], diff=0.0, kb=0.0,
                    notes=[f"max abs dlogit vs the arch golden's {base_err:.1e}",
                           f"min top-2 gap on the greedy path {greedy_gap(base_model, ids, base['greedy']):.1e}"])
    return [base_row, *rows]


def write_readme(out_root: Path, results: dict[str, list[dict]]) -> None:
    lines = [
        "# LoRA reference outputs (Hugging Face PEFT)",
        "",
        f"Generated by `tests/tools/make_lora_goldens.py` with torch {torch.__version__}, transformers "
        f"{transformers.__version__} and peft {peft.__version__} (float32, CPU, eager attention, 1 thread), "
        "over the tiny random checkpoints `tests/data/arch/llama3` and `tests/data/arch/qwen2`.",
        "",
        f"Each `<model>/<adapter>/` holds `adapter_config.json` + `adapter_model.safetensors` as PEFT's "
        f"`save_pretrained` writes them (target_modules sorted, base_model_name_or_path relative); lora_A and "
        f"lora_B are both ~ N(0, {LORA_STD}) (fixed seeds: PEFT "
        "starts B at zero). Tensor names: `base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight` "
        "[r, in] and `.lora_B.weight` [out, r], likewise `mlp.{gate,up,down}_proj`; the adapter's delta to "
        "`x @ W.T` is `(x @ A.T) @ B.T * scaling`, scaling = alpha / r (alpha / sqrt(r) with use_rslora).",
        "",
        "| adapter | what |",
        "| --- | --- |",
        *[f"| `{a}` | {desc} |" for a, (_, desc) in ADAPTERS.items()],
        "",
        "`<model>/reference.npz`, for `x` in base, a, b, c:",
        "",
        f"- `logits_<x>` float32 [{arch.BATCH}, {arch.SEQ}, {arch.VOCAB}]: one forward pass over the arch "
        "golden's `input_ids` (`tests/data/arch/<model>/reference.npz`), attention_mask all ones",
        f"- `greedy_<x>` int32 [1, {arch.NEW_TOKENS}]: the new tokens of `generate(input_ids[:1, :{arch.PROMPT_LEN}], "
        f"max_new_tokens={arch.NEW_TOKENS}, do_sample=False)` with eos disabled",
        "",
        "`greedy_base` equals the arch golden's `greedy_ids`, and `logits_base` its `logits` within 1e-5 (not "
        "bit for bit: another transformers version or CPU); compare an adapter's logits with `logits_base` "
        "from here, not with the arch golden's.",
        "",
        "| model | x | greedy | max abs dlogit vs base | KB | checks |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for model, rows in results.items():
        for r in rows:
            lines.append(f"| {model} | `{r['adapter']}` | {r['greedy'][0].tolist()} | {r['diff']:.3f} | "
                         f"{r['kb']:.0f} | {'; '.join(r['notes'])} |")
    lines += [
        "",
        "Checked on every run: the base outputs equal the arch goldens; each adapter changes the logits "
        "(max abs difference > 0.3) and the greedy tokens; greedy ids equal a cache-free argmax loop, and no "
        "greedy step is a near tie (top-1 minus top-2 logit > 1e-4); the saved "
        "folder reloads to bit-identical logits; merge_and_unload gives the same logits within 1e-4; adapter "
        "c's rank and alpha pattern entries are in the modules PEFT built.",
        "",
        "Regenerate (from the repo root; venv setup in the script's docstring):",
        "",
        "```sh",
        "/tmp/peftenv/bin/python tests/tools/make_lora_goldens.py",
        "```",
        "",
    ]
    (out_root / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    results = {m: write_model(m, args.out) for m in (args.only or MODELS)}
    if args.only is None:
        write_readme(args.out, results)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__} -> {args.out}")
    for model, rows in results.items():
        for r in rows:
            print(f"{model:<7} {r['adapter']:<5} {r['greedy'][0].tolist()} {r['diff']:.3f} {r['kb']:.0f} KB "
                  + "; ".join(r["notes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
