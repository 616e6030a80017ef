#!/usr/bin/env bash
# Runs ON the TPU VM as root (sudo), on every worker: fetch the checkpoint (optional), write
# /etc/jserve/serve.env (and /etc/jserve/env from a key file), install jserve.service from the
# template beside this script, then enable and (re)start it. deploy.sh calls it with --worker=all.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: sudo setup_service.sh --user USER [options]

  --user USER           account the service runs as (deploy.sh: your login user on the VM, the one
                        install.sh verified the TPU with)
  --venv DIR            jserve's virtual environment (default: /opt/jserve/venv)
  --model MODEL         checkpoint folder or name under /var/lib/jserve/checkpoints
                        (default: smollm2-135m-instruct, converted on first start)
  --gcs-model URI       copy gs://BUCKET/.../NAME into /var/lib/jserve/checkpoints/NAME
                        (`gcloud storage rsync --recursive`) and serve it; implies --model NAME
  --port PORT           (default: 8000)
  --host HOST           (default: 0.0.0.0)
  --args "FLAGS"        more `jserve serve` flags, e.g. "--mesh tp=4 --distributed --max-model-len 8192"
  --api-key-file FILE   write JSERVE_API_KEY from FILE's first line into /etc/jserve/env (0600) and
                        delete FILE; without it an existing /etc/jserve/env is kept
  --unit FILE           unit template (default: jserve.service beside this script)
  --no-start            install and enable, do not (re)start
  -h, --help            this text
USAGE
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
user="" venv="/opt/jserve/venv" model="" gcs_model="" port=8000 host="0.0.0.0" args="" key_file=""
unit="$here/jserve.service" start=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --user) need "$@"; user="$2"; shift 2 ;;
    --venv) need "$@"; venv="$2"; shift 2 ;;
    --model) need "$@"; model="$2"; shift 2 ;;
    --gcs-model) need "$@"; gcs_model="${2%/}"; shift 2 ;;
    --port) need "$@"; port="$2"; shift 2 ;;
    --host) need "$@"; host="$2"; shift 2 ;;
    --args) [ $# -ge 2 ] || { echo "setup_service.sh: --args needs a value" >&2; exit 2; }; args="$2"; shift 2 ;;
    --api-key-file) need "$@"; key_file="$2"; shift 2 ;;
    --unit) need "$@"; unit="$2"; shift 2 ;;
    --no-start) start=0; shift ;;
    *) unknown "$1" ;;
  esac
done
required --user "$user"
[ "$(id -u)" = 0 ] || { echo "setup_service.sh: run as root (sudo)" >&2; exit 2; }
id "$user" >/dev/null || { echo "setup_service.sh: no such user: $user" >&2; exit 2; }
[ -x "$venv/bin/jserve" ] || { echo "setup_service.sh: $venv/bin/jserve missing; run install.sh first" >&2; exit 1; }
[ -f "$unit" ] || { echo "setup_service.sh: unit template $unit missing" >&2; exit 2; }
for v in "$model" "$args" "$host" "$port"; do
  case "$v" in *[\"\\\$\`]*|*$'\n'*) echo "setup_service.sh: quotes, \\, \$, \` and newlines are not allowed in values: $v" >&2; exit 2 ;; esac
done

state=/var/lib/jserve
install -d -o "$user" -g "$(id -gn "$user")" "$state" "$state/checkpoints" "$state/compilation-cache"

if [ -n "$gcs_model" ]; then
  name="$(basename "$gcs_model")"
  echo "setup_service.sh: syncing $gcs_model -> $state/checkpoints/$name" >&2
  gcloud storage rsync --recursive "$gcs_model" "$state/checkpoints/$name"
  chown -R "$user:$(id -gn "$user")" "$state/checkpoints/$name"
  model="${model:-$name}"
fi
model="${model:-smollm2-135m-instruct}"

install -d -m 0755 /etc/jserve
cat > /etc/jserve/serve.env.tmp <<ENV
# written by scripts/tpu_vm/setup_service.sh; read by jserve.service
JSERVE_MODEL="$model"
JSERVE_HOST="$host"
JSERVE_PORT="$port"
JSERVE_ARGS="$args"
ENV
chmod 0644 /etc/jserve/serve.env.tmp
mv /etc/jserve/serve.env.tmp /etc/jserve/serve.env

if [ -n "$key_file" ]; then
  key="$(head -n 1 "$key_file" | tr -d '\r\n')"
  rm -f "$key_file"
  [ -n "$key" ] || { echo "setup_service.sh: $key_file is empty" >&2; exit 2; }
  # systemd reads the env file: keep keys to URL-safe characters (e.g. `openssl rand -hex 32`)
  case "$key" in *[!A-Za-z0-9._~+/=-]*) echo "setup_service.sh: the API key may only hold A-Z a-z 0-9 . _ ~ + / = -" >&2; exit 2 ;; esac
  (umask 077; printf 'JSERVE_API_KEY=%s\n' "$key" > /etc/jserve/env.tmp)
  chown root:root /etc/jserve/env.tmp
  mv /etc/jserve/env.tmp /etc/jserve/env
fi
if ! grep -qE '^JSERVE_API_KEY=.' /etc/jserve/env 2>/dev/null; then
  echo "setup_service.sh: /etc/jserve/env has no JSERVE_API_KEY; pass --api-key-file" >&2
  exit 1
fi

sed -e "s|@USER@|$user|g" -e "s|@VENV@|$venv|g" "$unit" > /etc/systemd/system/jserve.service.tmp
mv /etc/systemd/system/jserve.service.tmp /etc/systemd/system/jserve.service
systemctl daemon-reload
systemctl enable jserve.service >/dev/null
if [ "$start" = 1 ]; then
  systemctl restart jserve.service
  echo "setup_service.sh: jserve.service (re)started on $(hostname): model $model, port $port, args: ${args:-none}" >&2
fi
