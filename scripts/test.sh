#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs (scripts/setup.sh), builds,
# runs the Rust tests (unit, property, integration against real ONNX Runtime and real worker
# processes) and the Python compatibility tests (real tritonclient against a real worker).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# A clean build and test run needs about 4 GiB (target/ ~2.3 GiB, .deps and .venv ~0.4 GiB, test
# scratch). Say so up front rather than failing mid-link with "No space left on device".
free_kib=$(df -Pk "$root" | awk 'NR == 2 {print $4}')
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((4 * 1024 * 1024)) ]; then
  echo "warning: only $((free_kib / 1024)) MiB free on $(df -P "$root" | awk 'NR == 2 {print $6}');" \
    "a clean build and test run needs about 4 GiB" >&2
fi

bash scripts/setup.sh
export NEREID_ORT_LIB="$root/.deps/onnxruntime/libonnxruntime.so"

echo "== cargo build"
cargo build --workspace --all-targets --locked

echo "== rust tests"
# The end-to-end tests start the worker binary built above; here a missing binary is a failure,
# not a skip.
export NEREID_REQUIRE_WORKER=1
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  echo "== python compatibility tests (tritonclient)"
  # --timeout: a hung test fails on its own after 10 minutes (pytest-timeout) instead of holding
  # the run until CI's limit kills everything without a report.
  NEREID_WORKER_BIN="$root/target/debug/nereid-worker" \
    .venv/bin/python -m pytest -q --timeout 600 tests/python gateway/tests/python examples/test_generated_models.py deploy
fi

echo "== cuda build: the GPU code compiles, and its GPU tests skip where there is no GPU"
# (On a GPU host with onnxruntime-gpu's library, NEREID_REQUIRE_GPU=1 makes them run or fail.)
# Last: it rebuilds target/debug/nereid-worker with the feature, and the tests above use the
# default build.
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run -p nereid-worker --features cuda --locked --test gpu --lib
else
  cargo test -p nereid-worker --features cuda --locked --test gpu --lib
fi
