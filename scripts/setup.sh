#!/usr/bin/env bash
# Installs everything Nereid needs to build, run and test, into the system (apt) or into
# project-local, git-ignored folders (.deps/, .venv/). Idempotent: a second run does nothing
# that the first already did.
#
#   protoc                 apt: protobuf-compiler (tonic/prost codegen)
#   ONNX Runtime 1.31.1    the official PyPI wheel's shared library → .deps/onnxruntime/
#   Python test clients    tritonclient[http,grpc], onnx, onnxruntime, numpy → .venv/
#   example models         examples/generate_models.py → examples/models/*/<version>/model.onnx
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ORT_VERSION="${ORT_VERSION:-1.31.1}"
PY="${PYTHON:-python3}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    log "installing system packages needs root: run this as root, or install sudo"
    exit 1
  fi
}

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    # A freshly booted machine may be running its own apt jobs (unattended-upgrades, cloud-init):
    # wait for their lock rather than fail at once.
    local lock=(-o DPkg::Lock::Timeout=600)
    as_root apt-get "${lock[@]}" update -qq
    # Through env: sudo's env_reset would drop a variable set in front of it.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq "${missing[@]}" >/dev/null
    # Debian's etcd-server starts a system etcd on 127.0.0.1:2379 where systemd runs; Nereid
    # starts its own etcd (the tests on free ports, deploy/local/up.sh on 2379), so the one
    # installed here is stopped and kept from starting at boot. An etcd that was already
    # installed is left alone.
    if [[ " ${missing[*]} " == *" etcd-server "* ]]; then
      if [ -d /run/systemd/system ]; then
        log "stopping and disabling the system etcd service the etcd-server package started"
        as_root systemctl disable --now etcd >/dev/null 2>&1 || true
      elif [ -x /etc/init.d/etcd ]; then
        # Without systemd the package's init script may have started it (where no policy-rc.d
        # forbids it).
        as_root /etc/init.d/etcd stop >/dev/null 2>&1 || true
      fi
    fi
  fi
}

# Rust: the workspace's rust-version (Debian's own rustc is older). Not needed to run binaries
# built elsewhere (NEREID_LOCAL_NO_BUILD=1: deploy/local/up.sh on a host without Rust).
need_rust="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)"
have_rust="$( (cargo --version 2>/dev/null || true) | awk '{print $2}')"
if [ "${NEREID_LOCAL_NO_BUILD:-0}" != 1 ] && { [ -z "$have_rust" ] || [ "$(printf '%s\n%s\n' "$need_rust" "$have_rust" | sort -V | head -1)" != "$need_rust" ]; }; then
  echo "setup: Rust >= $need_rust is needed (found: ${have_rust:-no cargo}); install it with rustup: https://rustup.rs" >&2
  exit 1
fi

# python3-venv / pip for the project's venv, curl for deploy/local/up.sh.
apt_install build-essential protobuf-compiler etcd-server etcd-client python3-venv python3-pip curl ca-certificates ${NEREID_EXTRA_APT:-}

# The project's venv exists before anything is fetched with its pip. One whose interpreter or pip
# does not run (the system Python it points at was upgraded or removed; a venv made before
# python3-venv was installed, or interrupted, has no pip) is made again from scratch, packages
# included.
venv="$root/.venv"
if [ -e "$venv" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  log "the python venv at .venv is broken (its interpreter or pip does not run): making it again"
  rm -rf "$venv"
fi
[ -x "$venv/bin/python" ] || { log "python venv at .venv"; "$PY" -m venv "$venv"; }

# ONNX Runtime: the shared library out of the official wheel (no unversioned .so inside).
ort_dir="$root/.deps/onnxruntime"
ort_lib="$ort_dir/libonnxruntime.so.$ORT_VERSION"
if [ ! -f "$ort_lib" ]; then
  log "fetching onnxruntime==$ORT_VERSION wheel"
  tmp="$(mktemp -d)"
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: "onnxruntime==$ORT_VERSION" -d "$tmp"
  (cd "$tmp" && "$PY" -m zipfile -e ./*.whl x)
  mkdir -p "$ort_dir"
  cp "$tmp/x/onnxruntime/capi/libonnxruntime.so.$ORT_VERSION" "$ort_lib.part"
  mv "$ort_lib.part" "$ort_lib"
  rm -rf "$tmp"
fi
ln -sf "libonnxruntime.so.$ORT_VERSION" "$ort_dir/libonnxruntime.so"

# The venv's packages: the real clients used by the compatibility tests. requirements.txt names
# what the tests use; constraints.txt pins everything those pull in (grpcio, protobuf, ...), so
# a later release of a dependency cannot change what the tests run against. The stamp holds
# both files: a change to either reinstalls.
stamp="$venv/.nereid-requirements"
req="$root/scripts/requirements.txt"
constraints="$root/scripts/constraints.txt"
if [ ! -f "$stamp" ] || ! cat "$req" "$constraints" | cmp -s - "$stamp"; then
  log "python packages in .venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -r "$req" -c "$constraints"
  cat "$req" "$constraints" > "$stamp"
fi

# Example models: deterministic, and the generator rewrites only a file whose bytes differ
# (well under a second), so it runs every time — a deleted or damaged model comes back.
gen="$root/examples/generate_models.py"
if [ -f "$gen" ]; then
  "$venv/bin/python" "$gen" --quiet --out "$root/examples/models"
  rm -f "$root/examples/models/.generated" # the stamp earlier versions of this script kept
fi

log "ready: ORT=$ort_lib venv=$venv"
