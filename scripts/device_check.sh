#!/usr/bin/env bash
# The engine whole on an NVIDIA GPU or a Cloud TPU, in one command of at most 8 minutes, writing
# one JSON report to ${OUT:-/tmp}/device_check.json (#26). Parts, each under its own timeout, each
# recorded (exit status, seconds, log tail, its JSON) whatever happens to the others:
#   env        jax, its devices (nvidia-smi on a GPU)
#   pytest     pytest -m gpu / -m tpu (the Mosaic kernels against the reference)
#   golden     the SmolLM2 golden cases in bfloat16 on the device (greedy, agreement per case)
#   kernels    the ragged paged-attention kernel against the reference and timed against separate
#              decode + padded prefill calls (benchmarks.kernels.ragged_attention); on a GPU also the
#              decode kernel's bandwidth (benchmarks.kernels.gpu_attention, batch 64, 2k)
#   step       benchmarks.step.floor: the decode step of Llama-3.1-8B's shapes (dummy weights;
#              Llama-3.2-1B's on a TPU chip of less than 32 GiB) against weights + live KV over the
#              copy bandwidth, batch 1/16/64/256 at 1k and 4k context
#   serving    benchmarks.serving.sweep: jserve serve of that dummy model + jserve bench at c = 1, 16,
#              64, 256 on 1k-in/128-out and 128-in/1k-out
#   overlap    async scheduling against single steps (benchmarks.engine.variants: the device's idle
#              time between steps, throughput, same tokens) on Llama-3.2-1B's shapes
#   cold       benchmarks.serving.cold_start: seconds from `jserve serve` (default model, empty
#              compilation cache) to ready and to its first token (#26's target: 30 s)
# Without a GPU or TPU it runs as a dry run (the default model, small shapes, c <= 2; the kernel
# benchmark through the interpreters) so that it is checked on a CPU: bash scripts/device_check.sh
# DEVICE=gpu|tpu|cpu overrides the detection; PYTHON picks the interpreter (default: python3 on the
# device image; .venv/bin/python here). scripts/tpu_vm/smoke.sh runs it on a TPU VM.
set -uo pipefail
. "$(dirname "$0")/_device.sh"
if [ -z "${DEVICE:-}" ]; then
  DEVICE=cpu
  if nvidia-smi >/dev/null 2>&1; then DEVICE=gpu
  elif "$PY" -c 'import jax; jax.devices("tpu")' >/dev/null 2>&1; then DEVICE=tpu; fi
fi

{ "$PY" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())'
  [ "$DEVICE" = gpu ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
  >"$WORK/env.log" 2>&1
echo "device: $DEVICE" >>"$WORK/env.log"
cat "$WORK/env.log"

if [ "$DEVICE" != cpu ]; then
  # The device's memory: an 8B model in bfloat16 (16 GB) wants a chip of 32 GiB or more.
  HBM=$("$PY" -c 'import jax; print(int(jax.devices()[0].memory_stats().get("bytes_limit", 0) / 2**30))' \
        2>/dev/null || echo 0)
  MODEL_CONFIG=tests/data/configs/llama-3.1-8b.json KV=100GiB SERVE_KV=80GiB
  if [ "$HBM" -lt 32 ]; then
    MODEL_CONFIG=tests/data/configs/llama-3.2-1b.json KV=$((HBM / 2))GiB SERVE_KV=$((HBM / 3))GiB
  fi
  DTYPE=bfloat16; STEP=(--model "$MODEL_CONFIG" --load-format dummy --batches 1,16,64,256 --contexts 1024,4096
                         --kv-bytes "$KV" --copy-bytes 4GiB)
  SERVE_MODEL="$(mktemp -d)"; cp "$MODEL_CONFIG" "$SERVE_MODEL/config.json"
  SERVING=(--serve-args "--model $SERVE_MODEL --load-format dummy --max-model-len 2048 --max-num-seqs 256
           --max-num-batched-tokens 2048 --kv-cache-bytes $SERVE_KV" --shapes 1024x128,128x1024
           --concurrency 1 16 64 256)
  OVERLAP=(--model "$(mktemp -d)" --load-format dummy --dtype bfloat16 --num-requests 64 --output-len 64
           --max-num-seqs 64 --repeats 2)
  cp tests/data/configs/llama-3.2-1b.json "${OVERLAP[1]}/config.json"
  KERNELS=(--backend "$DEVICE")
else  # a dry run: the same parts, small
  DTYPE=float32; STEP=(--batches 1,2 --contexts 128)
  OVERLAP=(--num-requests 4 --input-len 8 --output-len 8 --max-num-seqs 4 --repeats 1)
  SERVING=(--serve-args "--max-model-len 512 --max-num-seqs 4" --shapes 64x8,16x32 --concurrency 1 2)
  KERNELS=(--backend gpu --dry-run)  # through the interpreters: the GPU path and the TPU kernel
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
  "$PY" -m benchmarks.kernels.ragged_attention "${KERNELS[@]}" --out "$WORK/kernels.json" || return 1
  if [ "$DEVICE" = gpu ]; then
    "$PY" -m benchmarks.kernels.gpu_attention --batch 64 --context 2048 --iters 10 --out "$WORK/decode_kernel.json"
  fi
}
run_part kernels 55 bash -c "$(declare -f kernels); $(declare -p WORK PY DEVICE KERNELS); kernels"
run_part step 90 "$PY" -m benchmarks.step.floor "${STEP[@]}" --reps 5 --out "$WORK/step.json"
run_part serving 90 "$PY" -m benchmarks.serving.sweep "${SERVING[@]}" --out "$WORK/serving.json"
run_part overlap 45 "$PY" -m benchmarks.engine.variants --variants async_scheduling=false async_scheduling=true \
    "${OVERLAP[@]}" --out "$WORK/overlap.json"
run_part cold 95 "$PY" -m benchmarks.serving.cold_start --max-model-len 512 --timeout 90 --out "$WORK/cold.json"

DEVICE_LABEL=$([ "$DEVICE" = cpu ] && echo "cpu (dry run)" || echo "$DEVICE") \
  write_report "$OUT/device_check.json" pytest golden kernels step serving overlap cold
