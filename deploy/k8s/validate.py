#!/usr/bin/env python3
"""Offline validator for Nereid's Kubernetes manifests (deploy/k8s/). Needs python3 + pyyaml.

    python3 deploy/k8s/validate.py [DIR] [--flags-from auto|binary|builtin]
                                   [--worker-bin PATH] [--gateway-bin PATH]
                                   [--no-kubectl] [--kubectl-dry-run client|server]

Checks, on every *.yaml in DIR (default: this folder):
  * YAML: parses, no duplicate keys; each object has apiVersion/kind/metadata.name of a known
    kind, sits in the one Namespace the manifests define (and the kustomization names);
  * kustomization.yaml lists every manifest file and only files that exist;
  * workloads: selector matches the pod template, no two workloads' selectors overlap, unknown
    container/probe fields, $(VAR) references that no env var defines, fieldRef paths, volume
    mounts/claims/ConfigMaps that exist, probes that point at declared container ports;
  * Services and PodDisruptionBudgets select pods some workload creates, targetPorts resolve,
    a PDB never blocks every eviction;
  * nereid-worker / nereid-gateway args: every flag is one the binary accepts (read from the
    built binary's --help when there is one, else the list below), values of closed flags,
    required flags, bound ports == declared containerPorts, probes on /v2/health/{live,ready}
    of the HTTP port, metrics scrape port, terminationGracePeriodSeconds > preStop sleep +
    --exit-timeout-secs, per-pod --worker-id/--advertise-address, --etcd-endpoints that resolve
    to etcd pods/Services defined here, one --etcd-prefix, --model-repository under a volume
    mount, --memory-capacity-mb within the memory limit, GPU workers (--label device=gpu)
    limit nvidia.com/gpu and only they do;
  * etcd: --initial-cluster names exactly the StatefulSet's replicas through its headless
    Service, and that Service publishes not-ready addresses.
With kubectl on PATH it also renders the kustomization offline (`kubectl kustomize`) and, if
asked (--kubectl-dry-run, needs a cluster), runs `kubectl apply --dry-run=...`.
Exit status: 0 = valid, 1 = problems (each printed with file, object and what is wrong),
2 = usage error.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# --------------------------------------------------------------------------------------------
# The flags the nereid binaries accept. Used when no built binary is found (or with
# --flags-from builtin). "value": the flag takes a value; "optional": `--flag` or `--flag=v`;
# "none": a switch. A tuple gives the closed set of values.
# --------------------------------------------------------------------------------------------
V, OPT, NONE = "value", "optional", "none"
BOOL = ("true", "false")
BUILTIN_FLAGS = {
    "nereid-worker": {
        "model-repository": V, "address": V, "http-port": V, "grpc-port": V, "metrics-port": V,
        "allow-http": (OPT, BOOL), "allow-grpc": (OPT, BOOL), "allow-metrics": (OPT, BOOL),
        "model-control-mode": (V, ("none", "poll", "explicit")), "load-model": V,
        "repository-poll-secs": V, "strict-model-config": (OPT, BOOL),
        "exit-on-error": (OPT, BOOL), "log-verbose": V, "exit-timeout-secs": V,
        "onnxruntime-lib": V, "max-request-bytes": V, "max-queued-bytes": V, "intra-op-threads": V, "port-file": V,
        "etcd-endpoints": V, "etcd-prefix": V, "worker-id": V, "advertise-address": V,
        "etcd-lease-ttl-secs": V, "label": V, "memory-capacity-mb": V, "max-models": V,
        "drain-delay-ms": V, "cache-config": V, "allow-client-shm": (OPT, BOOL),
        "strict-readiness": (OPT, BOOL), "denormal-as-zero": (OPT, BOOL),
        "http-address": V, "grpc-address": V, "metrics-address": V, "id": V,
        "disable-auto-complete-config": NONE, "log-info": (OPT, BOOL), "log-warning": (OPT, BOOL),
        "log-error": (OPT, BOOL), "log-format": (V, ("default", "ISO8601")), "log-file": V,
        "grpc-keepalive-time": V, "grpc-keepalive-timeout": V, "model-load-thread-count": V,
        "allow-gpu-metrics": (OPT, BOOL), "allow-cpu-metrics": (OPT, BOOL), "metrics-interval-ms": V,
        # tritonserver flags accepted for compatibility (warned about, or refused when true).
        "http-thread-count": V, "grpc-infer-allocation-pool-size": V,
        "grpc-keepalive-permit-without-calls": (OPT, BOOL), "grpc-http2-max-pings-without-data": V,
        "grpc-http2-min-recv-ping-interval-without-data": V, "grpc-http2-max-ping-strikes": V,
        "pinned-memory-pool-byte-size": V, "cuda-memory-pool-byte-size": V, "backend-directory": V,
        "repoagent-directory": V, "allow-sagemaker": (OPT, BOOL), "allow-vertex-ai": (OPT, BOOL),
        "grpc-use-ssl": (OPT, BOOL), "grpc-use-ssl-mutual": (OPT, BOOL),
        "reuse-http-port": (OPT, BOOL), "reuse-grpc-port": (OPT, BOOL), "model-namespacing": (OPT, BOOL),
        "backend-config": V, "model-config-name": V, "http-max-input-size": V,
        "rate-limit": (V, ("off", "execution_count")), "rate-limit-resource": V,
        "buffer-manager-thread-count": V, "trace-config": V, "trace-level": V, "trace-file": V,
        "trace-rate": V, "trace-count": V, "trace-log-frequency": V, "host-policy": V,
        "min-supported-compute-capability": V, "http-header-forward-pattern": V,
        "grpc-header-forward-pattern": V, "http-restricted-api": V, "grpc-restricted-protocol": V,
        "cache-directory": V, "metrics-config": V, "model-load-retry-count": V,
        "grpc-infer-thread-count": V, "grpc-max-response-pool-size": V, "response-cache-byte-size": V,
        "cuda-virtual-address-size": V, "model-load-gpu-limit": V, "enable-peer-access": (OPT, BOOL),
        "grpc-infer-response-compression-level": (V, ("none", "low", "medium", "high")),
        "help": NONE, "version": NONE,
    },
    "nereid-gateway": {
        "worker-grpc": V, "address": V, "http-port": V, "grpc-port": V, "metrics-port": V,
        "port-file": V, "request-timeout-ms": V, "max-concurrent-requests": V,
        "retry-budget-percent": V, "retry-budget-min-per-sec": V,
        "ejection-consecutive-failures": V, "ejection-base-ms": V, "ejection-max-ms": V,
        "ejection-hung-after-ms": V,
        "discovery-interval-ms": V, "discovery-timeout-ms": V, "max-request-bytes": V,
        "exit-timeout-secs": V, "log-verbose": V,
        "etcd-endpoints": V, "etcd-prefix": V, "gateway-id": V, "placement": (V, BOOL),
        "election-ttl-secs": V, "io-threads": V, "upstream-connections": V, "placement-load-timeout-secs": V,
        "connect-timeout-ms": V,
        "help": NONE, "version": NONE,
    },
}
BUILTIN_REQUIRED = {"nereid-worker": {"model-repository"}, "nereid-gateway": set()}
NEREID_BINARIES = tuple(BUILTIN_FLAGS)
# Defaults the binaries document in --help; the checks need them when a flag is left out.
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
DEFAULT_EXIT_TIMEOUT_SECS = 30
DEFAULT_DRAIN_DELAY_MS = 1000
# In etcd mode the worker's SIGTERM path also waits up to 3 s to publish `draining` and up to
# 5 s to revoke its lease (worker/src/main.rs), around --drain-delay-ms and the in-flight drain.
WORKER_FLEET_SHUTDOWN_BOUNDS_SECS = 3 + 5
# And every worker waits up to 2 s, at the very end, for a model build still under way (its
# warm-up stops between runs; session creation cannot be interrupted).
WORKER_RUNTIME_SHUTDOWN_SECS = 2
INTEGER_FLAGS = {
    "http-port", "grpc-port", "metrics-port", "exit-timeout-secs", "etcd-lease-ttl-secs",
    "memory-capacity-mb", "request-timeout-ms", "max-concurrent-requests", "log-verbose",
    "repository-poll-secs", "max-request-bytes", "max-queued-bytes", "intra-op-threads", "max-models",
    "drain-delay-ms", "election-ttl-secs", "io-threads", "upstream-connections", "grpc-keepalive-time", "grpc-keepalive-timeout",
    "model-load-thread-count", "metrics-interval-ms", "http-max-input-size", "buffer-manager-thread-count",
    "trace-rate", "trace-log-frequency",
}
HEALTH_PATHS = {"livenessProbe": "/v2/health/live", "readinessProbe": "/v2/health/ready",
                "startupProbe": None}  # startup: live or ready

# --------------------------------------------------------------------------------------------
# What the validator knows of Kubernetes itself.
# --------------------------------------------------------------------------------------------
KINDS = {  # kind -> (apiVersion, namespaced)
    "Namespace": ("v1", False), "Service": ("v1", True), "ConfigMap": ("v1", True),
    "Secret": ("v1", True), "ServiceAccount": ("v1", True),
    "PersistentVolumeClaim": ("v1", True), "Deployment": ("apps/v1", True),
    "StatefulSet": ("apps/v1", True), "DaemonSet": ("apps/v1", True),
    "Job": ("batch/v1", True), "PodDisruptionBudget": ("policy/v1", True),
    "NetworkPolicy": ("networking.k8s.io/v1", True),
    "HorizontalPodAutoscaler": ("autoscaling/v2", True),
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
CONTAINER_FIELDS = {
    "name", "image", "command", "args", "workingDir", "ports", "envFrom", "env", "resources",
    "resizePolicy", "restartPolicy", "volumeMounts", "volumeDevices", "livenessProbe",
    "readinessProbe", "startupProbe", "lifecycle", "terminationMessagePath",
    "terminationMessagePolicy", "imagePullPolicy", "securityContext", "stdin", "stdinOnce", "tty",
}
PROBE_FIELDS = {
    "exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "timeoutSeconds",
    "periodSeconds", "successThreshold", "failureThreshold", "terminationGracePeriodSeconds",
}
HANDLER_FIELDS = {"exec", "httpGet", "tcpSocket", "sleep"}
FIELD_PATHS = {
    "metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName",
    "spec.serviceAccountName", "status.hostIP", "status.hostIPs", "status.podIP",
    "status.podIPs",
}
PER_POD_FIELDS = {"metadata.name", "metadata.uid", "status.podIP", "status.podIPs"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


# --------------------------------------------------------------------------------------------
# Flag sets: from a binary's --help, or built in.
# --------------------------------------------------------------------------------------------
@dataclass
class FlagSet:
    binary: str
    source: str  # said in every message about a flag
    flags: dict[str, tuple[str, tuple[str, ...] | None]]  # name -> (arity, choices)
    required: set[str]


def builtin_flagset(binary: str) -> FlagSet:
    flags = {}
    for name, spec in BUILTIN_FLAGS[binary].items():
        arity, choices = spec if isinstance(spec, tuple) else (spec, None)
        flags[name] = (arity, choices)
    return FlagSet(binary, "the validator's built-in list", flags, set(BUILTIN_REQUIRED[binary]))


_HELP_FLAG = re.compile(r"^(?:  -[A-Za-z0-9], |      )--([A-Za-z0-9][A-Za-z0-9-]*)(.*)$")


def parse_help(binary: str, text: str, source: str) -> FlagSet:
    """Flags, arity, possible values and required flags from clap's --help output."""
    flags: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    blocks: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        m = _HELP_FLAG.match(line)
        if m:
            blocks.append((m.group(1), m.group(2).strip(), []))
        elif blocks:
            blocks[-1][2].append(line)
    for name, rest, body in blocks:
        arity = OPT if rest.startswith("[<") else V if rest.startswith("<") else NONE
        text_block = "\n".join([rest, *body])
        choices = None
        m = re.search(r"\[possible values: ([^\]]+)\]", text_block)
        if m:
            choices = tuple(v.strip() for v in m.group(1).split(","))
        elif "Possible values:" in text_block:
            after = text_block.split("Possible values:", 1)[1]
            choices = tuple(re.findall(r"^\s*-\s+([^:\s]+)", after, re.M)) or None
        flags[name] = (arity, choices)
    usage = re.search(r"^Usage:(.*)$", text, re.M)
    required = set()
    if usage:
        required = set(re.findall(r"--([A-Za-z0-9][A-Za-z0-9-]*)",
                                  re.sub(r"\[[^\]]*\]", "", usage.group(1))))
    return FlagSet(binary, source, flags, required)


def find_binary(binary: str, explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    env = os.environ.get(f"NEREID_{binary.split('-')[1].upper()}_BIN")
    if env:
        return Path(env)
    found = [p for p in (REPO / "target" / "debug" / binary, REPO / "target" / "release" / binary)
             if p.is_file() and os.access(p, os.X_OK)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def load_flagsets(mode: str, bins: dict[str, str | None], notes: list[str],
                  errors: list[str]) -> dict[str, FlagSet]:
    sets = {}
    for binary in NEREID_BINARIES:
        path = None if mode == "builtin" else find_binary(binary, bins.get(binary))
        if path is None:
            if mode == "binary":
                errors.append(f"{binary}: no built binary found (target/debug, target/release, "
                              f"$NEREID_{binary.split('-')[1].upper()}_BIN) and --flags-from=binary")
            sets[binary] = builtin_flagset(binary)
            notes.append(f"{binary}: flags from the validator's built-in list"
                         + ("" if mode == "builtin" else " (no built binary found)"))
            continue
        try:
            out = subprocess.run([str(path), "--help"], capture_output=True, text=True,
                                 timeout=30)
            ok = out.returncode == 0 and "--" in out.stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out, ok = e, False
        if not ok:
            msg = f"{binary}: `{path} --help` failed ({getattr(out, 'stderr', out)!s:.200})"
            if mode == "binary":
                errors.append(msg)
            notes.append(msg + "; using the built-in list")
            sets[binary] = builtin_flagset(binary)
            continue
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        sets[binary] = parse_help(binary, out.stdout, f"`{rel} --help`")
        notes.append(f"{binary}: flags from `{rel} --help` ({len(sets[binary].flags)} flags)")
    return sets


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------
class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain PyYAML keeps the last one)."""


def _mapping_without_duplicates(loader, node):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=True)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                             _mapping_without_duplicates)


@dataclass
class Obj:
    file: str
    body: dict

    @property
    def meta(self) -> dict:
        m = self.body.get("metadata")
        return m if isinstance(m, dict) else {}

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", "?"))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", "?"))

    @property
    def namespace(self) -> str | None:
        ns = self.meta.get("namespace")
        return ns if ns is None or isinstance(ns, str) else repr(ns)

    def where(self, container: str | None = None) -> str:
        w = f"{self.file}: {self.kind}/{self.name}"
        return f"{w}: container {container}" if container else w


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def error(self, where: str, msg: str) -> None:
        self.errors.append(f"{where}: {msg}")


def load_dir(directory: Path, rep: Report) -> tuple[list[Obj], dict | None, list[str]]:
    objs, kustomization, files = [], None, []
    for path in sorted(directory.iterdir()):
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            continue
        try:
            docs = [d for d in yaml.load_all(path.read_text(), Loader=StrictLoader) if d is not None]
        except yaml.YAMLError as e:
            rep.error(path.name, f"not valid YAML: {e}")
            continue
        if path.name in ("kustomization.yaml", "kustomization.yml"):
            kustomization = docs[0] if docs else {}
            continue
        files.append(path.name)
        for d in docs:
            if not isinstance(d, dict):
                rep.error(path.name, f"a document is a {type(d).__name__}, not a mapping")
                continue
            objs.append(Obj(path.name, d))
    return objs, kustomization, files


# --------------------------------------------------------------------------------------------
# Small helpers.
# --------------------------------------------------------------------------------------------
def selector_matches(selector: dict | None, labels: dict) -> bool:
    """Label selector (matchLabels + matchExpressions) semantics; an empty selector matches
    nothing here (the manifests never mean "everything")."""
    if not selector:
        return False
    ml = selector.get("matchLabels") or {}
    me = selector.get("matchExpressions") or []
    if not ml and not me:
        return False
    if any(labels.get(k) != str(v) for k, v in ml.items()):
        return False
    for e in me:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def service_selector(selector: dict | None) -> dict:
    return {"matchLabels": selector} if selector else {}


def parse_quantity_mib(q) -> float | None:
    if q is None:
        return None
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    if not m:
        return None
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / 2**20


def pod_template(obj: Obj) -> tuple[dict, dict]:
    spec = obj.body.get("spec") or {}
    tmpl = spec.get("template") or {}
    return (tmpl.get("metadata") or {}), (tmpl.get("spec") or {})


def container_ports(c: dict) -> dict:
    """name-or-number (as str) -> containerPort, for lookups of probe/Service ports."""
    out = {}
    for p in c.get("ports") or []:
        if isinstance(p, dict) and isinstance(p.get("containerPort"), int):
            out[str(p["containerPort"])] = p["containerPort"]
            if p.get("name"):
                out[p["name"]] = p["containerPort"]
    return out


def parse_args(tokens: list[str], fs: FlagSet, where: str, rep: Report) -> dict[str, list[str]]:
    """clap-style parsing of `--flag=value` / `--flag value` against a FlagSet."""
    seen: dict[str, list[str]] = {}
    i = 0
    while i < len(tokens):
        tok = str(tokens[i])
        i += 1
        if not tok.startswith("--") or tok == "--":
            rep.error(where, f"unexpected argument {tok!r}: {fs.binary} takes no positional "
                             f"arguments (flags from {fs.source})")
            continue
        name, eq, value = tok[2:].partition("=")
        if name not in fs.flags:
            rep.error(where, f"unknown flag --{name}: {fs.binary} does not accept it "
                             f"(flags from {fs.source})")
            continue
        arity, choices = fs.flags[name]
        if arity == NONE:
            if eq:
                rep.error(where, f"--{name} is a switch and takes no value (got {tok!r})")
            seen.setdefault(name, []).append("")
            continue
        if not eq:
            nxt = str(tokens[i]) if i < len(tokens) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            elif arity == V:
                rep.error(where, f"--{name} needs a value (flags from {fs.source})")
                continue
            else:
                value = "true"
        # The binaries take these values in any case (as tritonserver does), --log-format's
        # excepted.
        folded = (lambda v: v) if name == "log-format" else str.lower
        if choices and not VAR_REF.search(value) and folded(value) not in {folded(c) for c in choices}:
            rep.error(where, f"--{name}={value}: not one of {', '.join(choices)} "
                             f"(flags from {fs.source})")
        if name in INTEGER_FLAGS and not VAR_REF.search(value) and not re.fullmatch(r"\d+", value):
            rep.error(where, f"--{name}={value}: not a non-negative integer")
        seen.setdefault(name, []).append(value)
    for name in sorted(fs.required - set(seen)):
        rep.error(where, f"--{name} is required by {fs.binary} (flags from {fs.source})")
    return seen


def prestop_sleep_seconds(c: dict) -> int:
    """How long the preStop hook may hold SIGTERM off: a sleep, or a `nereidctl drain
    --wait-secs N` (N plus its own bounded etcd calls)."""
    pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
    if isinstance((pre.get("sleep") or {}).get("seconds"), int):
        return pre["sleep"]["seconds"]
    cmd = (pre.get("exec") or {}).get("command") or []
    if len(cmd) == 2 and PurePosixPath(str(cmd[0])).name == "sleep" and str(cmd[1]).isdigit():
        return int(cmd[1])
    drain = prestop_drain(c)
    if drain is not None:
        return drain["wait"] + NEREIDCTL_DRAIN_CALLS_SECS
    return 0


# nereidctl's etcd calls in `drain --until-exit`, each bounded at 3 s: connect, read the worker's
# lease, read the drain key's, write; plus one poll of the wait begun just before --wait-secs ran
# out (the worker's placements, then the fleet's state).
NEREIDCTL_DRAIN_CALLS_SECS = 4 * 3 + 2 * 3


def prestop_drain(c: dict) -> dict | None:
    """A preStop `nereidctl ... drain WORKER ...` (as a command, or in `sh -c`): its endpoints,
    target, --until-exit and --wait-secs; None when the hook runs no nereidctl drain."""
    pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
    cmd = [str(x) for x in (pre.get("exec") or {}).get("command") or []]
    if len(cmd) == 3 and PurePosixPath(cmd[0]).name in ("sh", "bash") and cmd[1] == "-c":
        try:
            cmd = shlex.split(cmd[2])
        except ValueError:
            return None
    if cmd[:1] == ["exec"]:
        cmd = cmd[1:]
    if not cmd or PurePosixPath(cmd[0]).name != "nereidctl" or "drain" not in cmd:
        return None
    out = {"endpoints": None, "prefix": "/nereid/v1", "target": None, "until_exit": "--until-exit" in cmd, "wait": 0}
    i = cmd.index("drain")
    for j, tok in enumerate(cmd):
        if tok.startswith("--etcd-endpoints="):
            out["endpoints"] = tok.split("=", 1)[1]
        elif tok == "--etcd-endpoints" and j + 1 < len(cmd):
            out["endpoints"] = cmd[j + 1]
        elif tok.startswith("--etcd-prefix="):
            out["prefix"] = tok.split("=", 1)[1]
        elif tok == "--etcd-prefix" and j + 1 < len(cmd):
            out["prefix"] = cmd[j + 1]
        elif tok.startswith("--wait-secs="):
            out["wait"] = int(tok.split("=", 1)[1]) if tok.split("=", 1)[1].isdigit() else 0
        elif tok == "--wait-secs" and j + 1 < len(cmd) and cmd[j + 1].isdigit():
            out["wait"] = int(cmd[j + 1])
    if i + 1 < len(cmd) and not cmd[i + 1].startswith("-"):
        out["target"] = cmd[i + 1]
    return out


# --------------------------------------------------------------------------------------------
# The checks.
# --------------------------------------------------------------------------------------------
class Validator:
    def __init__(self, objs: list[Obj], flagsets: dict[str, FlagSet], rep: Report):
        self.objs, self.flagsets, self.rep = objs, flagsets, rep
        self.workloads = [o for o in objs if o.kind in WORKLOAD_KINDS]
        self.services = {(o.namespace, o.name): o for o in objs if o.kind == "Service"}
        self.etcd_prefixes: dict[str, list[str]] = {}

    def named(self, kind: str, ns: str | None, name: str) -> Obj | None:
        return next((o for o in self.objs
                     if o.kind == kind and o.namespace == ns and o.name == name), None)

    def selected(self, ns: str | None, selector: dict) -> list[Obj]:
        return [w for w in self.workloads
                if w.namespace == ns and selector_matches(selector, pod_template(w)[0].get("labels") or {})]

    # -- structure -----------------------------------------------------------------------------
    def structure(self, kustomization: dict | None, files: list[str]) -> None:
        rep, seen = self.rep, set()
        namespaces = [o.name for o in self.objs if o.kind == "Namespace"]
        if len(namespaces) != 1:
            rep.error("manifests", f"expected exactly one Namespace object, found {namespaces}")
        home = namespaces[0] if namespaces else None
        for o in self.objs:
            meta = o.body.get("metadata")
            if not isinstance(o.body.get("apiVersion"), str) or not isinstance(o.body.get("kind"), str):
                rep.error(o.where(), "apiVersion and kind must be strings")
                continue
            if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
                rep.error(o.where(), "metadata.name is missing")
                continue
            if o.kind not in KINDS:
                rep.error(o.where(), f"kind {o.kind} is not one the validator knows "
                                     f"({', '.join(sorted(KINDS))})")
                continue
            api, namespaced = KINDS[o.kind]
            if o.body["apiVersion"] != api:
                rep.error(o.where(), f"apiVersion {o.body['apiVersion']} for {o.kind}; expected {api}")
            name_re = DNS_LABEL if o.kind in ("Namespace", "Service") else DNS_SUBDOMAIN
            if not name_re.match(o.name) or len(o.name) > (63 if name_re is DNS_LABEL else 253):
                rep.error(o.where(), f"metadata.name {o.name!r} is not a valid DNS name")
            if namespaced and o.namespace != home:
                rep.error(o.where(), f"metadata.namespace is {o.namespace!r}; every object must be "
                                     f"in namespace {home!r}")
            if not namespaced and o.namespace:
                rep.error(o.where(), f"{o.kind} is cluster-scoped and takes no namespace")
            self.string_maps(o)
            key = (o.kind, o.namespace, o.name)
            if key in seen:
                rep.error(o.where(), "defined twice")
            seen.add(key)
        self.kustomization(kustomization, files, home)

    def string_maps(self, o: Obj) -> None:
        """Label/annotation values must be strings: unquoted true/8002 is rejected by the API."""
        def walk(node, path):
            if isinstance(node, dict):
                for k, v in node.items():
                    p = f"{path}.{k}" if path else str(k)
                    if k in ("labels", "annotations", "matchLabels", "nodeSelector") and isinstance(v, dict):
                        for lk, lv in v.items():
                            if not isinstance(lv, str):
                                self.rep.error(o.where(), f"{p}[{lk!r}] = {lv!r} must be a string "
                                                         f"(quote it)")
                    elif k == "selector" and o.kind == "Service" and isinstance(v, dict):
                        walk({"matchLabels": v}, p)
                    else:
                        walk(v, p)
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, f"{path}[{i}]")
        walk(o.body, "")

    def kustomization(self, k: dict | None, files: list[str], home: str | None) -> None:
        rep = self.rep
        if not isinstance(k, dict):
            rep.error("kustomization.yaml", "missing (or not a mapping): it must list every manifest")
            return
        if (k.get("apiVersion"), k.get("kind")) != ("kustomize.config.k8s.io/v1beta1", "Kustomization"):
            rep.error("kustomization.yaml", "must be apiVersion kustomize.config.k8s.io/v1beta1, "
                                            "kind Kustomization")
        if k.get("namespace") not in (None, home):
            rep.error("kustomization.yaml", f"namespace {k.get('namespace')!r} differs from the "
                                            f"manifests' namespace {home!r}")
        resources = k.get("resources")
        if not isinstance(resources, list):
            rep.error("kustomization.yaml", f"resources must be a list of files, not {resources!r}")
            resources = []
        listed = [str(r) for r in resources]
        for r in listed:
            if "://" not in r and r not in files:
                rep.error("kustomization.yaml", f"resources lists {r!r}, which is not a manifest "
                                                f"in this folder")
        for f in files:
            if f not in listed:
                rep.error("kustomization.yaml", f"{f} is not listed in resources")

    # -- workloads -----------------------------------------------------------------------------
    def workload(self, w: Obj) -> None:
        rep, spec = self.rep, w.body.get("spec") or {}
        meta, pod = pod_template(w)
        labels = meta.get("labels") or {}
        if w.kind != "Job" and not selector_matches(spec.get("selector"), labels):
            rep.error(w.where(), "spec.selector does not match the pod template's labels")
        for other in self.workloads:
            if other is not w and other.namespace == w.namespace and other.kind != "Job" \
                    and selector_matches((other.body.get("spec") or {}).get("selector"), labels):
                rep.error(w.where(), f"its pods are also selected by {other.kind}/{other.name} "
                                     f"(overlapping selectors make the controllers fight)")
        containers = pod.get("containers") or []
        if not containers:
            rep.error(w.where(), "pod template has no containers")
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        claim_templates = {(t.get("metadata") or {}).get("name")
                           for t in spec.get("volumeClaimTemplates") or []}
        for v in volumes.values():
            self.volume_source(w, v)
        grace = pod.get("terminationGracePeriodSeconds", 30)
        names = [c.get("name") for c in containers]
        if len(set(names)) != len(names):
            rep.error(w.where(), f"container names are not unique: {names}")
        for c in containers:
            self.container(w, c, set(volumes) | claim_templates)
            binary = PurePosixPath(str((c.get("command") or [""])[0])).name
            if binary in NEREID_BINARIES:
                self.nereid(w, c, binary, spec, pod, grace)
            elif binary == "etcd":
                self.etcd(w, c, spec)
            elif PurePosixPath(str(c.get("image", "")).split(":")[0]).name == "etcd":
                rep.error(w.where(c.get("name")), f"runs the etcd image with command {binary!r}: "
                                                  f"set command to /usr/local/bin/etcd")
            elif PurePosixPath(str(c.get("image", "")).split(":")[0]).name.startswith("nereid"):
                rep.error(w.where(c.get("name")), "runs a nereid image without `command`: set "
                                                  "command to nereid-worker or nereid-gateway")
        self.scrape_annotations(w, meta, containers)

    def volume_source(self, w: Obj, v: dict) -> None:
        for kind, key, ref in (("PersistentVolumeClaim", "persistentVolumeClaim", "claimName"),
                               ("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
            if key in v and not self.named(kind, w.namespace, (v[key] or {}).get(ref)):
                self.rep.error(w.where(), f"volume {v.get('name')!r} uses {kind} "
                                          f"{(v[key] or {}).get(ref)!r}, which these manifests do not define")

    def container(self, w: Obj, c: dict, volume_names: set) -> None:
        rep, where = self.rep, w.where(c.get("name"))
        for k in sorted(set(c) - CONTAINER_FIELDS):
            rep.error(where, f"unknown container field {k!r}")
        if not isinstance(c.get("name"), str) or not DNS_LABEL.match(c["name"]):
            rep.error(where, f"container name {c.get('name')!r} is not a DNS label")
        if not c.get("image"):
            rep.error(where, "no image")
        for section in ("requests", "limits"):
            for res, q in (((c.get("resources") or {}).get(section)) or {}).items():
                if not isinstance(q, (int, float, str)) or not re.fullmatch(
                        r"[0-9.]+(m|Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|e[0-9]+)?", str(q)):
                    rep.error(where, f"resources.{section}.{res} {q!r} is not a quantity")
        ports = container_ports(c)
        port_names = [p.get("name") for p in c.get("ports") or [] if p.get("name")]
        if len(set(port_names)) != len(port_names):
            rep.error(where, f"port names are not unique: {port_names}")
        for p in c.get("ports") or []:
            if not isinstance(p.get("containerPort"), int) or not 0 < p["containerPort"] < 65536:
                rep.error(where, f"containerPort {p.get('containerPort')!r} is not a port number")
        for n in port_names:
            if not isinstance(n, str) or len(n) > 15 or not DNS_LABEL.match(n):
                rep.error(where, f"port name {n!r} is not a valid IANA service name (<= 15 chars)")
        for probe_kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = c.get(probe_kind)
            if probe is None:
                continue
            for k in sorted(set(probe) - PROBE_FIELDS):
                rep.error(where, f"{probe_kind}: unknown field {k!r}")
            for k in sorted(PROBE_FIELDS & set(probe)):
                if k.endswith(("Seconds", "Threshold")) and not isinstance(probe[k], int):
                    rep.error(where, f"{probe_kind}.{k} must be an integer, not {probe[k]!r}")
            for handler in ("httpGet", "tcpSocket", "grpc"):
                if handler in probe:
                    port = (probe[handler] or {}).get("port")
                    if str(port) not in ports:
                        rep.error(where, f"{probe_kind} {handler} port {port!r} is not a declared "
                                         f"containerPort (declared: {sorted(ports)})")
        pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
        for k in sorted(set(pre) - HANDLER_FIELDS):
            rep.error(where, f"lifecycle.preStop: unknown handler {k!r}")
        env_names = []
        for e in c.get("env") or []:
            env_names.append(e.get("name"))
            fr = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if fr is not None and fr not in FIELD_PATHS and not re.fullmatch(
                    r"metadata\.(labels|annotations)\['[^']+'\]", fr):
                rep.error(where, f"env {e.get('name')}: fieldRef {fr!r} is not a downward-API field")
        if len(set(env_names)) != len(env_names):
            rep.error(where, f"env names are not unique: {env_names}")
        if not c.get("envFrom"):
            for token in [*(c.get("command") or []), *(c.get("args") or [])]:
                for var in VAR_REF.findall(str(token)):
                    if var not in env_names:
                        rep.error(where, f"{token!r} references $({var}), which no env var of the "
                                         f"container defines (Kubernetes would pass it literally)")
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volume_names:
                rep.error(where, f"volumeMount {m.get('name')!r} names no volume of the pod")

    def env_field(self, c: dict, value: str) -> set[str]:
        """fieldRef paths of the env vars a value references."""
        env = {e.get("name"): ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
               for e in c.get("env") or []}
        return {env.get(v) for v in VAR_REF.findall(value)} - {None}

    def scrape_annotations(self, w: Obj, meta: dict, containers: list[dict]) -> None:
        ann = meta.get("annotations") or {}
        if str(ann.get("prometheus.io/scrape")) != "true":
            return
        declared = {p for c in containers for p in container_ports(c).values()}
        port = str(ann.get("prometheus.io/port", ""))
        if not port.isdigit() or int(port) not in declared:
            self.rep.error(w.where(), f"prometheus.io/port {port!r} is not a declared containerPort "
                                      f"(declared: {sorted(declared)})")

    # -- nereid binaries -------------------------------------------------------------------------
    def nereid(self, w: Obj, c: dict, binary: str, spec: dict, pod: dict, grace: int) -> None:
        rep, where, fs = self.rep, w.where(c.get("name")), self.flagsets[binary]
        args = parse_args([*(c.get("command") or [])[1:], *(c.get("args") or [])], fs, where, rep)

        def last(flag, default=None):
            return args[flag][-1] if flag in args else default

        def as_int(flag, default):
            v = last(flag)
            return int(v) if v is not None and v.isdigit() else default

        # Ports the binary binds vs ports the container declares.
        ports = container_ports(c)
        bound = {role: as_int(f"{role}-port", d) for role, d in DEFAULT_PORTS.items()}
        for role, port in bound.items():
            if str(last(f"allow-{role}", "true")) == "false":
                continue
            if port not in ports.values():
                rep.error(where, f"{binary} binds its {role} port {port} (--{role}-port), but the "
                                 f"container declares no containerPort {port}")
            if role in ports and ports[role] != port:
                rep.error(where, f"containerPort named {role!r} is {ports[role]}, but {binary} "
                                 f"binds {role} on {port} (--{role}-port)")
        for name, number in ports.items():
            if not name.isdigit() and number not in bound.values():
                rep.error(where, f"containerPort {name}={number} is not a port {binary} binds "
                                 f"({bound})")
        # Probes: the health endpoints of the HTTP port, live for liveness, ready for readiness.
        for probe_kind, path in HEALTH_PATHS.items():
            probe = c.get(probe_kind)
            if probe is None:
                if probe_kind != "startupProbe" or binary == "nereid-worker":
                    rep.error(where, f"no {probe_kind}")
                continue
            get = probe.get("httpGet")
            if not get:
                rep.error(where, f"{probe_kind} must be an httpGet on /v2/health/*")
                continue
            if ports.get(str(get.get("port"))) != bound["http"]:
                rep.error(where, f"{probe_kind} port {get.get('port')!r} is not the HTTP port "
                                 f"{bound['http']} where {binary} serves /v2/health")
            want = {path} if path else {"/v2/health/live", "/v2/health/ready"}
            if get.get("path") not in want:
                why = (" (a liveness probe on ready would restart pods that are loading or draining)"
                       if probe_kind == "livenessProbe" else "")
                rep.error(where, f"{probe_kind} path {get.get('path')!r}; expected "
                                 f"{' or '.join(sorted(want))}{why}")
        ann = (pod_template(w)[0].get("annotations") or {})
        if str(ann.get("prometheus.io/scrape")) == "true" and \
                str(ann.get("prometheus.io/port")) != str(bound["metrics"]):
            rep.error(w.where(), f"prometheus.io/port is {ann.get('prometheus.io/port')!r}, but "
                                 f"{binary} serves /metrics on {bound['metrics']}")
        # Drain: SIGTERM comes after preStop; the whole drain must fit in the grace period.
        endpoints = last("etcd-endpoints")
        exit_timeout = as_int("exit-timeout-secs", DEFAULT_EXIT_TIMEOUT_SECS)
        sleep = prestop_sleep_seconds(c)
        drain = prestop_drain(c)
        hook = "preStop drain" if drain else "preStop sleep"
        parts = [f"{hook} {sleep}s", f"--exit-timeout-secs {exit_timeout}s"]
        needed = sleep + exit_timeout
        if binary == "nereid-worker":
            needed += WORKER_RUNTIME_SHUTDOWN_SECS
            parts.append(f"build shutdown {WORKER_RUNTIME_SHUTDOWN_SECS}s")
        if binary == "nereid-worker" and endpoints:
            delay = -(-as_int("drain-delay-ms", DEFAULT_DRAIN_DELAY_MS) // 1000)
            needed += delay + WORKER_FLEET_SHUTDOWN_BOUNDS_SECS
            parts += [f"--drain-delay-ms {delay}s",
                      f"etcd drain/revoke bounds {WORKER_FLEET_SHUTDOWN_BOUNDS_SECS}s"]
        if not isinstance(grace, int) or grace <= needed:
            rep.error(w.where(), f"terminationGracePeriodSeconds {grace} must exceed "
                                 f"{' + '.join(parts)} = {needed}s (else the kubelet kills "
                                 f"{binary} mid-drain)")
        fronted_by = [s.name for s in self.services.values() if s.namespace == w.namespace and
                      selector_matches(service_selector((s.body.get("spec") or {}).get("selector")),
                                       pod_template(w)[0].get("labels") or {})]
        if fronted_by and sleep == 0:
            rep.error(where, f"behind Service {', '.join(fronted_by)} but no preStop sleep: "
                             f"SIGTERM would race the endpoints update and refuse connections")
        # etcd membership.
        if endpoints:
            if binary == "nereid-worker" and last("model-control-mode", "none").lower() != "explicit":
                rep.error(where, "--etcd-endpoints needs --model-control-mode=explicit (placement "
                                 "decides what the worker loads)")
            for ep in endpoints.split(","):
                self.etcd_endpoint(w, where, ep.strip())
            self.etcd_prefixes.setdefault(last("etcd-prefix", "/nereid/v1"), []).append(where)
            per_pod = ["worker-id", "advertise-address"] if binary == "nereid-worker" else ["gateway-id"]
            for flag in per_pod:
                v = last(flag)
                if v is None:
                    if binary == "nereid-worker":
                        rep.error(where, f"--{flag} is needed with --etcd-endpoints (one per pod)")
                    continue
                if not self.env_field(c, v) & PER_POD_FIELDS:
                    rep.error(where, f"--{flag}={v} is the same for every pod of the {w.kind}: "
                                     f"use $(POD_NAME)/$(POD_IP) from the downward API")
            if binary == "nereid-worker":
                self.worker_prestop_drain(where, c, endpoints, last("worker-id"), last("etcd-prefix", "/nereid/v1"))
        for label in args.get("label", []):
            if not re.fullmatch(r"[A-Za-z0-9_.\-/]+=[^=]*", label):
                rep.error(where, f"--label {label!r} is not key=value")
        if binary != "nereid-worker":
            return
        # Model repository: must come from a volume.
        mounts = [m.get("mountPath", "") for m in c.get("volumeMounts") or []]
        for repo_path in args.get("model-repository", []):
            if not any(repo_path == m or repo_path.startswith(m.rstrip("/") + "/") for m in mounts):
                rep.error(where, f"--model-repository {repo_path} is not under any volumeMount "
                                 f"({mounts})")
        # GPUs: a worker labelled device=gpu must get one; only such a worker may.
        limits = (c.get("resources") or {}).get("limits") or {}
        gpu_limit = limits.get("nvidia.com/gpu")
        wants_gpu = "device=gpu" in args.get("label", [])
        if wants_gpu and not (isinstance(gpu_limit, int) and gpu_limit >= 1):
            rep.error(where, "GPU worker (--label device=gpu) has no resources.limits "
                             "nvidia.com/gpu >= 1: it would be scheduled without a GPU")
        if gpu_limit and not wants_gpu:
            rep.error(where, "limits nvidia.com/gpu but does not advertise --label device=gpu, "
                             "so no GPU model would be placed on it")
        requests_gpu = ((c.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu")
        if requests_gpu is not None and requests_gpu != gpu_limit:
            rep.error(where, "nvidia.com/gpu requests and limits differ (extended resources "
                             "must be equal)")
        cap = as_int("memory-capacity-mb", None)
        mem = parse_quantity_mib(limits.get("memory"))
        if cap is not None:
            if mem is None:
                rep.error(where, "--memory-capacity-mb is set but the container has no memory limit")
            elif cap > mem:
                rep.error(where, f"--memory-capacity-mb {cap} exceeds the memory limit "
                                 f"({limits.get('memory')} = {mem:.0f} MiB)")

    def etcd_endpoint(self, w: Obj, where: str, url: str) -> None:
        m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", url)
        if not m:
            self.rep.error(where, f"--etcd-endpoints entry {url!r} is not http(s)://host:port")
            return
        host, port = m.group(1), int(m.group(2))
        labels = host.split(".")
        ns = w.namespace

        def in_ns(rest):  # <...>[.<ns>[.svc[.cluster.local]]]
            return not rest or (rest[0] == ns and rest[1:2] in ([], ["svc"]))

        svc, pod = None, None
        if labels[0] and (ns, labels[0]) in self.services and in_ns(labels[1:]):
            svc = self.services[(ns, labels[0])]
        elif len(labels) >= 2 and (ns, labels[1]) in self.services and in_ns(labels[2:]):
            svc, pod = self.services[(ns, labels[1])], labels[0]
        if svc is None:
            self.rep.error(where, f"--etcd-endpoints host {host!r} is not a Service (or a "
                                  f"StatefulSet pod of one) in namespace {ns!r}")
            return
        if pod is not None:
            sts = [s for s in self.workloads if s.kind == "StatefulSet" and s.namespace == ns
                   and (s.body.get("spec") or {}).get("serviceName") == svc.name]
            ok = any(re.fullmatch(re.escape(s.name) + r"-(\d+)", pod)
                     and int(pod.rsplit("-", 1)[1]) < int((s.body.get("spec") or {}).get("replicas", 1))
                     for s in sts)
            if not ok:
                self.rep.error(where, f"--etcd-endpoints host {host!r}: no StatefulSet behind "
                                      f"Service {svc.name} has a pod {pod!r}")
        svc_ports = [p.get("port") for p in (svc.body.get("spec") or {}).get("ports") or []]
        if port not in svc_ports:
            self.rep.error(where, f"--etcd-endpoints {url}: Service {svc.name} has no port {port} "
                                  f"(ports: {svc_ports})")

    # -- etcd ------------------------------------------------------------------------------------
    def etcd(self, w: Obj, c: dict, spec: dict) -> None:
        rep, where = self.rep, w.where(c.get("name"))
        if w.kind != "StatefulSet":
            rep.error(where, "etcd must run as a StatefulSet (stable names and volumes)")
            return
        flags = {}
        for tok in [*(c.get("command") or [])[1:], *(c.get("args") or [])]:
            k, _, v = str(tok).partition("=")
            flags[k.lstrip("-")] = v
        svc_name, replicas = spec.get("serviceName"), int(spec.get("replicas", 1))
        svc = self.services.get((w.namespace, svc_name))
        if svc is None or (svc.body.get("spec") or {}).get("clusterIP") != "None":
            rep.error(w.where(), f"serviceName {svc_name!r} must be a headless Service "
                                 f"(clusterIP: None) in these manifests")
        else:
            if not selector_matches(service_selector(svc.body["spec"].get("selector")),
                                    pod_template(w)[0].get("labels") or {}):
                rep.error(w.where(), f"headless Service {svc_name} does not select its pods")
            if not svc.body["spec"].get("publishNotReadyAddresses"):
                rep.error(svc.where(), "needs publishNotReadyAddresses: true, or members cannot "
                                       "resolve each other before quorum")
        if replicas > 1 and spec.get("podManagementPolicy") != "Parallel":
            rep.error(w.where(), "podManagementPolicy must be Parallel: with OrderedReady etcd-1 "
                                 "waits for etcd-0 to be ready, which needs a quorum")
        cluster = flags.get("initial-cluster")
        if cluster is None:
            rep.error(where, "no --initial-cluster")
            return
        members = dict(m.split("=", 1) for m in cluster.split(",") if "=" in m)
        want = [f"{w.name}-{i}" for i in range(replicas)]
        if sorted(members) != sorted(want):
            rep.error(where, f"--initial-cluster names {sorted(members)}, but the StatefulSet's "
                             f"{replicas} replicas are {want}")
        peer_ports = {str(p) for p in container_ports(c).values()}
        for name, url in members.items():
            m = re.fullmatch(r"https?://([^:/]+):(\d+)", url)
            if not m or not m.group(1).startswith(f"{name}.{svc_name}") or m.group(2) not in peer_ports:
                rep.error(where, f"--initial-cluster member {name}={url} must be "
                                 f"http://{name}.{svc_name}...:<peer containerPort>")
        adv = flags.get("initial-advertise-peer-urls", "")
        if not adv.startswith("http://$(") or f".{svc_name}" not in adv:
            rep.error(where, f"--initial-advertise-peer-urls {adv!r} must be "
                             f"http://$(POD_NAME).{svc_name}...:<peer port>")

    def worker_prestop_drain(self, where: str, c: dict, endpoints: str, worker_id: str | None,
                             prefix: str) -> None:
        """A fleet worker drains in preStop through nereidctl, against its own etcd and id, bound
        to its registration: otherwise a rollout takes its models away before they load
        elsewhere, or leaves a drain behind that a later pod of the same id would inherit."""
        drain = prestop_drain(c)
        if drain is None:
            self.rep.error(where, "no preStop `nereidctl drain $POD_NAME --until-exit --wait-secs N`: "
                                  "SIGTERM alone unloads this worker's models before any other worker "
                                  "has loaded them")
            return
        if drain["endpoints"] != endpoints:
            self.rep.error(where, f"preStop drain --etcd-endpoints {drain['endpoints']!r} is not the "
                                  f"worker's {endpoints!r}")
        if drain["prefix"] != prefix:
            self.rep.error(where, f"preStop drain --etcd-prefix {drain['prefix']!r} is not the "
                                  f"worker's {prefix!r}: it would find no such worker and drain nothing")
        want = re.fullmatch(r"\$\((\w+)\)", worker_id or "")
        target = drain["target"] or ""
        if not want or target not in (f"${want.group(1)}", f"${{{want.group(1)}}}"):
            self.rep.error(where, f"preStop drain names {target!r}, not this worker's "
                                  f"--worker-id={worker_id} (as ${{VAR}} in the shell)")
        if not drain["until_exit"]:
            self.rep.error(where, "preStop drain without --until-exit: the drain would outlive the "
                                  "pod in etcd")
        if drain["wait"] <= 0:
            self.rep.error(where, "preStop drain without --wait-secs: SIGTERM would follow before "
                                  "the models are loaded elsewhere")

    # -- Services and PDBs -----------------------------------------------------------------------
    def service(self, s: Obj) -> None:
        spec = s.body.get("spec") or {}
        selector = service_selector(spec.get("selector"))
        pods = self.selected(s.namespace, selector)
        if not pods:
            self.rep.error(s.where(), f"selector {spec.get('selector')} selects no pods of any "
                                      f"workload in these manifests")
        names = [p.get("name") for p in spec.get("ports") or []]
        if len(names) > 1 and (not all(isinstance(n, str) for n in names) or len(set(names)) != len(names)):
            self.rep.error(s.where(), f"ports need unique names: {names}")
        for p in spec.get("ports") or []:
            if not isinstance(p.get("port"), int) or not 0 < p["port"] < 65536:
                self.rep.error(s.where(), f"port {p.get('name')}: port {p.get('port')!r} is not a "
                                          f"port number")
            target = str(p.get("targetPort", p.get("port")))
            for w in pods:
                containers = pod_template(w)[1].get("containers") or []
                if not any(target in container_ports(c) for c in containers):
                    self.rep.error(s.where(), f"port {p.get('name')}: targetPort {target!r} is not a "
                                              f"containerPort of {w.kind}/{w.name}")
                # The metrics port also serves operator endpoints (POST /v2/logging): scraped on
                # the pods, never published to clients.
                metrics = {container_ports(c).get("metrics") for c in containers} - {None}
                if any(container_ports(c).get(target) in metrics for c in containers):
                    self.rep.error(s.where(), f"port {p.get('name')}: targetPort {target!r} is the "
                                              f"metrics port of {w.kind}/{w.name}, which also serves "
                                              f"operator endpoints (POST /v2/logging); let Prometheus "
                                              f"scrape the pods instead")

    def pvc(self, p: Obj) -> None:
        spec = p.body.get("spec") or {}
        modes = spec.get("accessModes")
        known = {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
        if not isinstance(modes, list) or not modes or not set(modes) <= known:
            self.rep.error(p.where(), f"accessModes {modes!r} must be a non-empty list of {sorted(known)}")
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
        if parse_quantity_mib(storage) is None:
            self.rep.error(p.where(), f"resources.requests.storage {storage!r} is not a quantity")
        users = [w for w in self.workloads if p.name in (
            (v.get("persistentVolumeClaim") or {}).get("claimName")
            for v in pod_template(w)[1].get("volumes") or [])]
        if not users:
            self.rep.error(p.where(), "no workload mounts this claim")

    def pdb(self, p: Obj) -> None:
        spec = p.body.get("spec") or {}
        pods = self.selected(p.namespace, spec.get("selector"))
        if not pods:
            self.rep.error(p.where(), "selector selects no pods of any workload in these manifests")
        if ("minAvailable" in spec) == ("maxUnavailable" in spec):
            self.rep.error(p.where(), "set exactly one of minAvailable / maxUnavailable")
        for k in ("minAvailable", "maxUnavailable"):
            v = spec.get(k, 0)
            if not (isinstance(v, int) and v >= 0) and not (isinstance(v, str) and re.fullmatch(r"\d+%", v)):
                self.rep.error(p.where(), f"{k} {v!r} must be a count or a percentage")
        total = sum(int((w.body.get("spec") or {}).get("replicas", 1)) for w in pods)
        if isinstance(spec.get("minAvailable"), int) and pods and spec["minAvailable"] >= total:
            self.rep.error(p.where(), f"minAvailable {spec['minAvailable']} >= the {total} replicas "
                                      f"it covers: no pod could ever be evicted (node drains hang)")
        if spec.get("maxUnavailable") == 0:
            self.rep.error(p.where(), "maxUnavailable 0: no pod could ever be evicted")

    def shape(self, o: Obj) -> bool:
        """Types of the fields the checks walk; a wrong one is reported, not crashed on."""
        ok = True

        def want(value, typ, path):
            nonlocal ok
            if value is not None and not isinstance(value, typ):
                self.rep.error(o.where(), f"{path} must be a {typ.__name__}, not "
                                          f"{type(value).__name__}")
                ok = False
            return value if isinstance(value, typ) else None

        want(o.body.get("metadata"), dict, "metadata")
        for k in ("labels", "annotations"):
            want(o.meta.get(k), dict, f"metadata.{k}")
        spec = want(o.body.get("spec"), dict, "spec") or {}
        if o.kind == "Service":
            want(spec.get("selector"), dict, "spec.selector")
            for i, p in enumerate(want(spec.get("ports"), list, "spec.ports") or []):
                want(p, dict, f"spec.ports[{i}]")
        if o.kind not in WORKLOAD_KINDS | {"PodDisruptionBudget"}:
            return ok
        sel = want(spec.get("selector"), dict, "spec.selector") or {}
        want(sel.get("matchLabels"), dict, "spec.selector.matchLabels")
        want(sel.get("matchExpressions"), list, "spec.selector.matchExpressions")
        if o.kind == "PodDisruptionBudget":
            return ok
        tmpl = want(spec.get("template"), dict, "spec.template") or {}
        tmeta = want(tmpl.get("metadata"), dict, "spec.template.metadata") or {}
        want(tmeta.get("labels"), dict, "spec.template.metadata.labels")
        want(tmeta.get("annotations"), dict, "spec.template.metadata.annotations")
        pod = want(tmpl.get("spec"), dict, "spec.template.spec") or {}
        for i, v in enumerate(want(pod.get("volumes"), list, "volumes") or []):
            want(v, dict, f"volumes[{i}]")
        for i, c in enumerate(want(pod.get("containers"), list, "containers") or []):
            c = want(c, dict, f"containers[{i}]") or {}
            for k in ("command", "args", "ports", "env", "volumeMounts", "envFrom"):
                for j, item in enumerate(want(c.get(k), list, f"containers[{i}].{k}") or []):
                    if k in ("ports", "env", "volumeMounts", "envFrom"):
                        want(item, dict, f"containers[{i}].{k}[{j}]")
            for k in ("resources", "lifecycle", "livenessProbe", "readinessProbe", "startupProbe",
                      "securityContext"):
                want(c.get(k), dict, f"containers[{i}].{k}")
        return ok

    def run(self, kustomization: dict | None, files: list[str]) -> None:
        self.structure(kustomization, files)
        checks = {"Service": self.service, "PodDisruptionBudget": self.pdb, "PersistentVolumeClaim": self.pvc,
                  **{k: self.workload for k in WORKLOAD_KINDS}}
        for o in self.objs:
            if o.kind in checks and self.shape(o):
                try:
                    checks[o.kind](o)
                except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
                    self.rep.error(o.where(), f"malformed ({type(e).__name__}: {e}); check the "
                                              f"types of its fields")
        if len(self.etcd_prefixes) > 1:
            self.rep.error("manifests", "nereid containers disagree on --etcd-prefix: " + "; ".join(
                f"{k} in {', '.join(v)}" for k, v in self.etcd_prefixes.items()))


# --------------------------------------------------------------------------------------------
# kubectl, when present.
# --------------------------------------------------------------------------------------------
def kubectl_checks(directory: Path, objs: list[Obj], dry_run: str | None, rep: Report) -> None:
    kubectl = shutil.which("kubectl")
    kubeconform = shutil.which("kubeconform")
    if kubeconform:
        rep.notes.append(f"kubeconform found at {kubeconform} but not run: it fetches its "
                         f"schemas from the network")
    if not kubectl:
        rep.notes.append("kubectl not found: kustomize rendering not checked")
        return
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        rep.error("kustomization.yaml", f"`kubectl kustomize` failed: {out.stderr.strip()}")
        return
    rendered = {(d.get("kind"), (d.get("metadata") or {}).get("name"))
                for d in yaml.safe_load_all(out.stdout) if d}
    loaded = {(o.kind, o.name) for o in objs}
    if rendered != loaded:
        rep.error("kustomization.yaml", f"`kubectl kustomize` renders {sorted(rendered - loaded)} "
                                        f"extra and misses {sorted(loaded - rendered)}")
    rep.notes.append(f"`kubectl kustomize` rendered {len(rendered)} objects")
    if dry_run:
        out = subprocess.run([kubectl, "apply", f"--dry-run={dry_run}", "-k", str(directory)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            rep.error("kubectl", f"`kubectl apply --dry-run={dry_run}` failed: {out.stderr.strip()}")
        else:
            rep.notes.append(f"`kubectl apply --dry-run={dry_run}` accepted every object")
    else:
        rep.notes.append("`kubectl apply --dry-run` not run (it needs a cluster; pass "
                         "--kubectl-dry-run client|server to run it)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", nargs="?", default=str(HERE))
    ap.add_argument("--flags-from", choices=("auto", "binary", "builtin"), default="auto",
                    help="auto: a built binary's --help if one is found, else the built-in list")
    ap.add_argument("--worker-bin", help="nereid-worker to read --help from")
    ap.add_argument("--gateway-bin", help="nereid-gateway to read --help from")
    ap.add_argument("--no-kubectl", action="store_true", help="skip `kubectl kustomize`")
    ap.add_argument("--kubectl-dry-run", choices=("client", "server"),
                    help="also `kubectl apply --dry-run=...` (needs a reachable cluster)")
    a = ap.parse_args(argv)
    directory = Path(a.directory)
    if not directory.is_dir():
        print(f"validate.py: {directory} is not a folder", file=sys.stderr)
        return 2
    rep = Report()
    flagsets = load_flagsets(a.flags_from, {"nereid-worker": a.worker_bin,
                                            "nereid-gateway": a.gateway_bin}, rep.notes, rep.errors)
    objs, kustomization, files = load_dir(directory, rep)
    Validator(objs, flagsets, rep).run(kustomization, files)
    if not a.no_kubectl and not rep.errors:
        kubectl_checks(directory, objs, a.kubectl_dry_run, rep)
    for n in rep.notes:
        print(f"note: {n}")
    for e in rep.errors:
        print(f"error: {e}")
    if rep.errors:
        print(f"{len(rep.errors)} problem(s) in {directory}")
        return 1
    print(f"ok: {len(objs)} objects in {len(files)} files in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
