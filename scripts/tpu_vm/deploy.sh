#!/usr/bin/env bash
# From your workstation: install this jserve checkout on every worker of a TPU VM or slice
# (gcloud ... --worker=all), install the systemd unit, start it, and health-check worker 0.
# Re-run it to deploy new code or flags (the compilation cache and checkpoints stay on the VM).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: deploy.sh --name NAME --zone ZONE [options] [-- MORE_JSERVE_SERVE_FLAGS...]

  --name NAME            TPU name (env TPU_NAME)
  --zone ZONE            zone (env ZONE)
  --project PROJECT      (env PROJECT_ID; default: gcloud's configured project)
  --model MODEL          checkpoint folder on the VM or a name under /var/lib/jserve/checkpoints
                         (default: smollm2-135m-instruct, converted on the VM on first start)
  --gcs-model URI        gs://BUCKET/.../NAME: a converted checkpoint folder, copied to every
                         worker's /var/lib/jserve/checkpoints/NAME and served (implies --model NAME)
  --mesh SPEC            device mesh, e.g. tp=8 or dp=2,tp=4 (jserve serve --mesh)
  --distributed          multi-host slice: every worker runs jserve serve --distributed
  --port PORT            (default: 8000)
  --api-key-file FILE    local file whose first line is the API key (or set JSERVE_API_KEY in the
                         environment). Needed on the first deploy; later deploys keep the VM's key.
  --user USER            account the service runs as (default: your login user on the VM)
  --skip-install         do not copy/install the code (only rewrite the service config, restart)
  --no-health-check      do not wait for worker 0 to answer /health and a 1-token completion
  --health-timeout SEC   (default: 1800)
  --dry-run              print the gcloud commands instead of running them
  -h, --help             this text

What it runs (gcloud compute tpus tpu-vm ...): scp of `git archive HEAD` and scripts/tpu_vm/ to
/tmp/jserve-deploy on all workers; ssh --worker=all: unpack to /opt/jserve/src, install.sh
(venv /opt/jserve/venv); ssh --worker=all: stop jserve, check JAX sees the TPUs on every host at
once; ssh --worker=all: sudo setup_service.sh (unit, env files, restart); ssh --worker=0:
health_check.sh. Uncommitted changes are NOT deployed (commit first).
Multi-host ssh --worker=all wants your key in an agent: ssh-add ~/.ssh/google_compute_engine

Example:
  JSERVE_API_KEY="$(openssl rand -hex 32)" scripts/tpu_vm/deploy.sh --name jserve-v6e --zone us-east5-b \
      --gcs-model gs://my-bucket/jserve/checkpoints/my-model --mesh tp=8 -- --max-model-len 8192
USAGE
}

name="${TPU_NAME:-}" zone="${ZONE:-}" project="${PROJECT_ID:-}" model="" gcs_model="" mesh=""
distributed=0 port=8000 key_file="" user="" skip_install=0 health=1 health_timeout=1800 dry_run=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name) need "$@"; name="$2"; shift 2 ;;
    --zone) need "$@"; zone="$2"; shift 2 ;;
    --project) need "$@"; project="$2"; shift 2 ;;
    --model) need "$@"; model="$2"; shift 2 ;;
    --gcs-model) need "$@"; gcs_model="$2"; shift 2 ;;
    --mesh) need "$@"; mesh="$2"; shift 2 ;;
    --distributed) distributed=1; shift ;;
    --port) need "$@"; port="$2"; shift 2 ;;
    --api-key-file) need "$@"; key_file="$2"; shift 2 ;;
    --user) need "$@"; user="$2"; shift 2 ;;
    --skip-install) skip_install=1; shift ;;
    --no-health-check) health=0; shift ;;
    --health-timeout) need "$@"; health_timeout="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) unknown "$1" ;;
  esac
done
required --name "$name"
required --zone "$zone"
case "$gcs_model" in ""|gs://*) ;; *) echo "deploy.sh: --gcs-model must be a gs:// URI" >&2; exit 2 ;; esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

# `jserve serve` flags beyond model/host/port/api-key, as one line for /etc/jserve/serve.env
serve_args=()
[ -n "$mesh" ] && serve_args+=(--mesh "$mesh")
[ "$distributed" = 1 ] && serve_args+=(--distributed)
serve_args+=(${extra[@]+"${extra[@]}"})
args_line="${serve_args[*]+"${serve_args[*]}"}"

gc=(--zone="$zone")
[ -n "$project" ] && gc+=(--project="$project")
on_workers() {  # on_workers WORKERS COMMAND
  run gcloud compute tpus tpu-vm ssh "$name" "${gc[@]}" --worker="$1" --command="$2"
}
q() { printf '%q' "$1"; }

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/jserve-deploy"
cp "$here/_common.sh" "$here/install.sh" "$here/setup_service.sh" "$here/jserve.service" "$here/health_check.sh" \
  "$stage/jserve-deploy/"
if [ "$skip_install" = 0 ]; then
  if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "deploy.sh: warning: uncommitted changes in $repo are not deployed (git archive HEAD)" >&2
  fi
  git -C "$repo" archive --format=tar.gz -o "$stage/jserve-deploy/src.tar.gz" HEAD
fi
key="${JSERVE_API_KEY:-}"
[ -n "$key_file" ] && key="$(head -n 1 "$key_file" | tr -d '\r\n')"
if [ -n "$key" ]; then
  (umask 077; printf '%s\n' "$key" > "$stage/jserve-deploy/api_key")
fi

echo "== copying to all workers of $name" >&2
run gcloud compute tpus tpu-vm scp --recurse "$stage/jserve-deploy" "$name:/tmp/" "${gc[@]}" --worker=all

if [ "$skip_install" = 0 ]; then
  echo "== installing jserve[tpu] on all workers" >&2
  install_flags="--src /opt/jserve/src --venv /opt/jserve/venv --no-verify"
  [ -z "$model" ] && [ -z "$gcs_model" ] && install_flags="$install_flags --with-default-model"
  on_workers all "set -e; sudo mkdir -p /opt/jserve; sudo chown \"\$(id -u):\$(id -g)\" /opt/jserve; \
rm -rf /opt/jserve/src; mkdir -p /opt/jserve/src; tar -xzf /tmp/jserve-deploy/src.tar.gz -C /opt/jserve/src; \
bash /tmp/jserve-deploy/install.sh $install_flags"

  echo "== checking that JAX sees the TPU on every worker (all hosts at once)" >&2
  on_workers all "sudo systemctl stop jserve.service 2>/dev/null || true; \
/opt/jserve/venv/bin/python -c 'import jax; print(\"process\", jax.process_index(), \"of\", jax.process_count(), \"local\", jax.local_device_count(), \"global\", jax.device_count(), jax.devices()[0].platform); assert jax.devices()[0].platform == \"tpu\"'"
fi

echo "== installing and starting jserve.service on all workers" >&2
if [ -n "$user" ]; then user_arg="$(q "$user")"; else user_arg='"$(id -un)"'; fi
setup="sudo bash /tmp/jserve-deploy/setup_service.sh --user $user_arg --port $(q "$port") --args $(q "$args_line")"
[ -n "$model" ] && setup="$setup --model $(q "$model")"
[ -n "$gcs_model" ] && setup="$setup --gcs-model $(q "$gcs_model")"
[ -n "$key" ] && setup="$setup --api-key-file /tmp/jserve-deploy/api_key"
on_workers all "$setup"

if [ "$health" = 1 ]; then
  echo "== health check on worker 0 (process 0 serves HTTP)" >&2
  on_workers 0 "sudo bash /tmp/jserve-deploy/health_check.sh --url http://127.0.0.1:$(q "$port") --env-file /etc/jserve/env --timeout $(q "$health_timeout")"
fi
[ "$dry_run" = 1 ] || cat >&2 <<EOM
deployed. Logs:    gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 --command='journalctl -u jserve -f'
Tunnel to it:      gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 -- -N -L $port:127.0.0.1:$port
EOM
