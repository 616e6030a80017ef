#!/usr/bin/env bash
# The engine whole on an NVIDIA GPU or a Cloud TPU, in one command of at most 8 minutes, writing
# one JSON report to ${OUT:-/tmp}/device_check.json (#26). Parts, each under its own timeout, each
# recorded (exit status, seconds, log tail, its JSON) whatever happens to the others:
#   env        jax, its devices (nvidia-smi on a GPU)
#   pytest     pytest -m gpu / -m tpu (the Mosaic kernels against the reference)
#   golden     the SmolLM2 golden cases in bfloat16 on the device (greedy, agreement per case)
#   kernels    the ragged paged-attention kernel against the reference and timed against separate
#              decode + padded prefill calls (scripts/bench_ragged_attention.py); on a GPU also the
#              decode kernel's bandwidth (scripts/bench_gpu_attention.py, batch 64, 2k)
#   step       scripts/bench_step_floor.py: the decode step of Llama-3.1-8B's shapes (dummy
#              weights; Llama-3.2-1B's on a TPU chip of less than 32 GiB) against weights + live
#              KV over the copy bandwidth, batch 1/16/64/256 at 1k and 4k context
#   serving    jserve serve of that dummy model + jserve bench at c = 1, 16, 64, 256 on
#              1k-in/128-out and 128-in/1k-out
#   overlap    async scheduling against single steps (scripts/bench_async_scheduling.py: the
#              device's idle time between steps, throughput, same tokens) on Llama-3.2-1B's shapes
#   cold       seconds from `jserve serve` (default model, empty compilation cache) to ready and to
#              its first token (#26's target: 30 s)
# Without a GPU or TPU it runs as a dry run (the default model, small shapes, c <= 2; the kernel
# benchmark through the interpreters) so that it is checked on a CPU: bash scripts/device_check.sh
# DEVICE=gpu|tpu|cpu overrides the detection; PYTHON picks the interpreter (default: python3 on the
# device image; .venv/bin/python here). scripts/tpu_vm/smoke.sh runs it on a TPU VM.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
JSERVE=("$PY" -m jserve.cli)
WORK="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -z "${DEVICE:-}" ]; then
  DEVICE=cpu
  if nvidia-smi >/dev/null 2>&1; then DEVICE=gpu
  elif "$PY" -c 'import jax; jax.devices("tpu")' >/dev/null 2>&1; then DEVICE=tpu; fi
fi
LLAMA_8B=tests/data/configs/llama-3.1-8b.json

run_part() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  echo $? >"$WORK/$name.rc"
  echo $((SECONDS - t0)) >"$WORK/$name.s"
  tail -n 15 "$WORK/$name.log"
}

{ "$PY" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())'
  [ "$DEVICE" = gpu ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
  >"$WORK/env.log" 2>&1
echo "device: $DEVICE" >>"$WORK/env.log"
cat "$WORK/env.log"

if [ "$DEVICE" != cpu ]; then
  # The device's memory: an 8B model in bfloat16 (16 GB) wants a chip of 32 GiB or more.
  HBM=$("$PY" -c 'import jax; print(int(jax.devices()[0].memory_stats().get("bytes_limit", 0) / 2**30))' \
        2>/dev/null || echo 0)
  MODEL_CONFIG=$LLAMA_8B KV=100GiB SERVE_KV=80GiB
  if [ "$HBM" -lt 32 ]; then
    MODEL_CONFIG=tests/data/configs/llama-3.2-1b.json KV=$((HBM / 2))GiB SERVE_KV=$((HBM / 3))GiB
  fi
  DTYPE=bfloat16; STEP=(--model "$MODEL_CONFIG" --load-format dummy --batches 1,16,64,256 --contexts 1024,4096
                         --kv-bytes "$KV" --copy-bytes 4GiB)
  SERVE=(--model "$(mktemp -d)" --load-format dummy --max-model-len 2048 --max-num-seqs 256
         --max-num-batched-tokens 2048 --kv-cache-bytes "$SERVE_KV")
  cp "$MODEL_CONFIG" "${SERVE[1]}/config.json"
  CONC=(1 16 64 256); IN_LONG=1024; OUT_LONG=1024; OUT_SHORT=128; IN_SHORT=128
  OVERLAP=(--model "$(mktemp -d)" --load-format dummy --dtype bfloat16 --num-requests 64 --output-len 64
           --max-num-seqs 64 --repeats 2)
  cp tests/data/configs/llama-3.2-1b.json "${OVERLAP[1]}/config.json"
else  # a dry run: the same parts, small
  DTYPE=float32; STEP=(--batches 1,2 --contexts 128)
  OVERLAP=(--num-requests 4 --input-len 8 --output-len 8 --max-num-seqs 4 --repeats 1)
  SERVE=(--max-model-len 512 --max-num-seqs 4)
  CONC=(1 2); IN_LONG=64; OUT_LONG=32; OUT_SHORT=8; IN_SHORT=16
fi

MARK=$([ "$DEVICE" = tpu ] && echo tpu || echo gpu)
run_part pytest 65 "$PY" -m pytest -m "$MARK" tests -q -p no:cacheprovider -rs -x

run_part golden 40 "$PY" - "$DTYPE" "$WORK/golden.json" <<'EOF'
import json, sys
from pathlib import Path
from jserve import LLM, SamplingParams
dtype, out = sys.argv[1], Path(sys.argv[2])
golden = json.loads(Path("tests/data/smollm2_golden.json").read_text())
# No warm-up: the cases' own shapes compile as they come (the cold part times a warm-up; 20 shapes
# here took 29 s of the part's 40 on a loaded 2-core CPU).
llm = LLM(dtype=dtype, kv_cache_dtype=dtype, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,
          warmup=False)
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)
outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]], params)
cases = []
for case, o in zip(golden["cases"], outs):
    confident = next((j + 1 for j, s in enumerate(case["steps"]) if s["margin"] <= 0.05), len(case["steps"]))
    got, want = o.outputs[0].token_ids, case["greedy_ids"]
    agree = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    cases.append({"confident_prefix": confident, "agreeing_prefix": agree, "ok": agree >= confident})
report = {"dtype": dtype, "backend": str(llm.runner.backend), "cases": cases, "passed": sum(c["ok"] for c in cases)}
out.write_text(json.dumps(report, indent=1))
print(f"golden in {dtype}: {report['passed']} / {len(cases)} cases agree over their confident prefix")
EOF

kernels() {
  if [ "$DEVICE" = cpu ]; then  # through the interpreters: the GPU path and the TPU kernel
    "$PY" scripts/bench_ragged_attention.py --backend gpu --dry-run --out "$WORK/kernels.json"
    return
  fi
  "$PY" scripts/bench_ragged_attention.py --backend "$DEVICE" --out "$WORK/kernels.json" || return 1
  if [ "$DEVICE" = gpu ]; then
    "$PY" scripts/bench_gpu_attention.py --batch 64 --context 2048 --iters 10 --out "$WORK/decode_kernel.json"
  fi
}
run_part kernels 55 bash -c "$(declare -f kernels); $(declare -p WORK PY DEVICE); kernels"

run_part step 90 "$PY" scripts/bench_step_floor.py "${STEP[@]}" --reps 5 --out "$WORK/step.json"

serving() {
  local port=$((20000 + RANDOM % 20000))
  "${JSERVE[@]}" serve --port "$port" "${SERVE[@]}" >"$WORK/server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$WORK/server.log"; return 1; }
    sleep 0.5
  done
  local rc=0
  for shape in "$IN_LONG,$OUT_SHORT" "$IN_SHORT,$OUT_LONG"; do
    IFS=, read -r in out <<<"$shape"
    for c in "${CONC[@]}"; do
      printf '{"input_len": %d, "output_len": %d}\n' "$in" "$out" >"$WORK/load.jsonl"
      "${JSERVE[@]}" bench --base-url "http://127.0.0.1:$port" --workload "$WORK/load.jsonl" \
          --num-requests $((2 * c)) --concurrency "$c" --extra-body '{"ignore_eos": true}' --no-plots --quiet \
          --output-dir "$WORK/bench-$in-$out-$c" || rc=1
    done
  done
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^jserve_(step_idle|compilations_after)' || true
  kill "$pid"; wait "$pid" 2>/dev/null
  "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
rows = []
for d in sorted(work.glob("bench-*")):
    _, i, o, c = d.name.split("-")
    m = json.loads((d / "results.json").read_text())["runs"][0]["metrics"]
    rows.append({"input": int(i), "output": int(o), "concurrency": int(c), "output_tok_s": m["output_throughput"],
                 "ttft_ms_p50": m["ttft_ms"]["median"], "tpot_ms_p50": m["tpot_ms"]["median"], "failed": m["failed"]})
    print(rows[-1])
(work / "serving.json").write_text(json.dumps(rows, indent=1))
EOF
  return $rc
}
run_part serving 90 bash -c "$(declare -f serving); $(declare -p WORK JSERVE SERVE CONC IN_LONG OUT_LONG IN_SHORT OUT_SHORT PY); serving"

run_part overlap 45 "$PY" scripts/bench_async_scheduling.py "${OVERLAP[@]}" --out "$WORK/overlap.json"

run_part cold 95 "$PY" - "$WORK/cold.json" <<'EOF'
import json, os, socket, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
env = {**os.environ, "JSERVE_COMPILATION_CACHE": tempfile.mkdtemp()}  # an empty compilation cache
t0 = time.monotonic()
proc = subprocess.Popen([sys.executable, "-m", "jserve.cli", "serve", "--port", str(port), "--max-model-len", "512"],
                        env=env, stderr=subprocess.DEVNULL)
body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 1}).encode()
first = ready = None
while first is None and proc.poll() is None and time.monotonic() - t0 < 100:
    try:
        if ready is None:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            ready = time.monotonic() - t0
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        first = time.monotonic() - t0
    except OSError:
        time.sleep(0.2)
proc.terminate(); proc.wait(30)
Path(sys.argv[1]).write_text(json.dumps({"ready_seconds": ready, "first_token_seconds": first, "target_seconds": 30}))
print(f"jserve serve, empty caches: ready after {ready} s, first token after {first} s (target 30 s)")
sys.exit(0 if first is not None else 1)
EOF

"$PY" - "$WORK" "$OUT/device_check.json" "$DEVICE" <<'EOF'
import json, sys
from pathlib import Path
work, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def read(name, default=None):
    p = work / name
    return p.read_text() if p.exists() else default
report = {"env": read("env.log", ""), "device": device if device != "cpu" else "cpu (dry run)", "parts": {}}
for name in ("pytest", "golden", "kernels", "step", "serving", "overlap", "cold"):
    rc = read(f"{name}.rc")
    if rc is None:
        report["parts"][name] = {"skipped": "not run"}
        continue
    part = {"rc": int(rc), "seconds": int(read(f"{name}.s", "0")), "timed_out": int(rc) in (124, 137),
            "log_tail": "\n".join(read(f"{name}.log", "").splitlines()[-40:])}
    result = read(f"{name}.json")
    if result is not None:
        try:
            part["result"] = json.loads(result)
        except ValueError as e:
            part["result_error"] = f"unreadable JSON: {e}"
    report["parts"][name] = part
report["ok"] = all(p.get("rc", 0) == 0 for p in report["parts"].values())
out.write_text(json.dumps(report, indent=1))
print(f"wrote {out}: ok={report['ok']}, " + ", ".join(f"{k} rc={v.get('rc', 'skipped')}" for k, v in report["parts"].items()))
EOF
rm -rf "$WORK"
