#!/usr/bin/env bash
# Wait until a jserve server answers GET /health with 200 (it answers 503 while it loads and compiles
# every bucket), then send a 1-token POST /v1/completions. Exit 0 only if both succeed.
# Needs curl and python3. Runs anywhere that reaches the server: on the VM (deploy.sh runs it on
# worker 0), or on your workstation through an SSH tunnel or a firewall rule.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'USAGE'
usage: health_check.sh [--url URL] [--timeout SECONDS] [--interval SECONDS] [--model NAME]
                       [--env-file FILE] [--prompt TEXT]

  --url URL          server base URL (default: http://127.0.0.1:8000)
  --timeout SECONDS  how long to wait for /health to answer 200 (default: 1800; the first start
                     compiles every bucket, a restart reads the persistent compilation cache)
  --interval SECONDS between /health polls (default: 5)
  --model NAME       `model` for the completion (default: the first id from GET /v1/models)
  --env-file FILE    read JSERVE_API_KEY=... from FILE (e.g. /etc/jserve/env, needs root);
                     otherwise the JSERVE_API_KEY environment variable, if set, is the Bearer key
  --prompt TEXT      prompt for the test completion (default: "Hello")
  -h, --help         this text

Exit status: 0 healthy; 1 /health not 200 before the timeout, or the completion failed; 2 bad usage.
USAGE
}

url="http://127.0.0.1:8000" timeout=1800 interval=5 model="" env_file="" prompt="Hello"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --url) need "$@"; url="${2%/}"; shift 2 ;;
    --timeout) need "$@"; timeout="$2"; shift 2 ;;
    --interval) need "$@"; interval="$2"; shift 2 ;;
    --model) need "$@"; model="$2"; shift 2 ;;
    --env-file) need "$@"; env_file="$2"; shift 2 ;;
    --prompt) need "$@"; prompt="$2"; shift 2 ;;
    *) unknown "$1" ;;
  esac
done

key="${JSERVE_API_KEY:-}"
if [ -n "$env_file" ]; then
  # parse, never `source`: the file is data
  line="$(grep -E '^[[:space:]]*JSERVE_API_KEY=' "$env_file" | tail -n 1 || true)"
  key="${line#*=}"
  key="${key%\"}"; key="${key#\"}"; key="${key%\'}"; key="${key#\'}"
fi

# The key goes to curl through a config file on a pipe, never on a command line (visible in ps).
curl_auth() {
  if [ -n "$key" ]; then
    local k="${key//\\/\\\\}"
    k="${k//\"/\\\"}"
    curl --config <(printf 'header = "Authorization: Bearer %s"\n' "$k") "$@"
  else
    curl "$@"
  fi
}

deadline=$(( $(date +%s) + timeout ))
while :; do
  code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$url/health" || true)"
  [ "$code" = 200 ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "health_check.sh: $url/health did not answer 200 within ${timeout}s (last status: ${code:-none})" >&2
    exit 1
  fi
  echo "waiting for $url/health (status ${code:-none})" >&2
  sleep "$interval"
done
echo "$url/health: 200" >&2

tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
if [ -z "$model" ]; then
  code="$(curl_auth -s -o "$tmp" -w '%{http_code}' --max-time 30 "$url/v1/models" || true)"
  if [ "$code" != 200 ]; then
    echo "health_check.sh: GET /v1/models answered ${code:-nothing}: $(head -c 500 "$tmp")" >&2
    exit 1
  fi
  model="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["data"][0]["id"])' "$tmp")"
fi

body="$(python3 -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": 1, "temperature": 0}))' "$model" "$prompt")"
code="$(curl_auth -s -o "$tmp" -w '%{http_code}' --max-time 300 -H 'Content-Type: application/json' \
  -d "$body" "$url/v1/completions" || true)"
if [ "$code" != 200 ]; then
  echo "health_check.sh: POST /v1/completions answered ${code:-nothing}: $(head -c 500 "$tmp")" >&2
  exit 1
fi
if ! text="$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(repr(r["choices"][0]["text"]), r.get("usage", {}))' "$tmp")"; then
  echo "health_check.sh: unexpected completion body: $(head -c 500 "$tmp")" >&2
  exit 1
fi
echo "ok: model $model answered $text"
