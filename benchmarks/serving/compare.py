"""jserve side by side with the servers a user would pick on this machine, one after the other on loopback.

    python -m benchmarks.serving.compare --out compare.json                 # everything (~1 h on 2 cores)
    python -m benchmarks.serving.compare --servers jserve,llamacpp-f32 --num-requests 16 --single-requests 2
    python -m benchmarks.serving.compare --model gemma3-270m --servers jserve,jserve-int4,llamacpp-q,llamacpp-f32

Servers (``--servers``, comma-separated):
  jserve        `jserve serve` on the default model (SmolLM2-135M-Instruct), fp32
  jserve-int4   the same on the GGUF's own Q4_1 weights kept at 4 bits (`jserve convert GGUF --quantize gguf`)
  jserve-int8   the same on int8 in groups of 32 (`jserve convert CKPT --quantize int8 --group-size 32`: the
                bits per weight of Q8_0)
  llamacpp-q    llama.cpp's C++ `llama-server -np 16` (continuous batching) on the GGUF as shipped (Q4_1)
  llamacpp-q8   the same on a Q8_0 made from the F32 copy (`llama-quantize F32 -> Q8_0`)
  llamacpp-f32  the same on an F32 copy made with `llama-quantize --allow-requantize IN OUT F32`
The quantized jserve checkpoints are made once into ``--cache-dir``, each evaluated by `jserve
convert` on the first ``--eval-chunks`` chunks of the evaluation text (the quality gate's report).

``--model`` takes a named model (jserve.model.named; default: the default model, as above). Every
server then runs that model's GGUF (`named.gguf_path`: the assembled file for gemma3-270m), jserve
by name (`jserve serve --model NAME`, fp32 from the GGUF). For gemma3-270m (a Q4_K_M GGUF):
jserve-int4 (`convert --quantize gguf`) keeps what jserve can repack without a float copy: the
attention output (Q4_K -> int4 g32) and the tied embedding / LM head (Q8_0 -> int8 g32), 16.15 bits
per weight over the model; it reads the rest as fp32: the Q5_0 tensors (q, k, gate, up: 640 inputs,
no K-quant; jserve has no Q5_0 format) and v / down, whose layers mix formats (Q5_0 and Q8_0, Q4_K
and Q6_K; jserve stacks one format per weight over the layers). It is evaluated against the fp32
checkpoint (`jserve convert --no-eval`, then `jserve eval --reference ... --save`). llamacpp-q runs
the Q4_K_M file as shipped, llamacpp-f32 / -q8 llama-quantize copies of it, jserve-int8 int8 g32 of
the fp32 checkpoint. The bench requests are completions (a base model's GGUF has no chat template).
(Against Hugging Face transformers: benchmarks.engine.offline, offline on the same weights.)

llama.cpp is built once from the sources vendored in the llama-cpp-python sdist (`pip download
--no-binary llama-cpp-python --no-deps llama-cpp-python`), with cmake (Release, GGML_NATIVE, targets
llama-server, llama-quantize and llama-perplexity, `nice -n 10`, 2 jobs: 10-30 minutes on 2 cores) into
``--cache-dir`` (default ~/.cache/jserve-bench, or $JSERVE_BENCH_CACHE), outside the repository.

Each server gets the same runs through the jserve.bench client: ``--workload`` (default mix) at
``--concurrency`` (16) for ``--num-requests`` (64), and a single stream of ``--single-requests``
short-prompt requests of 128 output tokens, after ``--warmup-requests`` unmeasured ones. The script
waits for each server's /health, stops it with SIGTERM, prints one table (output and total tok/s,
TTFT p50/p99, TPOT p50, output tok/s ratios against llama.cpp F32 and the same precision's) and writes JSON.
The load average before and after each server is recorded: others may share the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.harness import ServerProcess, bench

SERVERS = ("jserve", "jserve-int4", "jserve-int8", "llamacpp-q", "llamacpp-q8", "llamacpp-f32")
LABELS = {"jserve": "jserve (fp32)", "jserve-int4": "jserve int4 (Q4_1's)", "jserve-int8": "jserve int8 g32",
          "llamacpp-q": "llama.cpp Q4_1", "llamacpp-q8": "llama.cpp Q8_0", "llamacpp-f32": "llama.cpp F32"}
# Each jserve variant's llama.cpp counterpart at the same precision (the "vs peer" column).
PEERS = {"jserve": "llamacpp-f32", "jserve-int4": "llamacpp-q", "jserve-int8": "llamacpp-q8"}
# The single stream: short prompts, 128 output tokens (the issue's reference measurement).
SINGLE = {"workload": "short-long", "scale": 0.5}
# Per named model (`--model`): the name the servers answer to, the cache folders' prefix, the GGUF's
# quantization (labels), and the jserve-int4 label. The default model's are the script's originals.
MODELS = {"smollm2-135m-instruct": {"alias": "smollm2", "prefix": "smollm2", "quant": "Q4_1",
                                    "int4": "jserve int4 (Q4_1's)"},
          "gemma3-270m": {"alias": "gemma3-270m", "prefix": "gemma3-270m", "quant": "Q4_K_M",
                          "int4": "jserve kept Q4_K/Q8_0"}}
def named_table():
    """The named models' table (jserve.model.named)."""
    from jserve.model import named

    return named


def model_info(model: str) -> dict:
    """MODELS' entry for `model` (another named model: its name, labels from nothing but "GGUF")."""
    return MODELS.get(model, {"alias": model, "prefix": model, "quant": "GGUF", "int4": "jserve GGUF's"})


def labels(model: str) -> dict:
    """LABELS with the model's quantization in the GGUF-as-shipped rows."""
    info = model_info(model)
    return {**LABELS, "jserve-int4": info["int4"], "llamacpp-q": f"llama.cpp {info['quant']}"}


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ llama.cpp build


def default_cache_dir() -> Path:
    return Path(os.environ.get("JSERVE_BENCH_CACHE", Path.home() / ".cache" / "jserve-bench"))


def llama_bin(cache: Path) -> Path:
    return cache / "build" / "bin"


# The llama.cpp tools the benchmarks run: the server (here), the quantizer (the F32 and Q8_0
# copies) and llama-perplexity (benchmarks.quality.llamacpp: perplexity and KL divergence).
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def llama_cpp_source(cache: Path) -> Path | None:
    """The unpacked vendored llama.cpp tree, or None before ensure_llama_cpp has unpacked it."""
    trees = sorted((cache / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return trees[-1] if trees else None


# A VM whose CPU reports AMX may not let a process use it: a GGML_NATIVE build then dies with SIGILL
# on quantized models (seen on 2026-12-06). GCC's explicit -mno-* flags win over -march=native's.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def ensure_llama_cpp(cache: Path, jobs: int = 2) -> Path:
    """LLAMA_TARGETS, built once from the llama-cpp-python sdist's vendored llama.cpp (a target that is
    missing is built into the existing build folder, so an older build gains llama-perplexity)."""
    bindir = llama_bin(cache)
    if all((bindir / target).is_file() for target in LLAMA_TARGETS):
        return bindir
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted((cache / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log("downloading the llama-cpp-python sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                        "llama-cpp-python", "-d", str(cache / "sdist")], check=True)
        sdists = sorted((cache / "sdist").glob("llama_cpp_python-*.tar.gz"))
    src_root = cache / "src"
    name = sdists[-1].name[:-len(".tar.gz")]
    src = src_root / name / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        log(f"unpacking {sdists[-1].name}")
        src_root.mkdir(exist_ok=True)
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(src_root, filter="data")
    build = cache / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"configuring llama.cpp in {build} (the build takes 10-30 minutes on 2 cores)")
    subprocess.run(["nice", "-n", "10", "cmake", "-S", str(src), "-B", str(build), *generator,
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
                    f"-DCMAKE_CXX_FLAGS={NO_AMX}"], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", *LLAMA_TARGETS,
                    "-j", str(jobs)], check=True)
    return bindir


def default_gguf() -> Path:
    from jserve.model.checkpoint import default_gguf_path

    return default_gguf_path()


def model_gguf(model: str) -> Path:
    """The named model's GGUF file (the default model's is default_gguf(); gemma3-270m's is assembled)."""
    from jserve.model.named import DEFAULT_MODEL, gguf_path

    return default_gguf() if model == DEFAULT_MODEL else gguf_path(model)


def ensure_f32_gguf(cache: Path, bindir: Path, source: Path) -> Path:
    out = cache / (source.stem.split(".")[0] + ".F32.gguf")
    if not out.is_file():
        log(f"llama-quantize --allow-requantize {source.name} -> {out.name} F32")
        tmp = out.with_suffix(".partial")
        subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), "F32"],
                       check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def ensure_q8_gguf(cache: Path, bindir: Path, source: Path) -> Path:
    """llama.cpp's own Q8_0 of the weights, from the F32 copy."""
    f32 = ensure_f32_gguf(cache, bindir, source)
    out = cache / (source.stem.split(".")[0] + ".Q8_0.gguf")
    if not out.is_file():
        log(f"llama-quantize {f32.name} -> {out.name} Q8_0")
        tmp = out.with_suffix(".partial")
        subprocess.run([str(bindir / "llama-quantize"), str(f32), str(tmp), "Q8_0"], check=True,
                       stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def ensure_jserve_quantized(cache: Path, kind: str, eval_chunks: int, model: str | None = None) -> Path:
    """A quantized jserve checkpoint of the default model (or the named model ``model``) with its
    quality report (made once)."""
    if model is not None and model != named_table().DEFAULT_MODEL:
        return _ensure_named_quantized(cache, kind, eval_chunks, model)
    out = cache / f"smollm2-{kind}"
    if (out / "generation.json").is_file():
        return out
    exe = jserve_exe()
    if kind == "int4":
        cmd = [exe, "convert", str(default_gguf()), "--quantize", "gguf"]
    else:
        from jserve.model.checkpoint import resolve_model

        cmd = [exe, "convert", str(resolve_model(None)), "--quantize", "int8", "--group-size", "32"]
    cmd += ["--out", str(out), "--quiet", "--eval-max-chunks", str(eval_chunks)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return out


def jserve_exe() -> str:
    jserve = Path(sys.executable).with_name("jserve")
    return str(jserve) if jserve.is_file() else "jserve"


def _ensure_named_quantized(cache: Path, kind: str, eval_chunks: int, model: str) -> Path:
    """ensure_jserve_quantized for a named model other than the default: converted without
    evaluation into a temporary folder, evaluated against the model's fp32 checkpoint (`jserve eval
    --reference ... --save`; `jserve convert`'s own evaluation of a GGUF would convert the file a
    second time, under its file name, into the checkpoint root), then renamed into place."""
    from jserve.model.checkpoint import resolve_model

    out = cache / f"{model_info(model)['prefix']}-{kind}"
    if (out / "generation.json").is_file():
        return out
    reference = resolve_model(model)  # the fp32 checkpoint (converted once, as `jserve serve --model` does)
    exe = jserve_exe()
    if kind == "int4":
        cmd = [exe, "convert", str(model_gguf(model)), "--quantize", "gguf"]
    else:
        cmd = [exe, "convert", str(reference), "--quantize", "int8", "--group-size", "32"]
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd += ["--out", str(tmp), "--quiet", "--no-eval"]
    evaluate = [exe, "eval", "--model", str(tmp), "--reference", str(reference), "--max-chunks", str(eval_chunks),
                "--save"]
    for step in (cmd, evaluate):
        log(" ".join(step))
        subprocess.run(step, check=True)
    tmp.rename(out)
    return out


# ------------------------------------------------------------------------------------ servers


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and extra environment that start server ``name`` on ``port``."""
    env: dict[str, str] = {}
    if name.startswith("jserve"):
        cmd = [jserve_exe(), "serve", "--port", str(port), "--max-num-seqs", str(args.concurrency),
               "--served-model-name", model_info(args.model)["alias"], *args.jserve_arg]
        if name != "jserve":
            cmd += ["--model", str(ensure_jserve_quantized(args.cache_dir, name.split("-")[1], args.eval_chunks,
                                                           args.model))]
        elif not args.default_model:
            cmd += ["--model", args.model]
        if args.log_compiles:
            env["JAX_LOG_COMPILES"] = "1"
        return cmd, env
    if name.startswith("llamacpp"):
        bindir = ensure_llama_cpp(args.cache_dir)
        gguf = model_gguf(args.model)
        if name == "llamacpp-f32":
            gguf = ensure_f32_gguf(args.cache_dir, bindir, gguf)
        elif name == "llamacpp-q8":
            gguf = ensure_q8_gguf(args.cache_dir, bindir, gguf)
        cmd = [str(bindir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.concurrency), "-c", str(args.llama_ctx), "-t", str(args.threads),
               "-tb", str(args.threads), "--cont-batching", "-a", model_info(args.model)["alias"], *args.llama_arg]
        return cmd, env
    raise ValueError(f"unknown server {name!r}: choose from {', '.join(SERVERS)}")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_server(name: str, args: argparse.Namespace, port: int) -> dict:
    out_dir = args.out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"server": name, "label": labels(args.model)[name], "model": args.model}
    try:  # llama.cpp's build, a GGUF copy or a jserve conversion may fail: the other servers still run
        cmd, env = server_command(name, args, port)
    except Exception as e:  # noqa: BLE001
        log(f"{name}: FAILED before starting: {e!r}")
        return {**result, "error": repr(e)}
    result.update(command=cmd, load_before=load_average())
    log(f"{name}: starting {' '.join(cmd)} (log: {out_dir / 'server.log'})")
    server = ServerProcess(command=cmd, port=port, env=env, log=out_dir / "server.log", timeout=args.startup_timeout)
    load = ["--model", model_info(args.model)["alias"], "--seed", str(args.seed), "--request-timeout",
            str(args.request_timeout)]
    try:
        with server:
            result["startup_s"] = server.startup_s
            result["waited_for_warmup_s"] = server.warmup_s  # after ready, before measuring
            log(f"{name}: healthy after {server.startup_s:.0f} s")
            runs = {}
            if args.num_requests:
                runs["concurrent"] = bench(server.url, *load, "--workload", args.workload, "--scale", str(args.scale),
                                           "--num-requests", str(args.num_requests), "--concurrency",
                                           str(args.concurrency), "--warmup-requests", str(args.warmup_requests))
            if args.single_requests:
                runs["single"] = bench(server.url, *load, "--workload", SINGLE["workload"], "--scale",
                                       str(SINGLE["scale"]), "--num-requests", str(args.single_requests),
                                       "--warmup-requests", "0" if args.num_requests else "1")
            result["runs"] = runs
    except Exception as e:  # noqa: BLE001 - one server's failure must not lose the others' numbers
        log(f"{name}: FAILED: {e!r}")
        result["error"] = repr(e)
    result["exit_status"] = server.proc.returncode if server.proc else None
    result["load_after"] = load_average()
    return result


# ------------------------------------------------------------------------------------ the table


def summary_row(metrics: dict | None) -> dict | None:
    """The figures the comparison table shows, from one run's `compute_metrics` dict."""
    if not metrics:
        return None
    return {"output_tok_s": metrics["output_throughput"], "total_tok_s": metrics["total_token_throughput"],
            "ttft_p50_ms": metrics["ttft_ms"]["median"], "ttft_p99_ms": metrics["ttft_ms"]["p99"],
            "tpot_p50_ms": metrics["tpot_ms"]["median"], "completed": metrics["completed"],
            "failed": metrics["failed"]}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparison(results: list[dict]) -> list[dict]:
    """One row per (server, run) with output tok/s ratios against llama.cpp F32 and the same precision's."""
    rows = {(r["server"], kind): summary_row(m) for r in results for kind, m in (r.get("runs") or {}).items()}
    out = []
    for r in results:
        for kind in ("concurrent", "single"):
            row = rows.get((r["server"], kind))
            if row is None:
                continue
            f32 = rows.get(("llamacpp-f32", kind))
            peer = rows.get((PEERS.get(r["server"], ""), kind))
            out.append({"server": r["server"], "label": r["label"], "run": kind, **row,
                        "vs_llamacpp_f32": ratio(row["output_tok_s"], f32 and f32["output_tok_s"]),
                        "vs_peer": ratio(row["output_tok_s"], peer and peer["output_tok_s"])})
    return out


def format_table(rows: list[dict], title: str = "") -> str:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    head = (f"{'server':<24}{'run':<12}{'out tok/s':>10}{'tot tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'vs F32':>8}{'vs peer':>8}{'fail':>6}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['label']:<24}{r['run']:<12}{f(r['output_tok_s']):>10}{f(r['total_tok_s']):>10}"
                     f"{f(r['ttft_p50_ms'], '.0f'):>10}{f(r['ttft_p99_ms'], '.0f'):>10}{f(r['tpot_p50_ms'], '.1f'):>10}"
                     f"{f(r['vs_llamacpp_f32'], '.2f'):>8}{f(r.get('vs_peer'), '.2f'):>8}"
                     f"{r['failed']:>6}")
    lines.append("(ms for TTFT/TPOT; 'vs' columns: output tok/s over the same run of llama.cpp F32, of llama.cpp "
                 "at the same precision (jserve int4 / the GGUF as shipped, int8 / Q8_0, fp32 / F32))")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    named = named_table()
    p.add_argument("--model", default=named.DEFAULT_MODEL, choices=sorted(named.NAMED_MODELS),
                   help="the named model every server runs (its GGUF; default %(default)s)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)} "
                   "(default: all)")
    p.add_argument("--workload", default="mix")
    p.add_argument("--scale", type=float, default=1.0, help="of the workload's lengths (see jserve bench)")
    p.add_argument("--num-requests", type=int, default=64, help="of the concurrent run (0: skip it)")
    p.add_argument("--concurrency", type=int, default=16, help="also llama.cpp's -np and jserve's --max-num-seqs")
    p.add_argument("--single-requests", type=int, default=8, help="of the single-stream run (0: skip it)")
    p.add_argument("--warmup-requests", type=int, default=4, help="unmeasured requests before the runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp -t/-tb")
    p.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (split among the -np slots)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--jserve-arg", action="append", default=[], help="extra `jserve serve` argument (repeatable)")
    p.add_argument("--log-compiles", action="store_true", help="JAX_LOG_COMPILES=1 for jserve (its server.log)")
    p.add_argument("--eval-chunks", type=int, default=16, help="chunks of the quality evaluation behind the "
                   "quantized jserve checkpoints' reports")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--port", type=int, default=8190, help="every server listens here in turn")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", type=Path, default=Path("compare_out"), help="per-server results and logs")
    p.add_argument("--out", type=Path, default=None, help="the summary JSON (default: OUT_DIR/compare.json)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and the F32 GGUF, then exit")
    args = p.parse_args(argv)
    args.default_model = args.model == named.DEFAULT_MODEL
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.servers if s not in SERVERS]
    if bad:
        p.error(f"unknown servers {bad}: choose from {', '.join(SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_only:
        bindir = ensure_llama_cpp(args.cache_dir)
        print(ensure_f32_gguf(args.cache_dir, bindir, model_gguf(args.model)))
        return 0
    machine = {"nproc": os.cpu_count(), "load_start": load_average(), "platform": sys.platform}
    results = [run_server(name, args, args.port) for name in args.servers]
    machine["load_end"] = load_average()
    rows = comparison(results)
    title = (f"{args.model}: {args.workload} x{args.scale:g}, {args.num_requests} requests at concurrency "
             f"{args.concurrency}; single stream: {args.single_requests} requests (in ~16, out 128)")
    print(format_table(rows, title))
    out = args.out or args.out_dir / "compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "machine": machine, "servers": results, "table": rows}, indent=1))
    log(f"wrote {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
