#!/usr/bin/env bash
# One prepared device check of quantized KV pages and weights on an NVIDIA H200 (Hopper), in
# under 8 minutes, writing one JSON report to ${OUT:-/tmp}/quant_check.json:
#   (a) pytest -m gpu tests/test_kv_quant.py tests/test_quant.py  (the Mosaic GPU kernel over
#       int8 / fp8 pages against the reference, decode and prefill);
#   (b) benchmarks.step.quant_gpu --parts kernel: the kernel over bf16 vs int8 vs fp8 pages at
#       batch 64, 2k context (time per call, max error vs the reference);
#   (c) benchmarks.step.quant_gpu --parts step: the runner's decode step, Llama-3-8B shapes
#       (STEP_LAYERS of its layers, default 8), bf16 vs fp8 weights vs bf16 weights + fp8 KV.
# Each part runs under its own timeout; its exit status, time, log tail and (b, c) JSON go into
# the report whatever happens to the others. Run from the repository root:
#   bash scripts/device_quant_check.sh
# PYTHON picks the interpreter (default: python3, the device image's, which holds jax with CUDA;
# the project is imported from this tree, not installed); BENCH_ARGS are appended to (b) and (c)'s
# arguments (a CPU smoke test: PYTHON=.venv/bin/python BENCH_ARGS="--quick --kernel reference").
set -uo pipefail
. "$(dirname "$0")/_device.sh"
STEP_LAYERS="${STEP_LAYERS:-8}" TAIL=25
read -r -a EXTRA <<<"${BENCH_ARGS:-}"

"$PY" -c 'import jax; print(jax.__version__, jax.devices())' >"$WORK/env.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$WORK/env.log" 2>&1
cat "$WORK/env.log"

run_part pytest 140 "$PY" -m pytest -m gpu tests/test_kv_quant.py tests/test_quant.py -q -p no:cacheprovider -rs
run_part kernel 120 "$PY" -m benchmarks.step.quant_gpu --parts kernel --kernel gpu --batch 64 --context 2048 \
    --out "$WORK/kernel.json" "${EXTRA[@]}"
run_part step 170 "$PY" -m benchmarks.step.quant_gpu --parts step --kernel gpu --layers "$STEP_LAYERS" \
    --step-batch 64 --step-context 2048 --out "$WORK/step.json" "${EXTRA[@]}"

write_report "$OUT/quant_check.json" pytest kernel step
