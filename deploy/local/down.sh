#!/usr/bin/env bash
# Stops the fleet deploy/local/up.sh started: gateway and workers with SIGTERM (workers drain and
# leave etcd), then etcd. Waits (bounded) for each to exit.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
state="${NEREID_LOCAL_DIR:-$root/target/local-fleet}"
[ -d "$state" ] || { echo "no fleet state in $state"; exit 0; }
# Whether process `pid` still runs the program `program` (a pid file that outlived its process —
# a reboot, a crash — may name an unrelated process by now).
runs() { # pid program
  local exe; exe="$(readlink "/proc/$1/exe" 2>/dev/null)" || return 1
  [ "$(basename "${exe% (deleted)}")" = "$2" ]
}
stop() { # name program seconds-before-SIGKILL
  local f="$state/$1.pid" tenths=$(($3 * 10))
  [ -f "$f" ] || return 0
  local pid; pid="$(cat "$f")"
  if ! runs "$pid" "$2"; then
    rm -f "$f"
    return 0
  fi
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 "$tenths"); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}
# Past their own drain bounds (a worker's: draining mark 3 s + drain delay 1 s + the default
# --exit-timeout-secs 30 + lease revoke 5 s + build stop 2 s = 41 s), so that a
# worker with requests in flight finishes them and revokes its lease before any SIGKILL.
stop gateway nereid-gateway 45
for f in "$state"/worker-*.pid; do [ -e "$f" ] && stop "$(basename "$f" .pid)" nereid-worker 45; done
stop etcd etcd 15
echo "fleet stopped (logs in $state)"
