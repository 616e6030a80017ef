# Sourced by the scripts beside it (deploy.sh copies it to the VM with them): the lines they share.
#   need "$@"        in an option's case branch: the option has a non-empty value, else a usage error
#   required F VAL   VAL is not empty, else "F is required"
#   unknown ARG      a usage error for an argument no branch took
#   run CMD...       runs CMD, or with dry_run=1 prints it (shell-quoted) instead
prog="$(basename "$0")"
die() { echo "$prog: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }
required() { [ -n "$2" ] || die "$1 is required (see -h)"; }
unknown() { die "unknown argument: $1 (see -h)"; }
run() {
  if [ "${dry_run:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
