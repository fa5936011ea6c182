#!/usr/bin/env bash
# Brings up a Nereid worker serving the example model repository and sends it real inferences
# (HTTP JSON with curl, and gRPC + HTTP with Python tritonclient). Leaves the worker running
# on 127.0.0.1:8000 (HTTP), :8001 (gRPC), :8002 (metrics) unless NEREID_QUICKSTART_STOP=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
cargo build --release --locked -p nereid-worker

HTTP_PORT="${HTTP_PORT:-8000}" GRPC_PORT="${GRPC_PORT:-8001}" METRICS_PORT="${METRICS_PORT:-8002}"
log="$root/target/quickstart-worker.log"
pkill -f "nereid-worker --model-repository $root/examples/models" 2>/dev/null || true
NEREID_ORT_LIB="$root/.deps/onnxruntime/libonnxruntime.so" \
  nohup "$root/target/release/nereid-worker" --model-repository "$root/examples/models" \
  --address 127.0.0.1 --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
  >"$log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  if curl -sf "http://127.0.0.1:$HTTP_PORT/v2/health/ready" >/dev/null; then break; fi
  kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "worker exited" >&2; exit 1; }
  sleep 0.2
done
curl -sf "http://127.0.0.1:$HTTP_PORT/v2/health/ready" >/dev/null || { cat "$log"; exit 1; }

echo "== worker $pid ready (log: $log)"
echo "== server metadata";  curl -s "http://127.0.0.1:$HTTP_PORT/v2"; echo
echo "== HTTP JSON inference (versioned_scale, latest version = x3)"
curl -s -X POST "http://127.0.0.1:$HTTP_PORT/v2/models/versioned_scale/infer" \
  -H 'Content-Type: application/json' \
  -d '{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'; echo
echo "== tritonclient (gRPC and HTTP) on mlp_fp32"
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
echo "== metrics sample"; curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep '^nv_inference_request_success' | head -5
if [ "${NEREID_QUICKSTART_STOP:-0}" = 1 ]; then kill -TERM "$pid"; wait "$pid" || true; echo "worker stopped"; else
  echo "worker still running (pid $pid): stop it with 'kill $pid'"; fi
