#!/usr/bin/env python3
"""jserve side by side with the servers a user would pick on this machine, one after the other on loopback.

    .venv/bin/python scripts/compare_servers.py --out compare.json                 # everything (~1 h on 2 cores)
    .venv/bin/python scripts/compare_servers.py --servers jserve,llamacpp-f32 --num-requests 16 --single-requests 2

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
  hf            scripts/_hf_server.py: transformers `generate`, fp32, static batches of up to 16,
                run with ``--hf-python`` (.venv-ref: torch + transformers, never a jserve dependency)

llama.cpp is built once from the sources vendored in the llama-cpp-python sdist (`pip download
--no-binary llama-cpp-python --no-deps llama-cpp-python`), with cmake (Release, GGML_NATIVE, targets
llama-server, llama-quantize and llama-perplexity, `nice -n 10`, 2 jobs: 10-30 minutes on 2 cores) into
``--cache-dir`` (default ~/.cache/jserve-bench, or $JSERVE_BENCH_CACHE), outside the repository.

Each server gets the same runs through the jserve.bench client: ``--workload`` (default mix) at
``--concurrency`` (16) for ``--num-requests`` (64), and a single stream of ``--single-requests``
short-prompt requests of 128 output tokens, after ``--warmup-requests`` unmeasured ones. The script
waits for each server's /health, stops it with SIGTERM, prints one table (output and total tok/s,
TTFT p50/p99, TPOT p50, output tok/s ratios against llama.cpp F32 and against HF) and writes JSON.
The load average before and after each server is recorded: others may share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("jserve", "jserve-int4", "jserve-int8", "llamacpp-q", "llamacpp-q8", "llamacpp-f32", "hf")
LABELS = {"jserve": "jserve (fp32)", "jserve-int4": "jserve int4 (Q4_1's)", "jserve-int8": "jserve int8 g32",
          "llamacpp-q": "llama.cpp Q4_1", "llamacpp-q8": "llama.cpp Q8_0", "llamacpp-f32": "llama.cpp F32",
          "hf": "HF transformers (fp32)"}
# Each jserve variant's llama.cpp counterpart at the same precision (the "vs peer" column).
PEERS = {"jserve": "llamacpp-f32", "jserve-int4": "llamacpp-q", "jserve-int8": "llamacpp-q8"}
# The single stream: short prompts, 128 output tokens (the issue's reference measurement).
SINGLE = {"workload": "short-long", "scale": 0.5}


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ llama.cpp build


def llama_bin(cache: Path) -> Path:
    return cache / "build" / "bin"


# The llama.cpp tools the scripts run: the server (compare_servers.py), the quantizer (the F32 and Q8_0
# copies) and llama-perplexity (scripts/compare_quality.py: perplexity and KL divergence).
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def llama_cpp_source(cache: Path) -> Path | None:
    """The unpacked vendored llama.cpp tree, or None before ensure_llama_cpp has unpacked it."""
    trees = sorted((cache / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return trees[-1] if trees else None


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
                    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", *LLAMA_TARGETS,
                    "-j", str(jobs)], check=True)
    return bindir


def default_gguf() -> Path:
    from jserve.model.checkpoint import default_gguf_path

    return default_gguf_path()


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


def ensure_jserve_quantized(cache: Path, kind: str, eval_chunks: int) -> Path:
    """A quantized jserve checkpoint of the default model with its quality report (made once)."""
    out = cache / f"smollm2-{kind}"
    if (out / "generation.json").is_file():
        return out
    jserve = Path(sys.executable).with_name("jserve")
    exe = str(jserve) if jserve.is_file() else "jserve"
    if kind == "int4":
        cmd = [exe, "convert", str(default_gguf()), "--quantize", "gguf"]
    else:
        from jserve.model.checkpoint import resolve_model

        cmd = [exe, "convert", str(resolve_model(None)), "--quantize", "int8", "--group-size", "32"]
    cmd += ["--out", str(out), "--quiet", "--eval-max-chunks", str(eval_chunks)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return out


def ensure_hf_folder() -> Path:
    """The GGUF's dequantized fp32 weights as an HF folder (shared with scripts/bench_offline.py)."""
    spec = importlib.util.spec_from_file_location("bench_offline", REPO / "scripts" / "bench_offline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ensure_hf_weights(mod.HF_DIR)


# ------------------------------------------------------------------------------------ servers


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and extra environment that start server ``name`` on ``port``."""
    env: dict[str, str] = {}
    if name.startswith("jserve"):
        jserve = Path(sys.executable).with_name("jserve")
        cmd = [str(jserve) if jserve.is_file() else "jserve", "serve", "--port", str(port),
               "--max-num-seqs", str(args.concurrency), "--served-model-name", "smollm2", *args.jserve_arg]
        if name != "jserve":
            cmd += ["--model", str(ensure_jserve_quantized(args.cache_dir, name.split("-")[1], args.eval_chunks))]
        if args.log_compiles:
            env["JAX_LOG_COMPILES"] = "1"
        return cmd, env
    if name.startswith("llamacpp"):
        bindir = ensure_llama_cpp(args.cache_dir)
        gguf = default_gguf()
        if name == "llamacpp-f32":
            gguf = ensure_f32_gguf(args.cache_dir, bindir, gguf)
        elif name == "llamacpp-q8":
            gguf = ensure_q8_gguf(args.cache_dir, bindir, gguf)
        cmd = [str(bindir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.concurrency), "-c", str(args.llama_ctx), "-t", str(args.threads),
               "-tb", str(args.threads), "--cont-batching", "-a", "smollm2", *args.llama_arg]
        return cmd, env
    if name == "hf":
        if not Path(args.hf_python).is_file():
            raise FileNotFoundError(f"--hf-python {args.hf_python} does not exist (a venv with torch + transformers)")
        folder = ensure_hf_folder()
        from jserve.model.checkpoint import resolve_model

        tokenizer = Path(resolve_model(None)) / "tokenizer.json"
        cmd = [args.hf_python, str(REPO / "scripts" / "_hf_server.py"), "--model", str(folder), "--tokenizer",
               str(tokenizer), "--port", str(port), "--served-model-name", "smollm2",
               "--max-batch", str(args.concurrency), "--threads", str(args.threads)]
        return cmd, env
    raise ValueError(f"unknown server {name!r}: choose from {', '.join(SERVERS)}")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET /health answers 200; raises if the process dies or time runs out."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was healthy")
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{url}/health not 200 after {timeout:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"pid {proc.pid} ignored SIGTERM for {timeout:.0f} s: killing it")
            proc.kill()
            proc.wait()
    return proc.returncode


def bench_args(url: str, out_dir: Path, *, workload: str, scale: float, num: int, concurrency: int,
               warmup: int, seed: int, timeout: float) -> argparse.Namespace:
    from jserve.bench import parse_args

    return parse_args(["--base-url", url, "--model", "smollm2", "--workload", workload, "--scale", str(scale),
                       "--num-requests", str(num), "--concurrency", str(concurrency), "--warmup-requests",
                       str(warmup), "--seed", str(seed), "--request-timeout", str(timeout), "--output-dir",
                       str(out_dir), "--no-plots"])


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_server(name: str, args: argparse.Namespace, port: int) -> dict:
    from jserve.bench import run_benchmark

    cmd, env = server_command(name, args, port)
    url = f"http://127.0.0.1:{port}"
    out_dir = args.out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"server": name, "label": LABELS[name], "command": cmd, "load_before": load_average()}
    log(f"{name}: starting {' '.join(cmd)} (log: {out_dir / 'server.log'})")
    with open(out_dir / "server.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        try:
            result["startup_s"] = wait_healthy(url, proc, args.startup_timeout)
            log(f"{name}: healthy after {result['startup_s']:.0f} s")
            runs = {}
            if args.num_requests:
                a = bench_args(url, out_dir / "concurrent", workload=args.workload, scale=args.scale,
                               num=args.num_requests, concurrency=args.concurrency, warmup=args.warmup_requests,
                               seed=args.seed, timeout=args.request_timeout)
                runs["concurrent"] = asyncio.run(run_benchmark(a))["runs"][0]["metrics"]
            if args.single_requests:
                a = bench_args(url, out_dir / "single", workload=SINGLE["workload"], scale=SINGLE["scale"],
                               num=args.single_requests, concurrency=1, warmup=0 if args.num_requests else 1,
                               seed=args.seed, timeout=args.request_timeout)
                runs["single"] = asyncio.run(run_benchmark(a))["runs"][0]["metrics"]
            result["runs"] = runs
        except Exception as e:  # noqa: BLE001 - one server's failure must not lose the others' numbers
            log(f"{name}: FAILED: {e!r}")
            result["error"] = repr(e)
        finally:
            result["exit_status"] = stop(proc)
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
    """One row per (server, run) with output tok/s ratios against llama.cpp F32 and against HF."""
    rows = {(r["server"], kind): summary_row(m) for r in results for kind, m in (r.get("runs") or {}).items()}
    out = []
    for r in results:
        for kind in ("concurrent", "single"):
            row = rows.get((r["server"], kind))
            if row is None:
                continue
            f32, hf = rows.get(("llamacpp-f32", kind)), rows.get(("hf", kind))
            peer = rows.get((PEERS.get(r["server"], ""), kind))
            out.append({"server": r["server"], "label": r["label"], "run": kind, **row,
                        "vs_llamacpp_f32": ratio(row["output_tok_s"], f32 and f32["output_tok_s"]),
                        "vs_peer": ratio(row["output_tok_s"], peer and peer["output_tok_s"]),
                        "vs_hf": ratio(row["output_tok_s"], hf and hf["output_tok_s"])})
    return out


def format_table(rows: list[dict], title: str = "") -> str:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    head = (f"{'server':<24}{'run':<12}{'out tok/s':>10}{'tot tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'vs F32':>8}{'vs peer':>8}{'vs HF':>8}{'fail':>6}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['label']:<24}{r['run']:<12}{f(r['output_tok_s']):>10}{f(r['total_tok_s']):>10}"
                     f"{f(r['ttft_p50_ms'], '.0f'):>10}{f(r['ttft_p99_ms'], '.0f'):>10}{f(r['tpot_p50_ms'], '.1f'):>10}"
                     f"{f(r['vs_llamacpp_f32'], '.2f'):>8}{f(r.get('vs_peer'), '.2f'):>8}{f(r['vs_hf'], '.2f'):>8}"
                     f"{r['failed']:>6}")
    lines.append("(ms for TTFT/TPOT; 'vs' columns: output tok/s over the same run of llama.cpp F32, of llama.cpp "
                 "at the same precision (jserve int4 / Q4_1, int8 / Q8_0, fp32 / F32), of HF)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--workload", default="mix")
    p.add_argument("--scale", type=float, default=1.0, help="of the workload's lengths (see jserve bench)")
    p.add_argument("--num-requests", type=int, default=64, help="of the concurrent run (0: skip it)")
    p.add_argument("--concurrency", type=int, default=16, help="also llama.cpp's -np, HF's batch, jserve's "
                   "--max-num-seqs")
    p.add_argument("--single-requests", type=int, default=8, help="of the single-stream run (0: skip it)")
    p.add_argument("--warmup-requests", type=int, default=4, help="unmeasured requests before the runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp -t/-tb and torch threads")
    p.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (split among the -np slots)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--jserve-arg", action="append", default=[], help="extra `jserve serve` argument (repeatable)")
    p.add_argument("--log-compiles", action="store_true", help="JAX_LOG_COMPILES=1 for jserve (its server.log)")
    p.add_argument("--eval-chunks", type=int, default=16, help="chunks of the quality evaluation behind the "
                   "quantized jserve checkpoints' reports")
    p.add_argument("--hf-python", default=str(REPO / ".venv-ref" / "bin" / "python"))
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("JSERVE_BENCH_CACHE", Path.home() / ".cache" / "jserve-bench")))
    p.add_argument("--port", type=int, default=8190, help="every server listens here in turn")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", type=Path, default=Path("compare_out"), help="per-server results and logs")
    p.add_argument("--out", type=Path, default=None, help="the summary JSON (default: OUT_DIR/compare.json)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and the F32 GGUF, then exit")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.servers if s not in SERVERS]
    if bad:
        p.error(f"unknown servers {bad}: choose from {', '.join(SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_only:
        bindir = ensure_llama_cpp(args.cache_dir)
        print(ensure_f32_gguf(args.cache_dir, bindir, default_gguf()))
        return 0
    machine = {"nproc": os.cpu_count(), "load_start": load_average(), "platform": sys.platform}
    results = [run_server(name, args, args.port) for name in args.servers]
    machine["load_end"] = load_average()
    rows = comparison(results)
    title = (f"{args.workload} x{args.scale:g}, {args.num_requests} requests at concurrency {args.concurrency}; "
             f"single stream: {args.single_requests} requests (in ~16, out 128)")
    print(format_table(rows, title))
    out = args.out or args.out_dir / "compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "machine": machine, "servers": results, "table": rows}, indent=1))
    log(f"wrote {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
