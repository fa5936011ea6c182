#!/usr/bin/env bash
# Brings up a whole Nereid fleet on loopback: etcd, N workers registered in it, and a gateway
# (with the placement controller) in front; declares the example models, waits until the
# gateway routes every one of them, and sends real inferences through the gateway.
#
#   bash deploy/local/up.sh            # 2 workers, gateway on 127.0.0.1:8000 (HTTP) / 8001 (gRPC) / 8002 (metrics)
#   bash deploy/local/down.sh          # stops everything it started
#
# Environment: WORKERS (2), HTTP_PORT/GRPC_PORT/METRICS_PORT (8000/8001/8002), ETCD_PORT (2379),
# ETCD_PEER_PORT (2380), NEREID_BUILD_PROFILE (release | debug), NEREID_LOCAL_NO_BUILD=1 (use
# the binaries already built — the test suite's), NEREID_LOCAL_STOP=1 (stop the
# fleet again after the demo — used by the test suite), NEREID_LOCAL_DIR (state: logs, pids,
# etcd data; default target/local-fleet). Idempotent: a running fleet from this folder is
# stopped first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

WORKERS="${WORKERS:-2}"
HTTP_PORT="${HTTP_PORT:-8000}" GRPC_PORT="${GRPC_PORT:-8001}" METRICS_PORT="${METRICS_PORT:-8002}"
ETCD_PORT="${ETCD_PORT:-2379}" ETCD_PEER_PORT="${ETCD_PEER_PORT:-2380}"
PROFILE="${NEREID_BUILD_PROFILE:-release}"
state="${NEREID_LOCAL_DIR:-$root/target/local-fleet}"
endpoint="http://127.0.0.1:$ETCD_PORT"

# Messages go to the terminal's stderr as it was at start (fd 9), also from inside checks whose
# own output is silenced.
exec 9>&2
log() { printf '\033[1m[local]\033[0m %s\n' "$*" >&9; }
die() { log "$*"; exit 1; }

bash scripts/setup.sh
bin="$root/target/$PROFILE"
if [ "${NEREID_LOCAL_NO_BUILD:-0}" = 1 ] && [ -x "$bin/nereid-worker" ] && [ -x "$bin/nereid-gateway" ] && [ -x "$bin/nereidctl" ]; then
  log "using the binaries already in $bin (NEREID_LOCAL_NO_BUILD=1)"
elif [ "${NEREID_LOCAL_NO_BUILD:-0}" = 1 ] && ! command -v cargo >/dev/null 2>&1; then
  die "NEREID_LOCAL_NO_BUILD=1 but $bin lacks nereid-worker, nereid-gateway or nereidctl, and there is no cargo to build them"
elif [ "$PROFILE" = release ]; then
  cargo build --release --locked -p nereid-worker -p nereid-gateway
else
  cargo build --locked -p nereid-worker -p nereid-gateway
fi

NEREID_LOCAL_DIR="$state" bash "$root/deploy/local/down.sh" >/dev/null 2>&1 || true
# Only a folder this script made is emptied (NEREID_LOCAL_DIR could name any folder).
marker="$state/.nereid-local-fleet"
if [ "$state" != "$root/target/local-fleet" ] && [ -d "$state" ] && [ ! -e "$marker" ] \
  && [ -n "$(ls -A "$state" 2>/dev/null)" ]; then
  die "$state is not empty and was not made by this script: choose another NEREID_LOCAL_DIR"
fi
rm -rf "$state/etcd"
rm -f "$state"/*.log "$state"/*.pid "$state"/*.ports
mkdir -p "$state"
touch "$marker"

# Every port must be free: an etcd already on ETCD_PORT (Debian's etcd-server package starts
# etcd.service on 2379 where systemd runs) would answer our health check with its own, possibly
# stale, data.
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in "$ETCD_PORT" "$ETCD_PEER_PORT" "$HTTP_PORT" "$GRPC_PORT" "$METRICS_PORT"; do
  if port_in_use "$port"; then
    die "127.0.0.1:$port is already in use (by another etcd, e.g. Debian's etcd.service, or an earlier fleet?); \
free it or choose other ports: ETCD_PORT, ETCD_PEER_PORT, HTTP_PORT, GRPC_PORT, METRICS_PORT"
  fi
done

# A failure part-way stops what was started, so nothing is left running behind an error.
up_ok=0
on_exit() {
  if [ "$up_ok" != 1 ]; then
    log "start-up failed: stopping what was started (logs: $state)"
    NEREID_LOCAL_DIR="$state" bash "$root/deploy/local/down.sh" >/dev/null 2>&1 || true
  fi
}
trap on_exit EXIT

start() { # name, then the command: runs it in the background, remembers its pid
  local name="$1"; shift
  # Neither the caller's stdin nor its stderr (fd 9) stays open in a process that outlives this
  # script: `quickstart.sh 2>&1 | tee log`, `$(...)` or ssh would otherwise wait for the fleet
  # to stop.
  nohup "$@" >"$state/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$state/$name.pid"
}

wait_for() { # what, seconds, command...
  local what="$1" secs="$2"; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "timed out waiting for $what (logs: $state)"
    sleep 0.2
  done
}

log "etcd on $endpoint"
start etcd etcd --name local --data-dir "$state/etcd" \
  --listen-client-urls "$endpoint" --advertise-client-urls "$endpoint" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT"
etcd_healthy() {
  kill -0 "$(cat "$state/etcd.pid")" 2>/dev/null || die "etcd exited: see $state/etcd.log"
  curl -sf "$endpoint/health" | grep -q '"health":"true"'
}
wait_for "etcd" 30 etcd_healthy

for i in $(seq 0 $((WORKERS - 1))); do
  log "worker-$i"
  start "worker-$i" env NEREID_ORT_LIB="$root/.deps/onnxruntime/libonnxruntime.so" \
    "$bin/nereid-worker" --model-repository "$root/examples/models" --model-control-mode explicit \
    --address 127.0.0.1 --http-port 0 --grpc-port 0 --metrics-port 0 --port-file "$state/worker-$i.ports" \
    --etcd-endpoints "$endpoint" --worker-id "worker-$i" --label "zone=local"
done

log "gateway on 127.0.0.1:$HTTP_PORT (HTTP) / $GRPC_PORT (gRPC) / $METRICS_PORT (metrics)"
start gateway "$bin/nereid-gateway" --etcd-endpoints "$endpoint" --gateway-id gateway-0 \
  --address 127.0.0.1 --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT"

# Declare the example models (what the placement controller assigns to workers).
ctl() { "$bin/nereidctl" --etcd-endpoints "$endpoint" "$@"; }
ctl model declare identity_fp32 --versions 1 --replicas "$WORKERS" >/dev/null
ctl model declare mlp_fp32 --versions 1 --replicas "$WORKERS" --memory-mb 64 >/dev/null
ctl model declare convnet_fp32 --versions 1 --replicas 1 --memory-mb 64 >/dev/null
ctl model declare versioned_scale --versions 1,2 --replicas 1 >/dev/null
ctl model declare mixed_types --versions 1 --replicas 1 >/dev/null
ctl model declare string_len --versions 1 --replicas 1 >/dev/null
ctl model declare autocomplete_add --versions 1 --replicas 1 >/dev/null
# An ensemble: the worker it lands on loads its composing model (versioned_scale) too.
ctl model declare scale_ensemble --versions 1 --replicas 1 >/dev/null

ready_count() {
  curl -sf -X POST "http://127.0.0.1:$HTTP_PORT/v2/repository/index" -d '{"ready":true}' |
    python3 -c 'import json,sys; print(len({(m["name"], m["version"]) for m in json.load(sys.stdin)}))'
}
all_ready() {
  # A process that died fails the wait at once, naming its log, rather than at its end.
  for f in "$state"/*.pid; do
    kill -0 "$(cat "$f")" 2>/dev/null || die "$(basename "$f" .pid) exited: see $state/$(basename "$f" .pid).log"
  done
  [ "$(ready_count)" = 9 ]
}
wait_for "the gateway to route all 9 model versions" 180 all_ready
for f in "$state"/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null || die "$(basename "$f" .pid) exited: see $state"; done

url="127.0.0.1:$HTTP_PORT"
echo "== fleet up: etcd $endpoint, $WORKERS workers, gateway http://$url grpc 127.0.0.1:$GRPC_PORT (state: $state)"
echo "== repository index through the gateway"
curl -s -X POST "http://$url/v2/repository/index"; echo
echo "== HTTP JSON inference through the gateway (versioned_scale, latest version = x3)"
curl -s -X POST "http://$url/v2/models/versioned_scale/infer" -H 'Content-Type: application/json' \
  -d '{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'; echo
echo "== an ensemble through the gateway (scale_ensemble: x2 then x3, and x3)"
curl -s -X POST "http://$url/v2/models/scale_ensemble/infer" -H 'Content-Type: application/json' \
  -d '{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'; echo
echo "== tritonclient (gRPC and HTTP) on mlp_fp32 through the gateway"
.venv/bin/python - "$HTTP_PORT" "$GRPC_PORT" <<'PY'
import sys, numpy as np
import tritonclient.grpc as grpcclient, tritonclient.http as httpclient
http_port, grpc_port = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).standard_normal((2, 256), dtype=np.float32)
for mod, url in ((grpcclient, f"127.0.0.1:{grpc_port}"), (httpclient, f"127.0.0.1:{http_port}")):
    c = mod.InferenceServerClient(url)
    i = mod.InferInput("INPUT0", list(x.shape), "FP32"); i.set_data_from_numpy(x)
    out = c.infer("mlp_fp32", [i]).as_numpy("OUTPUT0")
    print(f"{mod.__name__}: OUTPUT0 shape {out.shape}, argmax {out.argmax(axis=1).tolist()}")
PY
echo "== the fleet (nereidctl workers)"
ctl workers
echo "== gateway metrics sample"
curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^nereid_gateway_(workers|placement_leader|etcd_watch_connected)' || true

up_ok=1
if [ "${NEREID_LOCAL_STOP:-0}" = 1 ]; then
  NEREID_LOCAL_DIR="$state" bash "$root/deploy/local/down.sh"
else
  cat <<TXT
== the fleet keeps running. Try:
   curl -s -X POST http://$url/v2/models/identity_fp32/infer -d '{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[$(seq -s, 1 16)]}]}'
   .deps/perf_analyzer/perf_analyzer.sh -m mlp_fp32 -u 127.0.0.1:$GRPC_PORT -i grpc   # after: bash bench/setup_perf_analyzer.sh
   target/$PROFILE/nereidctl --etcd-endpoints $endpoint models        # also: workers, placement, drain, routes
   curl -s http://127.0.0.1:$METRICS_PORT/metrics | grep nereid_gateway
   stop:  bash deploy/local/down.sh
TXT
fi
