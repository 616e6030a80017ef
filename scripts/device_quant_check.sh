#!/usr/bin/env bash
# One prepared device check of quantized KV pages and weights on an NVIDIA H200 (Hopper), in
# under 8 minutes, writing one JSON report to ${OUT:-/tmp}/quant_check.json:
#   (a) pytest -m gpu tests/test_kv_quant.py tests/test_quant.py  (the Mosaic GPU kernel over
#       int8 / fp8 pages against the reference, decode and prefill);
#   (b) scripts/bench_quant_gpu.py --parts kernel: the kernel over bf16 vs int8 vs fp8 pages at
#       batch 64, 2k context (time per call, max error vs the reference);
#   (c) scripts/bench_quant_gpu.py --parts step: the runner's decode step, Llama-3-8B shapes
#       (STEP_LAYERS of its layers, default 8), bf16 vs fp8 weights vs bf16 weights + fp8 KV.
# Each part runs under its own timeout; its exit status, time, log tail and (b, c) JSON go into
# the report whatever happens to the others. Run from the repository root:
#   bash scripts/device_quant_check.sh
# PYTHON picks the interpreter (default: python3, the device image's, which holds jax with CUDA;
# the project is imported from this tree, not installed); BENCH_ARGS are appended to (b) and (c)'s
# arguments (a CPU smoke test: PYTHON=.venv/bin/python BENCH_ARGS="--quick --kernel reference").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the parts share nothing; no part holds 75% of HBM
STEP_LAYERS="${STEP_LAYERS:-8}"
read -r -a EXTRA <<<"${BENCH_ARGS:-}"

run_part() {  # name, timeout seconds, command...: log to $WORK/name.log, status to $WORK/name.rc
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  echo $? >"$WORK/$name.rc"
  echo $((SECONDS - t0)) >"$WORK/$name.s"
  tail -n 25 "$WORK/$name.log"
}

"$PY" -c 'import jax; print(jax.__version__, jax.devices())' >"$WORK/env.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$WORK/env.log" 2>&1
cat "$WORK/env.log"

run_part pytest 140 "$PY" -m pytest -m gpu tests/test_kv_quant.py tests/test_quant.py -q -p no:cacheprovider -rs
run_part kernel 120 "$PY" scripts/bench_quant_gpu.py --parts kernel --kernel gpu --batch 64 --context 2048 \
    --out "$WORK/kernel.json" "${EXTRA[@]}"
run_part step 170 "$PY" scripts/bench_quant_gpu.py --parts step --kernel gpu --layers "$STEP_LAYERS" \
    --step-batch 64 --step-context 2048 --out "$WORK/step.json" "${EXTRA[@]}"

"$PY" - "$WORK" "$OUT/quant_check.json" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
def read(name, default=None):
    p = work / name
    return p.read_text() if p.exists() else default
report = {"env": read("env.log", ""), "parts": {}}
for name in ("pytest", "kernel", "step"):
    rc = read(f"{name}.rc")
    part = {"rc": None if rc is None else int(rc), "seconds": int(read(f"{name}.s", "0")),
            "timed_out": rc is not None and int(rc) in (124, 137),
            "log_tail": "\n".join(read(f"{name}.log", "").splitlines()[-60:])}
    result = read(f"{name}.json")
    if result is not None:
        try:
            part["result"] = json.loads(result)
        except ValueError as e:
            part["result_error"] = f"unreadable JSON: {e}"
    report["parts"][name] = part
report["ok"] = all(p["rc"] == 0 for p in report["parts"].values())
out.write_text(json.dumps(report, indent=1))
print(f"wrote {out}: ok={report['ok']}, " + ", ".join(f"{k} rc={v['rc']}" for k, v in report["parts"].items()))
EOF
rm -rf "$WORK"
