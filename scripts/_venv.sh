# Sourced by scripts/test.sh and scripts/serve.sh: create (once) and activate .venv with a
# Python 3.12+ interpreter: python3.12/3.13 on PATH, else pyenv's 3.12, else python3 if new enough.
pick_python() {
  for c in python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -rV); do
      p="$(pyenv root)/versions/$v/bin/python3"; [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  if python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo python3; return; fi
  echo "jserve needs Python 3.12 or newer; none found (python3.12 on PATH or pyenv; on Ubuntu, e.g. a TPU VM:" \
       "sudo add-apt-repository ppa:deadsnakes/ppa && sudo apt-get install python3.12-venv)" >&2
  return 1
}
if [ ! -x .venv/bin/python ]; then
  py="$(pick_python)"
  "$py" -m venv .venv
fi
. .venv/bin/activate
