"""The validator passes the real manifests and fails, naming the problem, on broken copies.

Run: .venv/bin/python -m pytest deploy/k8s -q
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
VALIDATOR = HERE / "validate.py"
REPO = HERE.parent.parent
MANIFESTS = sorted(p.name for p in HERE.glob("*.yaml"))
# The test suite (scripts/test.sh) builds the binaries first: there, a missing one is a failure.
REQUIRE_BINARIES = os.environ.get("NEREID_REQUIRE_WORKER") == "1"


def no_binary(what: str) -> None:
    if REQUIRE_BINARIES:
        pytest.fail(f"{what} (NEREID_REQUIRE_WORKER=1: the test suite builds them first)")
    pytest.skip(what)


def load_validator():
    spec = importlib.util.spec_from_file_location("nereid_k8s_validate", VALIDATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def validate(directory: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(VALIDATOR), str(directory), *extra],
                          capture_output=True, text=True, timeout=120)


def copy_manifests(tmp_path: Path) -> Path:
    d = tmp_path / "k8s"
    d.mkdir()
    for name in MANIFESTS:
        shutil.copy(HERE / name, d / name)
    return d


def edit(directory: Path, file: str, change) -> None:
    """Load every document of `file`, let `change(docs)` mutate them, write them back."""
    path = directory / file
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def find(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] == kind)


def container(docs: list[dict], kind: str = "Deployment") -> dict:
    return find(docs, kind)["spec"]["template"]["spec"]["containers"][0]


def assert_fails_with(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [l for l in result.stdout.splitlines() if l.startswith("error:")]
    assert any(all(n in l for n in needles) for l in errors), \
        f"no error line contains {needles}:\n{result.stdout}"


# --- the real manifests --------------------------------------------------------------------

def test_real_manifests_pass_with_builtin_flags():
    r = validate(HERE, "--flags-from", "builtin")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flags from the validator's built-in list" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("ok: ")


def test_real_manifests_pass_against_built_binaries():
    """With target/ holding built binaries, their own --help decides which flags exist."""
    if not any((REPO / "target" / p / b).is_file()
               for p in ("debug", "release") for b in ("nereid-worker", "nereid-gateway")):
        no_binary("no nereid binary built under target/")
    # Where the binaries must exist, every flag set comes from one (no built-in fallback).
    r = validate(HERE, "--flags-from", "binary" if REQUIRE_BINARIES else "auto")
    assert r.returncode == 0, r.stdout + r.stderr


def test_builtin_flag_list_knows_every_flag_of_the_built_binaries():
    """Keeps the fallback list honest: a flag the binaries gained must be added to it."""
    v = load_validator()
    checked = 0
    for binary in v.NEREID_BINARIES:
        path = v.find_binary(binary, None)
        if path is None:
            if REQUIRE_BINARIES:
                pytest.fail(f"{binary} is not built (NEREID_REQUIRE_WORKER=1)")
            continue
        out = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
        parsed = v.parse_help(binary, out.stdout, "test")
        missing = set(parsed.flags) - set(v.BUILTIN_FLAGS[binary])
        assert not missing, f"{binary} accepts {sorted(missing)}; add them to BUILTIN_FLAGS"
        checked += 1
    if not checked:
        no_binary("no nereid binary built under target/")


def test_help_parsing_reads_arity_choices_and_required_flags(tmp_path):
    """A stand-in binary whose --help is clap's format: its flags, not the built-in list, apply."""
    fake = tmp_path / "nereid-worker"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\nUsage: nereid-worker [OPTIONS] --model-repository <DIR>\n\n"
                    "Options:\n      --model-repository <DIR>\n          Model repository\n\n"
                    "      --model-control-mode <MODE>\n          Mode\n\n          Possible values:\n"
                    "          - none:     Load all\n          - explicit: Load some\n\n"
                    "      --allow-http [<BOOL>]\n          Serve HTTP\n          [possible values: true, false]\n\n"
                    "  -h, --help\n          Print help\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = validate(HERE, "--worker-bin", str(fake), "--no-kubectl")
    assert f"flags from `{fake} --help`" in r.stdout
    # The real manifests use flags this stand-in does not have, and a mode it does not offer.
    assert_fails_with(r, "unknown flag --etcd-endpoints", str(fake))
    v = load_validator()
    fs = v.parse_help("nereid-worker", subprocess.run([str(fake)], capture_output=True, text=True).stdout, "x")
    assert fs.required == {"model-repository"}
    assert fs.flags["model-control-mode"] == ("value", ("none", "explicit"))
    assert fs.flags["allow-http"] == ("optional", ("true", "false"))
    assert fs.flags["help"] == ("none", None)


# --- broken copies: each must fail, naming the problem --------------------------------------

def test_unmodified_copy_passes(tmp_path):
    """The copies below fail because of their one change, not because of the copying."""
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml", lambda docs: None)  # a YAML round trip, as every edit does
    r = validate(d, "--flags-from", "builtin")
    assert r.returncode == 0, r.stdout + r.stderr


def test_unquoted_annotation_value(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml", lambda docs: find(docs, "Deployment")["spec"]["template"]["metadata"]
         ["annotations"].update({"prometheus.io/scrape": True}))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Deployment/nereid-worker-cpu",
                      "['prometheus.io/scrape'] = True must be a string")

def test_unknown_flag(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml", lambda docs: container(docs)["args"].append("--max-batch=8"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-cpu.yaml",
                      "unknown flag --max-batch", "nereid-worker does not accept it")


def test_bad_value_of_a_closed_flag(tmp_path):
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        args[args.index("--model-control-mode=explicit")] = "--model-control-mode=lazy"
    edit(d, "worker-cpu.yaml", change)
    assert_fails_with(validate(d, "--flags-from", "builtin"),
                      "--model-control-mode=lazy", "not one of none, poll, explicit")


def test_closed_flag_values_in_any_case(tmp_path):
    # The worker takes tritonserver's values in any case; so does the check.
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        args[args.index("--model-control-mode=explicit")] = "--model-control-mode=EXPLICIT"
    edit(d, "worker-cpu.yaml", change)
    result = validate(d, "--flags-from", "builtin")
    assert result.returncode == 0, result.stdout + result.stderr


def test_probe_on_undeclared_port(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml",
         lambda docs: container(docs)["readinessProbe"]["httpGet"].update(port=9000))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-cpu.yaml",
                      "readinessProbe httpGet port 9000 is not a declared containerPort")


def test_liveness_probe_on_ready_endpoint(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml",
         lambda docs: container(docs)["livenessProbe"]["httpGet"].update(path="/v2/health/ready"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "gateway.yaml",
                      "livenessProbe path '/v2/health/ready'", "restart pods")


def test_bound_port_not_declared(tmp_path):
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        args[args.index("--grpc-port=8001")] = "--grpc-port=9001"
    edit(d, "worker-gpu.yaml", change)
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-gpu.yaml",
                      "binds its grpc port 9001", "no containerPort 9001")


def test_service_selecting_nothing(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml", lambda docs: find(docs, "Service")["spec"]["selector"].update(
        {"app.kubernetes.io/name": "nereid-gw"}))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Service/nereid-gateway",
                      "selects no pods")


def test_service_target_port_missing(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml",
         lambda docs: find(docs, "Service")["spec"]["ports"][1].update(targetPort="grpc-web"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Service/nereid-gateway",
                      "targetPort 'grpc-web' is not a containerPort")


def test_service_publishing_the_metrics_port(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml", lambda docs: find(docs, "Service")["spec"]["ports"].append(
        {"name": "metrics", "port": 8002, "targetPort": "metrics"}))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Service/nereid-gateway",
                      "is the metrics port")


def test_grace_period_too_short(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml", lambda docs: find(docs, "Deployment")["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=30))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Deployment/nereid-gateway",
                      "terminationGracePeriodSeconds 30 must exceed", "--exit-timeout-secs 30s")


def test_worker_grace_period_counts_the_etcd_drain(tmp_path):
    d = copy_manifests(tmp_path)
    # 140 > the preStop drain's 60 s wait + --exit-timeout-secs 60, but not > those + nereidctl's
    # etcd calls 18 + build shutdown 2 + drain delay 2 + etcd bounds 8.
    edit(d, "worker-cpu.yaml", lambda docs: find(docs, "Deployment")["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=140))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Deployment/nereid-worker-cpu",
                      "terminationGracePeriodSeconds 140", "preStop drain 78s", "build shutdown 2s",
                      "--drain-delay-ms 2s", "= 150s")


def worker_container(docs):
    return find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_worker_without_a_prestop_drain(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml", lambda docs: worker_container(docs).pop("lifecycle"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "Deployment/nereid-worker-cpu",
                      "no preStop `nereidctl drain")


def test_worker_prestop_drain_of_another_worker_or_etcd(tmp_path):
    d = copy_manifests(tmp_path)

    def retarget(docs):
        cmd = worker_container(docs)["lifecycle"]["preStop"]["exec"]["command"]
        cmd[2] = cmd[2].replace('"$POD_NAME"', "worker-0").replace("--until-exit ", "").replace(
            "http://etcd-0.etcd:2379,", "").replace("--etcd-prefix=/nereid/v1", "--etcd-prefix=/other")
    edit(d, "worker-cpu.yaml", retarget)
    result = validate(d, "--flags-from", "builtin")
    for needle in ("preStop drain names 'worker-0'", "without --until-exit",
                   "preStop drain --etcd-endpoints", "preStop drain --etcd-prefix '/other'"):
        assert_fails_with(result, "Deployment/nereid-worker-cpu", needle)


def test_gpu_worker_without_gpu_limit(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-gpu.yaml",
         lambda docs: container(docs)["resources"]["limits"].pop("nvidia.com/gpu"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-gpu.yaml",
                      "GPU worker (--label device=gpu) has no resources.limits nvidia.com/gpu")


def test_gpu_limit_without_gpu_label(tmp_path):
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        args[args.index("--label=device=gpu")] = "--label=device=cpu"
    edit(d, "worker-gpu.yaml", change)
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-gpu.yaml",
                      "limits nvidia.com/gpu but does not advertise --label device=gpu")


def test_undefined_env_reference(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml", lambda docs: container(docs)["env"].pop())  # POD_IP
    assert_fails_with(validate(d, "--flags-from", "builtin"), "worker-cpu.yaml",
                      "$(POD_IP)", "no env var of the container defines")


def test_worker_id_shared_by_every_pod(tmp_path):
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        args[args.index("--worker-id=$(POD_NAME)")] = "--worker-id=worker-1"
    edit(d, "worker-cpu.yaml", change)
    assert_fails_with(validate(d, "--flags-from", "builtin"),
                      "--worker-id=worker-1 is the same for every pod")


def test_etcd_endpoint_that_resolves_to_nothing(tmp_path):
    d = copy_manifests(tmp_path)

    def change(docs):
        args = container(docs)["args"]
        i = next(i for i, a in enumerate(args) if a.startswith("--etcd-endpoints="))
        args[i] = "--etcd-endpoints=http://etcd-3.etcd:2379,http://etcd-client:2379"
    edit(d, "gateway.yaml", change)
    r = validate(d, "--flags-from", "builtin")
    assert_fails_with(r, "'etcd-3.etcd'", "no StatefulSet behind Service etcd has a pod 'etcd-3'")
    assert_fails_with(r, "'etcd-client' is not a Service")


def test_etcd_initial_cluster_disagrees_with_replicas(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "etcd.yaml", lambda docs: find(docs, "StatefulSet")["spec"].update(replicas=5))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "StatefulSet/etcd",
                      "--initial-cluster names ['etcd-0', 'etcd-1', 'etcd-2']", "5 replicas")


def test_memory_capacity_above_memory_limit(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "worker-cpu.yaml",
         lambda docs: container(docs)["resources"]["limits"].update(memory="4Gi"))
    assert_fails_with(validate(d, "--flags-from", "builtin"),
                      "--memory-capacity-mb 6144 exceeds the memory limit (4Gi = 4096 MiB)")


def test_pdb_that_blocks_every_eviction(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "gateway.yaml",
         lambda docs: find(docs, "PodDisruptionBudget")["spec"].update(minAvailable=2))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "PodDisruptionBudget/nereid-gateway",
                      "minAvailable 2 >= the 2 replicas")


def test_wrong_namespace(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "model-repository.yaml", lambda docs: docs[0]["metadata"].update(namespace="default"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "PersistentVolumeClaim/nereid-models",
                      "metadata.namespace is 'default'")


def test_kustomization_missing_a_file(tmp_path):
    d = copy_manifests(tmp_path)
    edit(d, "kustomization.yaml", lambda docs: docs[0]["resources"].remove("worker-gpu.yaml"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "kustomization.yaml",
                      "worker-gpu.yaml is not listed in resources")


def test_duplicate_yaml_key(tmp_path):
    d = copy_manifests(tmp_path)
    path = d / "model-repository.yaml"
    path.write_text(path.read_text().replace("  name: nereid-models\n",
                                             "  name: nereid-models\n  name: models\n"))
    assert_fails_with(validate(d, "--flags-from", "builtin"), "model-repository.yaml",
                      "duplicate key 'name'")


def test_missing_binary_with_flags_from_binary(tmp_path):
    d = copy_manifests(tmp_path)
    r = validate(d, "--flags-from", "binary", "--worker-bin", str(tmp_path / "nope"),
                 "--gateway-bin", str(tmp_path / "nope"), "--no-kubectl")
    assert r.returncode == 1
    assert "--help` failed" in r.stdout
