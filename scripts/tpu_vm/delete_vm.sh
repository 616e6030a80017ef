#!/usr/bin/env bash
# Delete a Cloud TPU VM or slice (and optionally the firewall rule create_vm.sh made) so that
# billing stops. A TPU VM is billed while it exists, whether or not jserve is running.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: delete_vm.sh --name NAME --zone ZONE [--project PROJECT] [--queued] [--firewall-rule RULE]
                    [--yes] [--dry-run]

  --name NAME            TPU name (env TPU_NAME)
  --zone ZONE            zone (env ZONE)
  --project PROJECT      (env PROJECT_ID)
  --queued               NAME is a queued resource: `gcloud compute tpus queued-resources delete
                         NAME --force` deletes its TPU VMs and then the request
  --firewall-rule RULE   also delete this firewall rule (e.g. jserve-allow-8000)
  --yes                  do not ask gcloud for confirmation (--quiet)
  --dry-run              print the gcloud commands instead of running them
  -h, --help             this text

Afterwards `gcloud compute tpus tpu-vm list --zone=ZONE` (and `queued-resources list`) should not
show NAME. Checkpoints you copied to a GCS bucket stay (and are billed) until you delete them.
USAGE
}

name="${TPU_NAME:-}" zone="${ZONE:-}" project="${PROJECT_ID:-}" queued=0 rule="" yes=0 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name) need "$@"; name="$2"; shift 2 ;;
    --zone) need "$@"; zone="$2"; shift 2 ;;
    --project) need "$@"; project="$2"; shift 2 ;;
    --queued) queued=1; shift ;;
    --firewall-rule) need "$@"; rule="$2"; shift 2 ;;
    --yes) yes=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) unknown "$1" ;;
  esac
done
required --name "$name"
required --zone "$zone"

common=(--zone="$zone")
[ -n "$project" ] && common+=(--project="$project")
[ "$yes" = 1 ] && common+=(--quiet)

if [ "$queued" = 1 ]; then
  run gcloud compute tpus queued-resources delete "$name" "${common[@]}" --force
else
  run gcloud compute tpus tpu-vm delete "$name" "${common[@]}"
fi
if [ -n "$rule" ]; then
  fw=()
  [ -n "$project" ] && fw+=(--project="$project")
  [ "$yes" = 1 ] && fw+=(--quiet)
  run gcloud compute firewall-rules delete "$rule" ${fw[@]+"${fw[@]}"}
fi
