#!/usr/bin/env python3
"""The Hugging Face side of benchmarks.engine.offline; runs under .venv-ref (torch + transformers).

    .venv-ref/bin/python benchmarks/engine/hf_generate.py JOB.json RESULT.json

JOB.json (written by benchmarks.engine.offline):
  model_dir      an HF LlamaForCausalLM folder (config.json + model.safetensors, float32)
  prompts        list of token-id lists
  max_tokens     list of ints, one per prompt (greedy, eos ignored)
  batch_size     static batch size (16): prompts are taken in order, batch by batch
  pad_token_id   id used for left padding (masked out)
  golden         {"prompt_ids": [...], "greedy_ids": [...]} checked before any timing
  threads        torch intra-op threads: an int (0: torch's default), or "auto": time a short
                 batch with 1 thread and with torch's default and keep the faster (on a shared
                 2-core machine, 2 OpenMP threads can be many times slower than 1)
  return_ids     whether to return each request's output ids

Each batch is one `model.generate` call with left padding and `max_new_tokens` = the batch's
largest `max_tokens`; every row generates that many tokens, a request keeps only its own count.
RESULT.json holds per-batch seconds and token counts, the warm-up and load times, the golden
check, and optionally the ids. Progress goes to stderr. Exit status 3: the golden check failed.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(msg: str) -> None:
    print(f"[hf] {msg}", file=sys.stderr, flush=True)


class Generator:
    """The model loaded for greedy generation with eos off, and one timed `generate` call."""

    def __init__(self, job: dict):
        t0 = time.perf_counter()
        import torch
        import transformers
        from transformers import LlamaForCausalLM

        self.torch, self.transformers = torch, transformers
        self.default_threads = torch.get_num_threads()
        threads = job.get("threads") or 0
        if threads not in ("auto", 0):
            torch.set_num_threads(int(threads))
        self.model = LlamaForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
        self.model.eval()
        # eos disabled: generate() fills None fields of a passed GenerationConfig from
        # model.generation_config, so clear eos there too (min_new_tokens would mask the eos logit).
        self.model.generation_config.eos_token_id = None
        self.load_seconds = time.perf_counter() - t0
        self.pad = int(job.get("pad_token_id", 0))
        self.last_cpu = 0.0  # process CPU seconds (all threads) of the latest generate call
        log(f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{torch.get_num_threads()} threads, attention {self.model.config._attn_implementation}; "
            f"loaded in {self.load_seconds:.1f}s")

    def describe(self) -> dict:
        return {"torch": self.torch.__version__, "transformers": self.transformers.__version__,
                "threads": self.torch.get_num_threads(),
                "attn_implementation": self.model.config._attn_implementation, "load_seconds": self.load_seconds}

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
        """`new_tokens` greedy tokens per left-padded prompt of `batch`, and the call's seconds."""
        torch = self.torch
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        gc = self.transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False,
                                                eos_token_id=None, pad_token_id=self.pad)
        cpu, start = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        seconds = time.perf_counter() - start
        self.last_cpu = time.process_time() - cpu
        new = out[:, width:].tolist()
        if any(len(row) != new_tokens for row in new):
            raise RuntimeError(f"generate returned {[len(r) for r in new]} new tokens, expected {new_tokens}")
        return new, seconds


def check_golden(gen: Generator, golden: dict, result: dict) -> bool:
    """Generate the golden case and record it in `result["golden"]`; whether it matched."""
    got, seconds = gen.generate([golden["prompt_ids"]], len(golden["greedy_ids"]))
    ok = got[0] == golden["greedy_ids"]
    first_diff = next((i for i, (a, b) in enumerate(zip(got[0], golden["greedy_ids"])) if a != b), None)
    result["golden"] = {"match": ok, "got": got[0], "want": golden["greedy_ids"], "first_diff": first_diff,
                        "seconds": seconds}
    log(f"golden case 0: {'MATCH' if ok else 'MISMATCH at token %s' % first_diff} ({seconds:.1f}s)")
    return ok


def pick_threads(gen: Generator, probe: list[list[int]], result: dict) -> None:
    """Time `probe` with 1 thread and with torch's default, twice each, and keep the faster."""
    torch = gen.torch
    times: dict[int, list[float]] = {}
    for n in [1, gen.default_threads, 1, gen.default_threads]:
        torch.set_num_threads(n)
        times.setdefault(n, []).append(gen.generate(probe, 8)[1])
    best = min(times, key=lambda n: min(times[n]))
    torch.set_num_threads(best)
    result["thread_probe_seconds"] = {str(n): t for n, t in times.items()}
    result["threads"] = best
    log(f"threads: {best} (probe of batch {len(probe)} x 8 new tokens: "
        f"{ {n: [round(x, 2) for x in t] for n, t in times.items()} } s)")


def run_batches(gen: Generator, prompts: list[list[int]], max_tokens: list[int],
                B: int) -> tuple[list[dict], list[list[int]]]:
    """The prompts in order, B at a time: each batch's record, and each request's own ids."""
    batches = []
    ids_out: list[list[int]] = []
    for start in range(0, len(prompts), B):
        batch = prompts[start:start + B]
        wants = max_tokens[start:start + B]
        new_tokens = max(wants)
        new, seconds = gen.generate(batch, new_tokens)
        ids_out += [row[:w] for row, w in zip(new, wants)]
        width = max(len(p) for p in batch)
        batches.append({
            "size": len(batch), "prompt_width": width, "prompt_tokens": sum(len(p) for p in batch),
            "padded_prompt_tokens": len(batch) * width, "max_new_tokens": new_tokens,
            "generated_tokens": len(batch) * new_tokens, "useful_tokens": sum(wants), "seconds": seconds,
            "cpu_seconds": gen.last_cpu})
        done = sum(b["size"] for b in batches)
        log(f"batch {len(batches)}: {len(batch)} x (prompt {width}, new {new_tokens}) in {seconds:.1f}s "
            f"({sum(wants) / seconds:.0f} useful tok/s); {done}/{len(prompts)} requests")
    return batches, ids_out


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    job = json.loads(open(job_path).read())
    gen = Generator(job)
    result = gen.describe()
    golden = job.get("golden")
    if golden and not check_golden(gen, golden, result):
        open(result_path, "w").write(json.dumps(result))
        return 3

    prompts, max_tokens, B = job["prompts"], job["max_tokens"], int(job["batch_size"])
    # Warm-up (untimed in the totals): one full-width batch of short prompts, a few tokens.
    t = time.perf_counter()
    gen.generate([p[:8] for p in prompts[:B]], 4)
    result["warmup_seconds"] = time.perf_counter() - t
    log(f"warm-up {result['warmup_seconds']:.1f}s")
    if job.get("threads") == "auto" and gen.default_threads > 1:
        pick_threads(gen, [p[:16] for p in prompts[:B]], result)
    result["batches"], ids_out = run_batches(gen, prompts, max_tokens, B)
    if job.get("return_ids"):
        result["ids"] = ids_out
    open(result_path, "w").write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
