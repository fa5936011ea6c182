#!/usr/bin/env bash
# Stops the fleet deploy/local/up.sh started: gateway and workers with SIGTERM (workers drain and
# leave etcd), then etcd. Waits (bounded) for each to exit.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
state="${NEREID_LOCAL_DIR:-$root/target/local-fleet}"
[ -d "$state" ] || { echo "no fleet state in $state"; exit 0; }
stop() { # name
  local f="$state/$1.pid"
  [ -f "$f" ] || return 0
  local pid; pid="$(cat "$f")"
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}
stop gateway
for f in "$state"/worker-*.pid; do [ -e "$f" ] && stop "$(basename "$f" .pid)"; done
stop etcd
echo "fleet stopped (logs in $state)"
