#!/usr/bin/env bash
# Create a Cloud TPU VM (one host) or a multi-host TPU slice for jserve, with the gcloud CLI.
# Runs on your workstation (or Cloud Shell), not on the TPU VM. See docs/tpu_vm.md.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: create_vm.sh --name NAME --zone ZONE [options] [-- EXTRA_GCLOUD_ARGS...]

Create a Cloud TPU VM with `gcloud compute tpus tpu-vm create` (the Create Node API: fails at
once if the zone has no capacity), or with --queued a queued resource
(`gcloud compute tpus queued-resources create`: waits in Google's queue until capacity frees up).

  --name NAME              TPU name (env TPU_NAME)
  --zone ZONE              zone, e.g. us-east5-b, europe-west4-a (env ZONE)
  --project PROJECT        Google Cloud project (env PROJECT_ID; default: gcloud's configured one)
  --accelerator-type TYPE  v6e-8 (default; one host, 8 chips), v5litepod-8, v5p-8, ... A slice larger
                           than one host (v6e-16, v5litepod-16, v5p-16, ...) gets one VM per host.
                           (env ACCELERATOR_TYPE)
  --version VERSION        TPU software (runtime) version (env RUNTIME_VERSION); default from the
                           accelerator type: v6e -> v2-alpha-tpuv6e, v5p -> v2-alpha-tpuv5,
                           v5litepod -> v2-alpha-tpuv5-lite, v4 and older -> tpu-ubuntu2204-base
  --tags TAGS              network tags for firewall rules (default: jserve; "" for none)
  --spot                   Spot capacity (cheaper, can be preempted at any time)
  --queued                 create a queued resource (node id = NAME) instead of a node
  --wait                   with --queued: poll until the queued resource is ACTIVE
  --allow-from CIDR        also create firewall rule jserve-allow-PORT: TCP PORT from CIDR to
                           instances tagged with the first tag (e.g. your IP as 203.0.113.7/32)
  --port PORT              port for --allow-from (default 8000)
  --network NETWORK        VPC network for the firewall rule (default: default)
  --dry-run                print the gcloud commands instead of running them
  -h, --help               this text

Examples:
  create_vm.sh --name jserve-v6e --zone us-east5-b --accelerator-type v6e-8
  create_vm.sh --name jserve-slice --zone us-east5-b --accelerator-type v6e-16 --queued --wait
USAGE
}

name="${TPU_NAME:-}" zone="${ZONE:-}" project="${PROJECT_ID:-}"
accel="${ACCELERATOR_TYPE:-v6e-8}" version="${RUNTIME_VERSION:-}" tags="jserve"
spot=0 queued=0 wait=0 allow_from="" port=8000 network="default" dry_run=0
extra=()

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name) need "$@"; name="$2"; shift 2 ;;
    --zone) need "$@"; zone="$2"; shift 2 ;;
    --project) need "$@"; project="$2"; shift 2 ;;
    --accelerator-type) need "$@"; accel="$2"; shift 2 ;;
    --version) need "$@"; version="$2"; shift 2 ;;
    --tags) [ $# -ge 2 ] || { echo "create_vm.sh: --tags needs a value" >&2; exit 2; }; tags="$2"; shift 2 ;;
    --spot) spot=1; shift ;;
    --queued) queued=1; shift ;;
    --wait) wait=1; shift ;;
    --allow-from) need "$@"; allow_from="$2"; shift 2 ;;
    --port) need "$@"; port="$2"; shift 2 ;;
    --network) need "$@"; network="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) unknown "$1" ;;
  esac
done
required --name "$name"
required --zone "$zone"
if [ -n "$allow_from" ] && [ -z "$tags" ]; then
  echo "create_vm.sh: --allow-from needs a network tag (--tags)" >&2; exit 2
fi

if [ -z "$version" ]; then
  case "$accel" in
    v6e-*) version="v2-alpha-tpuv6e" ;;
    v5p-*) version="v2-alpha-tpuv5" ;;
    v5litepod-*) version="v2-alpha-tpuv5-lite" ;;
    v2-*|v3-*|v4-*) version="tpu-ubuntu2204-base" ;;
    *) echo "create_vm.sh: no default --version for accelerator type $accel; give --version" >&2; exit 2 ;;
  esac
fi


common=(--zone="$zone")
[ -n "$project" ] && common+=(--project="$project")
opts=()  # bash 3.2 (macOS) and `set -u`: expand possibly-empty arrays as ${a[@]+"${a[@]}"}
[ -n "$tags" ] && opts+=(--tags="$tags")
[ "$spot" = 1 ] && opts+=(--spot)

if [ "$queued" = 1 ]; then
  run gcloud compute tpus queued-resources create "$name" "${common[@]}" --node-id="$name" \
    --accelerator-type="$accel" --runtime-version="$version" ${opts[@]+"${opts[@]}"} ${extra[@]+"${extra[@]}"}
  if [ "$wait" = 1 ] && [ "$dry_run" = 0 ]; then
    echo "waiting for queued resource $name to become ACTIVE (Ctrl-C stops waiting, not the request)" >&2
    while :; do
      state="$(gcloud compute tpus queued-resources describe "$name" "${common[@]}" --format='value(state.state)')"
      echo "  state: $state" >&2
      case "$state" in
        ACTIVE) break ;;
        FAILED|SUSPENDED) echo "create_vm.sh: queued resource $name is $state" >&2; exit 1 ;;
      esac
      sleep 30
    done
  fi
else
  run gcloud compute tpus tpu-vm create "$name" "${common[@]}" --accelerator-type="$accel" \
    --version="$version" ${opts[@]+"${opts[@]}"} ${extra[@]+"${extra[@]}"}
fi

if [ -n "$allow_from" ]; then
  fw=(--network="$network" --direction=INGRESS --allow="tcp:$port" --source-ranges="$allow_from"
      --target-tags="${tags%%,*}")
  [ -n "$project" ] && fw+=(--project="$project")
  run gcloud compute firewall-rules create "jserve-allow-$port" "${fw[@]}"
fi

[ "$dry_run" = 1 ] || cat >&2 <<EOM
created $name ($accel, $version) in $zone. Next:
  scripts/tpu_vm/deploy.sh --name $name --zone $zone --model MODEL    # install jserve, start the service
EOM
