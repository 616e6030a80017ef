#!/usr/bin/env python3
"""Offline throughput: jserve against Hugging Face `generate` on the same SmolLM2 weights.

One workload, both sides in one invocation (run one after the other, never at once: the machine
has 2 cores). The workload mixes the four shapes a service sees (short/long prompt x short/long
output), random token-id prompts from a fixed seed, greedy, eos ignored, a fixed `max_tokens` per
request. jserve runs in this process, all requests in one `LLM.generate` call. Hugging Face runs
as a subprocess under `.venv-ref` (torch + transformers, float32) on the GGUF's dequantized weights
written once as an HF LlamaForCausalLM folder, in static batches of 16 with left padding and
`max_new_tokens` = the batch's largest request (only each request's own tokens count as output).
Both sides first reproduce golden case 0 (tests/data/smollm2_golden.json) before any timing.

It prints output tokens/s for each side, the ratio, wall times, warm-up separately, and jserve's
median decode step at batch 16 against its floor: bytes read (weights once + KV of the live
tokens) / 27e9 B/s and FLOPs (2 * params * rows + attention) / 190e9 FLOP/s (DESIGN.md §6), and
against the same floor from this machine's bandwidth and matmul rate measured in the same process
right before jserve's generation (an XLA sum over 1 GiB, an XLA 2048^3 float32 matmul; the best of
7 calls each, so that a busy moment does not lower the floor).

    python -m benchmarks.engine.offline --quick --out quick.json
    python -m benchmarks.engine.offline --out results.json      # 256 requests, in 32/512, out 32/256
    python -m benchmarks.engine.offline --num-requests 128 --scale 0.5 --hf-python none
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import parser, records_since, write_json

REPO = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench_offline")

BANDWIDTH = 27e9  # B/s, DESIGN.md §6
FLOPS = 190e9  # fp32 FLOP/s, DESIGN.md §6
GOLDEN = REPO / "tests" / "data" / "smollm2_golden.json"
HF_DIR = Path.home() / ".cache" / "jserve" / "bench" / "smollm2-hf"


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, out="")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (--quick: 32)")
    p.add_argument("--scale", type=float, default=None, help="multiplies all lengths (default 1; --quick: 0.25)")
    p.add_argument("--in-lens", default="32,512", help="short,long prompt lengths before --scale")
    p.add_argument("--out-lens", default="32,256", help="short,long output lengths before --scale")
    p.add_argument("--quick", action="store_true",
                   help="32 requests at scale 0.25: a few minutes, most of it jserve's warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-python", default=str(REPO / ".venv-ref" / "bin" / "python"),
                   help="Python with torch + transformers; 'none' skips the HF side")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--hf-threads", default="auto",
                   help="torch threads: N, 0 for torch's default, or auto (default): the faster of 1 and "
                        "torch's default on a short probe (2 OpenMP threads on a shared 2-core machine can "
                        "be many times slower than 1)")
    p.add_argument("--hf-dir", default=str(HF_DIR), help="where the HF copy of the weights is cached")
    p.add_argument("--skip-jserve", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=None, help="jserve's KV page size (default: the engine's)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="jserve's decode steps per call while only decodes run (multi-step decode)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8", "gguf"],
                   help="jserve's weights quantized (at load; gguf: the GGUF's own Q4_1 kept; the quality gate "
                   "needs a stored report, see README); the golden check then warns instead of stopping, "
                   "except for gguf, whose weights equal the float model's")
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (32 if args.quick else 256)
    args.scale = args.scale or (0.25 if args.quick else 1.0)
    return args


# ------------------------------------------------------------------------------- workload

def build_workload(num: int, in_lens: tuple[int, int], out_lens: tuple[int, int], vocab: int, seed: int):
    """Requests cycling through the four (prompt, output) shapes, shuffled with `seed`."""
    rng = np.random.default_rng(seed)
    shapes = [(i, o) for i in in_lens for o in out_lens]
    kinds = rng.permutation(np.arange(num) % len(shapes))
    prompts, max_tokens, labels = [], [], []
    for k in kinds:
        n_in, n_out = shapes[k]
        prompts.append(rng.integers(16, vocab, n_in).tolist())  # past the special tokens
        max_tokens.append(n_out)
        labels.append(f"{'long' if n_in == max(in_lens) else 'short'}/{'long' if n_out == max(out_lens) else 'short'}")
    return prompts, max_tokens, labels


def scaled(text: str, scale: float) -> tuple[int, int]:
    a, b = (max(1, round(int(x) * scale)) for x in text.split(","))
    return a, b


# ------------------------------------------------------------------------------- HF weights

def ensure_hf_weights(folder: Path) -> Path:
    """Write the GGUF's dequantized fp32 weights as an HF LlamaForCausalLM folder, once."""
    from jserve.model.checkpoint import default_gguf_path

    # private: the HF tensor names of jserve's weights (the reading direction) have no public name
    from jserve.model.sources import _HF_GLOBAL, _HF_LAYER, read_params

    gguf = default_gguf_path()
    stamp = f"{gguf} {gguf.stat().st_size} {int(gguf.stat().st_mtime)}"
    if (folder / "model.safetensors").is_file() and (folder / "SOURCE").is_file() \
            and (folder / "SOURCE").read_text() == stamp:
        return folder
    from safetensors.numpy import save_file

    logger.info("writing the HF copy of %s into %s", gguf.name, folder)
    config, params = read_params(gguf)
    if config.architecture != "llama" or config.rope_scaling is not None:
        raise ValueError(f"only plain llama models are supported here, got {config}")
    tensors = {}
    for hf_name, (name, transpose) in _HF_GLOBAL.items():
        if name in params:
            tensors[hf_name] = params[name].T if transpose else params[name]
    for suffix, (name, transpose) in _HF_LAYER.items():
        if name in params:
            for i in range(config.num_layers):
                tensors[f"model.layers.{i}.{suffix}"] = params[name][i].T if transpose else params[name][i]
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)[0],
        "pad_token_id": None,
    }
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    (tmp / "SOURCE").write_text(stamp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


# ------------------------------------------------------------------------------- the two sides

def run_hf(args, prompts, max_tokens, golden) -> dict:
    python = Path(args.hf_python)
    if args.hf_python == "none" or not python.exists():
        msg = (f"HF side skipped: {python} not found (set up .venv-ref as in tests/tools/make_arch_goldens.py, "
               f"or pass --hf-python)") if args.hf_python != "none" else "HF side skipped (--hf-python none)"
        print(msg, file=sys.stderr)
        return {"skipped": msg}
    folder = ensure_hf_weights(Path(args.hf_dir))
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        threads = args.hf_threads if args.hf_threads == "auto" else int(args.hf_threads)
        job.write_text(json.dumps({
            "model_dir": str(folder), "prompts": prompts, "max_tokens": max_tokens, "batch_size": args.hf_batch,
            "pad_token_id": 0, "golden": golden, "threads": threads, "return_ids": True}))
        load = os.getloadavg()[0]
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), str(Path(__file__).with_name("hf_generate.py")), str(job), str(out)])
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode == 3:
        raise SystemExit(f"HF side does not reproduce golden case 0: {result.get('golden')}; not timing it")
    if proc.returncode:
        raise SystemExit(f"HF subprocess failed with exit status {proc.returncode}")
    batches = result["batches"]
    gen = sum(b["seconds"] for b in batches)
    useful = sum(b["useful_tokens"] for b in batches)
    generated = sum(b["generated_tokens"] for b in batches)
    result.update({
        "generate_seconds": gen, "process_wall_seconds": wall, "loadavg_1m_before": load,
        "process_cpu_seconds": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "cpu_seconds": sum(b["cpu_seconds"] for b in batches),
        "median_batch_output_tokens_per_s": statistics.median(b["useful_tokens"] / b["seconds"] for b in batches),
        "output_tokens": useful, "generated_tokens": generated, "output_tokens_per_s": useful / gen,
        "wasted_output_fraction": 1 - useful / generated,
        "padded_prompt_fraction": 1 - sum(b["prompt_tokens"] for b in batches)
        / sum(b["padded_prompt_tokens"] for b in batches),
    })
    return result


def run_jserve(args, prompts, max_tokens, golden, max_model_len) -> dict:
    from jserve import LLM, SamplingParams

    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    knobs = {} if args.page_size is None else {"page_size": args.page_size}
    if args.quantization:
        knobs["quantization"] = args.quantization
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max_model_len, warmup=True, num_scheduler_steps=args.num_scheduler_steps, **knobs)
    init_seconds = time.perf_counter() - t0
    runner = llm.runner
    out = llm.generate([golden["prompt_ids"]],
                       SamplingParams(temperature=0.0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True))
    got = list(out[0].outputs[0].token_ids)
    if got != golden["greedy_ids"]:
        if args.quantization in (None, "gguf"):
            raise SystemExit(f"jserve does not reproduce golden case 0: got {got}, want {golden['greedy_ids']}")
        print(f"{args.quantization} weights: golden case 0 differs from the float model's greedy tokens",
              file=sys.stderr)

    steps0 = llm.stats()["num_steps"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    machine = measure_machine()
    load_gen = os.getloadavg()[0]
    last = runner.records[-1] if runner.records else None
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    gen = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if [len(x) for x in ids] != list(max_tokens):
        raise SystemExit("jserve returned a wrong number of tokens for some request")
    records = records_since(runner.records, last)
    stats = llm.stats()
    decode = [r for r in records if r.kind == "decode"]
    # The runner's counts, taken before it packed layer weights for the native CPU matmuls.
    model = {"params": runner.num_params, "weight_bytes": runner.param_bytes,
             "kv_bytes_per_token": llm.config.kv_bytes_per_token(runner.kv_itemsize),
             "num_layers": llm.config.num_layers, "num_heads": llm.config.num_heads,
             "head_dim": llm.config.head_dim}
    return {
        "init_seconds_load_and_warmup": init_seconds, "loadavg_1m_before_init": load,
        "loadavg_1m_before_generate": load_gen, "generate_seconds": gen, "cpu_seconds": cpu,
        "output_tokens": sum(max_tokens), "output_tokens_per_s": sum(max_tokens) / gen,
        "num_steps": stats["num_steps"] - steps0, "num_compiled_calls": len(records),
        "decode_seconds": sum(r.seconds for r in decode),
        "prefill_seconds": sum(r.seconds for r in records) - sum(r.seconds for r in decode),
        "host_seconds": gen - sum(r.seconds for r in records),
        "padded_token_fraction": 1 - sum(r.real_tokens for r in records) / sum(r.padded_tokens for r in records),
        "num_scheduler_steps": args.num_scheduler_steps, "multi_step_calls": sum(r.steps > 1 for r in records),
        "stats": stats, "model": model, "max_model_len": max_model_len,
        "decode_floor": decode_floor(records, model, args.max_num_seqs),
        "machine": machine,
        "decode_floor_measured": decode_floor(records, model, args.max_num_seqs, machine["read_bytes_per_s"],
                                              machine["matmul_flops_per_s"]),
        "ids": ids,
    }


def measure_machine(repeats: int = 7) -> dict:
    """This machine's read bandwidth and float32 matmul rate, now: the best and the median of
    `repeats` XLA calls (a sum over a 1 GiB array; a 2048 x 2048 x 2048 matmul), both on XLA's CPU
    thread pool. The floor takes the best."""
    import jax
    import jax.numpy as jnp

    def seconds(f, *args):
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        return min(times), statistics.median(times)

    big = jnp.ones((1 << 28,), jnp.float32)
    read = [big.nbytes / t for t in seconds(jax.jit(jnp.sum), big)]
    del big
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    flops = [2 * n ** 3 / t for t in seconds(jax.jit(jnp.matmul), a, a)]
    return {"read_bytes_per_s": read[0], "matmul_flops_per_s": flops[0], "median_read_bytes_per_s": read[1],
            "median_matmul_flops_per_s": flops[1], "repeats": repeats}


def decode_floor(records, model: dict, batch: int, bandwidth: float | None = None, peak: float | None = None) -> dict:
    """Median decode step at `batch` vs max(bytes / bandwidth, FLOPs / peak) of the same steps
    (the runner's own StepRecord.bytes_needed and flops_needed; default: DESIGN §6's constants).

    A multi-step call counts as its model steps, each with an equal share of the call's time,
    bytes and FLOPs."""
    bandwidth, peak = bandwidth or BANDWIDTH, peak or FLOPS
    calls = [r for r in records if r.kind == "decode" and r.bucket[0] == batch]
    if not calls:
        return {"batch": batch, "num_steps": 0}
    rows = []
    for r in calls:
        nbytes, flops = r.bytes_needed / r.steps, r.flops_needed / r.steps
        live = (nbytes - model["weight_bytes"]) / model["kv_bytes_per_token"]  # K/V read and written
        floor = max(nbytes / bandwidth, flops / peak)
        rows += [(r.seconds / r.steps, nbytes, flops, floor, r.real_tokens / r.steps, live)] * r.steps
    med = lambda j: statistics.median(x[j] for x in rows)  # noqa: E731
    return {
        "batch": batch, "num_steps": len(rows), "num_full_steps": sum(x[4] == batch for x in rows),
        "median_step_seconds": med(0), "median_bytes": med(1), "median_flops": med(2),
        "bandwidth_bytes_per_s": bandwidth, "flops_per_s": peak,
        "median_bytes_floor_seconds": med(1) / bandwidth, "median_flops_floor_seconds": med(2) / peak,
        "median_floor_seconds": med(3), "median_live_tokens": med(5),
        "step_over_floor": med(0) / med(3), "median_of_step_over_floor": statistics.median(x[0] / x[3] for x in rows),
        # seconds ~ fixed + per_live_token * live tokens: what a step costs apart from its KV reads,
        # and what each live token costs (reading its K/V alone: kv_bytes_per_token / 27e9 s).
        **dict(zip(("fit_fixed_seconds", "fit_seconds_per_live_token"),
                   reversed(np.polyfit([x[5] for x in rows], [x[0] for x in rows], 1).tolist())
                   if len({x[5] for x in rows}) > 1 else (None, None))),
        "steps": [[round(x[0], 5), x[4], round(x[5])] for x in rows],  # [seconds, live rows, live tokens]
    }


# ------------------------------------------------------------------------------- report

def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How often two sides' greedy ids agree (fp32 both; batching/padding may flip near-ties)."""
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    return {"exact_match_fraction": sum(x == y for x, y in zip(a, b)) / len(a),
            "median_first_difference": statistics.median(first),
            "matching_prefix_fraction": sum(first) / sum(len(p) for p in a)}


def report(res: dict) -> None:
    w, h, j = res["workload"], res.get("hf", {}), res.get("jserve", {})
    print(f"\nworkload: {w['num_requests']} requests, prompts {w['in_lens']}, outputs {w['out_lens']} "
          f"(scale {w['scale']}), {w['output_tokens']} output tokens, {w['prompt_tokens']} prompt tokens")
    hf_ok, js_ok = "output_tokens_per_s" in h, "output_tokens_per_s" in j
    f = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"  # noqa: E731
    print(f"{'':34}{'jserve':>12}{'HF generate':>14}{'jserve/HF':>11}")
    ratio = j["output_tokens_per_s"] / h["output_tokens_per_s"] if hf_ok and js_ok else None
    print(f"{'output tokens/s (useful)':34}{f(j, 'output_tokens_per_s', '.1f'):>12}"
          f"{f(h, 'output_tokens_per_s', '.1f'):>14}{format(ratio, '.2f') if ratio else '-':>11}")
    print(f"{'generation wall time (s)':34}{f(j, 'generate_seconds', '.1f'):>12}{f(h, 'generate_seconds', '.1f'):>14}")
    print(f"{'HF median per-batch tokens/s':34}{'':>12}{f(h, 'median_batch_output_tokens_per_s', '.1f'):>14}")
    print(f"{'CPU s during generation':34}{f(j, 'cpu_seconds', '.1f'):>12}{f(h, 'cpu_seconds', '.1f'):>14}")
    print(f"{'load + warm-up (s), not timed':34}{f(j, 'init_seconds_load_and_warmup', '.1f'):>12}"
          f"{format(h['load_seconds'] + h['warmup_seconds'], '.1f') if hf_ok else '-':>14}")
    if hf_ok:
        print(f"HF waste: {h['generated_tokens']} tokens generated for {h['output_tokens']} useful "
              f"({100 * h['wasted_output_fraction']:.0f}% wasted), {100 * h['padded_prompt_fraction']:.0f}% of "
              f"prompt positions are padding; {h['threads']} torch threads, {h['attn_implementation']} attention")
    elif h.get("skipped"):
        print(h["skipped"])
    if js_ok:
        if j.get("num_scheduler_steps", 1) > 1:
            print(f"jserve multi-step decode: up to {j['num_scheduler_steps']} steps per call, "
                  f"{j['multi_step_calls']} of {j['num_compiled_calls']} calls ran several")
        print(f"jserve: {j['num_steps']} steps, decode {j['decode_seconds']:.1f}s, "
              f"prefill {j['prefill_seconds']:.1f}s, "
              f"host {j['host_seconds']:.1f}s; padded-token fraction {j['padded_token_fraction']:.3f}; "
              f"compilations after warm-up {j['stats']['compilations_after_warmup']}")
        d = j["decode_floor"]
        if d.get("num_steps"):
            print(f"jserve decode step at batch {d['batch']}: median {1e3 * d['median_step_seconds']:.1f} ms over "
                  f"{d['num_steps']} steps ({d['num_full_steps']} with {d['batch']} live rows, median "
                  f"{d['median_live_tokens']:.0f} live tokens)")
            for name, fl in (("floor (DESIGN §6)", d), ("floor (measured now)", j.get("decode_floor_measured"))):
                if not fl:
                    continue
                print(f"  {name}: {fl['median_bytes'] / 1e6:.0f} MB / {fl['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s = "
                      f"{1e3 * fl['median_bytes_floor_seconds']:.1f} ms; {fl['median_flops'] / 1e9:.2f} GFLOP / "
                      f"{fl['flops_per_s'] / 1e9:.0f} GFLOP/s = {1e3 * fl['median_flops_floor_seconds']:.1f} ms; "
                      f"step/floor = {fl['step_over_floor']:.2f} (median per-step ratio "
                      f"{fl['median_of_step_over_floor']:.2f})")
            if d.get("fit_fixed_seconds") is not None:
                print(f"  fit over those steps: {1e3 * d['fit_fixed_seconds']:.1f} ms + "
                      f"{1e6 * d['fit_seconds_per_live_token']:.1f} us per live token (K/V bytes alone: "
                      f"{1e6 * j['model']['kv_bytes_per_token'] / BANDWIDTH:.1f} us)")
    if "agreement" in res:
        a = res["agreement"]
        print(f"greedy ids jserve vs HF: {100 * a['exact_match_fraction']:.0f}% of requests identical, "
              f"{100 * a['matching_prefix_fraction']:.0f}% of tokens before the first difference")
    print(f"1-min load average before HF {h.get('loadavg_1m_before', float('nan')):.2f}, before jserve generate "
          f"{j.get('loadavg_1m_before_generate', float('nan')):.2f} (2 cores; above ~1 the sides shared the CPU "
          f"with other work)")
    print(f"total wall time {res['total_wall_seconds']:.0f}s")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    t_start = time.perf_counter()
    from jserve.model.checkpoint import read_model_config

    config, _ = read_model_config(None)
    in_lens, out_lens = scaled(args.in_lens, args.scale), scaled(args.out_lens, args.scale)
    prompts, max_tokens, labels = build_workload(args.num_requests, in_lens, out_lens, config.vocab_size, args.seed)
    golden_case = json.loads(GOLDEN.read_text())["cases"][0]
    golden = {"prompt_ids": golden_case["prompt_ids"], "greedy_ids": golden_case["greedy_ids"]}
    # At least the largest token bucket: jserve's warm-up runs every prefill bucket at position 0
    # and fails (IndexError in step_rows.pack) when a bucket is longer than max_model_len.
    max_model_len = max(-(-(max(in_lens) + max(out_lens)) // 64) * 64, args.max_num_batched_tokens)
    res = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
           "cpu_count": os.cpu_count(),
           "workload": {"num_requests": args.num_requests, "scale": args.scale, "in_lens": in_lens,
                        "out_lens": out_lens, "seed": args.seed, "hf_batch": args.hf_batch,
                        "shapes": {s: labels.count(s) for s in sorted(set(labels))},
                        "output_tokens": sum(max_tokens), "prompt_tokens": sum(map(len, prompts))},
           "floor_constants": {"bandwidth_bytes_per_s": BANDWIDTH, "flops_per_s": FLOPS}}
    res["hf"] = run_hf(args, prompts, max_tokens, golden)
    if not args.skip_jserve:
        res["jserve"] = run_jserve(args, prompts, max_tokens, golden, max_model_len)
    if "ids" in res["hf"] and "jserve" in res:
        res["agreement"] = agreement(res["jserve"]["ids"], res["hf"]["ids"])
    for side in ("hf", "jserve"):
        res.get(side, {}).pop("ids", None)
    res["total_wall_seconds"] = time.perf_counter() - t_start
    report(res)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
