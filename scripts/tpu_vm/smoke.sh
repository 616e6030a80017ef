#!/usr/bin/env bash
# The engine whole on a Cloud TPU VM, as scripts/device_check.sh checks it on a GPU: one command of
# at most 8 minutes on worker 0 of the VM, writing one JSON report to report it back.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: smoke.sh [--out DIR] [--python PYTHON]

Run on the TPU VM (after install.sh), from the repository's root or anywhere:
  pytest -m tpu (the Mosaic TPU kernels against the reference), the SmolLM2 golden cases in
  bfloat16 on the TPU, the ragged paged-attention kernel checked and timed, the decode step of an
  8B-shaped dummy model (1B-shaped on a chip of less than 32 GiB) against its HBM floor at batch
  1/16/64/256 and 1k/4k context, jserve serve + jserve bench at c = 1, 16, 64, 256 on
  1k-in/128-out and 128-in/1k-out, and the cold start (first token from jserve serve, empty
  compilation cache; target 30 s).

  --out DIR        where device_check.json goes (default: /tmp)
  --python PYTHON  the interpreter with jserve installed (default: .venv/bin/python if present,
                   else python3)
  -h, --help       this text

Exit status: 0 once the report is written (its "ok" says whether every part passed); 2 bad usage.
Send DIR/device_check.json back with the VM's type (e.g. v5litepod-8) and zone.
USAGE
}

root="$(cd "$(dirname "$0")/../.." && pwd)"
out=/tmp
python=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need "$@"; out=$2; shift 2 ;;
    --python) need "$@"; python=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "smoke.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$python" ]; then
  python=python3
  [ -x "$root/.venv/bin/python" ] && python="$root/.venv/bin/python"
fi
cd "$root"
OUT="$out" PYTHON="$python" bash scripts/device_check.sh  # it detects the TPU (DEVICE=tpu to insist)
echo "report: $out/device_check.json"
