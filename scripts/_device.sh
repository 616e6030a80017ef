# Sourced by scripts/device_check.sh and scripts/device_quant_check.sh: the repository root as the
# working folder, OUT (the report's folder), PY (the interpreter: PYTHON, default python3, the device
# image's; the project is imported from this tree), WORK (a scratch folder), and the two functions:
#   run_part NAME SECONDS COMMAND...  runs it under a timeout: $WORK/NAME.log, .rc (exit status), .s
#   write_report FILE NAME...         one JSON report of those parts (+ each $WORK/NAME.json) to FILE
#                                     (DEVICE_LABEL, when set, as its "device"), then WORK removed
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the parts share nothing; no part holds 75% of the memory

run_part() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  echo $? >"$WORK/$name.rc"
  echo $((SECONDS - t0)) >"$WORK/$name.s"
  tail -n "${TAIL:-15}" "$WORK/$name.log"
}

write_report() {
  "$PY" - "$WORK" "$@" <<'PY'
import json, os, sys
from pathlib import Path
work, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
def read(name, default=None):
    p = work / name
    return p.read_text() if p.exists() else default
report = {"env": read("env.log", ""), "parts": {}}
if os.environ.get("DEVICE_LABEL"):
    report["device"] = os.environ["DEVICE_LABEL"]
for name in names:
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
PY
  rm -rf "$WORK"
}
