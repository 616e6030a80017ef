# Sourced by scripts/serve.sh and scripts/tpu_vm/install.sh: which JAX build a machine wants.
#   hardware_platform  prints what this machine has: tpu, cuda or cpu (the first found, in that order)
#   detect_platform    prints $JSERVE_PLATFORM when it is set (cpu, tpu or cuda; anything else is a
#                      one-line error, status 2), else hardware_platform
#   platform_extra P   prints platform P's pip extra (pyproject.toml): nothing for cpu, [tpu], [cuda]
# The signs, as JAX and libtpu look for them: a TPU is /dev/accel* (v2-v4, v5p), a Google TPU PCI
# device (vendor 0x1ae0), or the TPU_ACCELERATOR_TYPE / TPU_WORKER_ID that GKE and LeaderWorkerSet
# give a TPU pod; an NVIDIA GPU is nvidia-smi on PATH, /dev/nvidia0 or /proc/driver/nvidia; numbered
# /dev/vfio groups (v5e, v6e) count as a TPU only where no GPU was seen. /dev, /sys and /proc are
# read under $JSERVE_DEV_ROOT (default /), so that tests can lay out fake ones.

# JAX's list (jax/_src/hardware_utils.py): v2/v3, plc, v4, v5p, v5e, v6e, tpu7x
_TPU_PCI_DEVICE_IDS=" 0x0027 0x0056 0x005e 0x0062 0x0063 0x006f 0x0076 "

_has_tpu_pci() {
  local dev vendor device
  for dev in "${JSERVE_DEV_ROOT:-}"/sys/bus/pci/devices/*; do
    [ -r "$dev/vendor" ] && [ -r "$dev/device" ] || continue
    read -r vendor < "$dev/vendor" || continue
    read -r device < "$dev/device" || continue
    [ "$vendor" = 0x1ae0 ] && [[ "$_TPU_PCI_DEVICE_IDS" == *" $device "* ]] && return 0
  done
  return 1
}

_exists() {  # _exists GLOB: some path matches it
  compgen -G "$1" >/dev/null
}

hardware_platform() {
  local root="${JSERVE_DEV_ROOT:-}"
  if _exists "$root/dev/accel[0-9]*" || _has_tpu_pci || [ -n "${TPU_ACCELERATOR_TYPE:-}" ] \
     || [ -n "${TPU_WORKER_ID:-}" ]; then
    echo tpu
  elif command -v nvidia-smi >/dev/null 2>&1 || [ -e "$root/dev/nvidia0" ] || [ -d "$root/proc/driver/nvidia" ]; then
    echo cuda
  elif _exists "$root/dev/vfio/[0-9]*"; then
    echo tpu
  else
    echo cpu
  fi
}

detect_platform() {
  case "${JSERVE_PLATFORM:-}" in
    "") hardware_platform ;;
    cpu|tpu|cuda) echo "$JSERVE_PLATFORM" ;;
    *) echo "${0##*/}: JSERVE_PLATFORM=$JSERVE_PLATFORM is not a platform: give cpu, tpu or cuda" >&2; return 2 ;;
  esac
}

platform_extra() {
  case "$1" in
    cpu) echo "" ;;
    tpu|cuda) echo "[$1]" ;;
    *) echo "${0##*/}: no platform $1 (cpu, tpu or cuda)" >&2; return 2 ;;
  esac
}
