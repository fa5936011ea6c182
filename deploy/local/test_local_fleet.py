"""deploy/local/up.sh end to end: etcd + 2 workers + gateway on free loopback ports, the example
models declared and placed, real inferences through the gateway (curl and tritonclient), then
deploy/local/down.sh. Uses the debug binaries the test suite already built (nereid-worker,
nereid-gateway, nereidctl)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def up(env: dict) -> subprocess.CompletedProcess:
    """Runs up.sh; whatever happens (a timeout kills bash before its EXIT trap runs), what it
    started is stopped afterwards with down.sh."""
    try:
        return subprocess.run(
            ["bash", str(ROOT / "deploy/local/up.sh")], env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        subprocess.run(["bash", str(ROOT / "deploy/local/down.sh")], env=env, capture_output=True, timeout=120)


def fleet_env(tmp_path, http, grpc, metrics, etcd, peer) -> dict:
    return dict(
        os.environ,
        NEREID_BUILD_PROFILE="debug",
        # scripts/test.sh built the workspace already; a `-p` build would unify features
        # differently and rebuild both crates.
        NEREID_LOCAL_NO_BUILD="1",
        NEREID_LOCAL_STOP="1",
        NEREID_LOCAL_DIR=str(tmp_path / "fleet"),
        HTTP_PORT=str(http),
        GRPC_PORT=str(grpc),
        METRICS_PORT=str(metrics),
        ETCD_PORT=str(etcd),
        ETCD_PEER_PORT=str(peer),
    )


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    # Someone else's etcd (e.g. Debian's etcd.service) on the etcd port: up.sh must not take its
    # health answer for its own etcd's.
    http, grpc, metrics, etcd, peer = free_ports(5)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", etcd))
        squatter.listen()
        run = up(fleet_env(tmp_path, http, grpc, metrics, etcd, peer))
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert f"127.0.0.1:{etcd} is already in use" in out, out
    assert not list((tmp_path / "fleet").glob("*.pid")), "nothing was left running"
    for port in (http, grpc, metrics):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} answers"


def test_up_serves_every_example_model_through_the_gateway_and_down_stops_it(tmp_path):
    http, grpc, metrics, etcd, peer = free_ports(5)
    env = fleet_env(tmp_path, http, grpc, metrics, etcd, peer)
    run = up(env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "== fleet up" in out, out
    # The JSON inference through the gateway answered with version 2 (x3).
    assert '"data":[3.0,6.0,9.0,12.0]' in out, out
    # The ensemble: SCALED6 = x * 6.
    assert '"name":"SCALED6","datatype":"FP32","shape":[1,4],"data":[6.0,12.0,18.0,24.0]' in out, out
    assert "tritonclient.grpc: OUTPUT0 shape (2, 10)" in out, out
    assert "tritonclient.http: OUTPUT0 shape (2, 10)" in out, out
    assert "nereid_gateway_placement_leader 1" in out, out
    assert 'nereid_gateway_workers{state="ready"} 2' in out, out
    assert "fleet stopped" in out, out
    # Everything it started is gone: the ports are free again.
    for port in (http, grpc, metrics, etcd):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    # The workers drained and left etcd on SIGTERM.
    for i in range(2):
        log = (tmp_path / "fleet" / f"worker-{i}.log").read_text()
        assert "lease revoked" in log, log
