#!/usr/bin/env python3
"""Gateway benchmark: the same perf_analyzer load straight to a worker and through the gateway,
in one run, on one worker — what the gateway costs.

    .venv/bin/python bench/gateway_bench.py            # full run (bounded: < 20 minutes)
    .venv/bin/python bench/gateway_bench.py --quick    # smoke run (1 s windows)

Measured per model (identity_fp32, mlp_fp32) x protocol (gRPC, HTTP) x concurrency (1, 16):
infer/s and latency percentiles, direct, through a byte-copying TCP relay
(gateway/examples/tcp_relay.rs: the cost of one more loopback hop and process alone, the floor
under any proxy on this machine) and through the gateway, rotating which goes first per point. Reported: the p50 the gateway adds at concurrency 1 (target <= 50 us) and the
throughput ratio gateway / direct at concurrency 16 (target >= 0.95). Also runs the
routing-decision micro-benchmark (gateway/benches/routing.rs). Results:
bench/results/gateway.json and gateway.md.

The gateway runs with a static worker list (`--worker-grpc`): its request path is the same as
with etcd membership (the table is a snapshot either way); etcd only changes how the table is
built. Client, gateway and worker share this machine's cores — the ratios are what this host
shows, not what separate hosts would.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_bench import (  # noqa: E402
    ROOT,
    CpuMeter,
    LoopbackPorts,
    Worker,
    build_and_install_pa,
    kill_group,
    log,
    machine_info,
    pa_fields,
    run_perf_analyzer,
    sh,
)

MODELS = ["identity_fp32", "mlp_fp32"]
PROTOCOLS = ["grpc", "http"]
CONCURRENCY = [1, 16]
TARGET_ADDED_P50_US = 50.0
TARGET_RATIO_C16 = 0.95
TOTAL_BUDGET_S = 19 * 60


class Gateway(LoopbackPorts):
    def __init__(self, binary: Path, worker: Worker, workdir: Path):
        self.binary, self.worker, self.workdir = binary, worker, workdir
        self.proc: subprocess.Popen | None = None
        self.ports: dict = {}

    def start(self, models: list[str]) -> None:
        port_file = self.workdir / "gateway-ports.json"
        cmd = [str(self.binary), "--worker-grpc", self.worker.grpc, "--address", "127.0.0.1",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--port-file", str(port_file),
               "--discovery-interval-ms", "500"]
        log(f"starting gateway: {' '.join(cmd)}")
        with open(self.workdir / "gateway.log", "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}")
            if not self.ports and port_file.is_file():
                try:
                    self.ports = json.loads(port_file.read_text())
                except json.JSONDecodeError:
                    pass
            if self.ports and all(self._model_ready(m) for m in models):
                log(f"gateway ready: {self.ports}")
                return
            time.sleep(0.2)
        raise RuntimeError("gateway not routing every model within 60 s")

    def _model_ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http}/v2/models/{model}/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc, grace=10.0)


class ThroughGateway:
    """What run_perf_analyzer needs of a target: addresses from the gateway, statistics from
    the worker behind it."""

    def __init__(self, gateway: Gateway, worker: Worker):
        self.gateway, self.worker = gateway, worker

    @property
    def http(self) -> str:
        return self.gateway.http

    @property
    def grpc(self) -> str:
        return self.gateway.grpc

    def stats(self, model: str):
        return self.worker.stats(model)

    def alive(self) -> bool:
        return self.gateway.alive() and self.worker.alive()


class Relay(LoopbackPorts):
    """Two byte-copying TCP relays (gateway/examples/tcp_relay.rs), one per worker port."""

    def __init__(self, binary: Path, worker: Worker, workdir: Path):
        self.binary, self.worker, self.workdir = binary, worker, workdir
        self.procs: list[subprocess.Popen] = []
        self.ports: dict = {}

    def start(self) -> None:
        for proto, upstream in (("http", self.worker.http), ("grpc", self.worker.grpc)):
            port_file = self.workdir / f"relay-{proto}.port"
            with open(self.workdir / f"relay-{proto}.log", "wb") as f:
                self.procs.append(subprocess.Popen([str(self.binary), str(port_file), upstream], cwd=ROOT, stdout=f,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + 30
            while not port_file.is_file():
                if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {proto} relay did not start")
                time.sleep(0.05)
            self.ports[proto] = int(port_file.read_text())
        log(f"relays ready: {self.ports}")

    def stats(self, model: str):
        return self.worker.stats(model)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs) and self.worker.alive()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_group(p)


def fmt(v, spec=",.0f") -> str:
    return "–" if v is None else format(v, spec)


def write_markdown(path: Path, report: dict) -> None:
    m = report["machine"]
    lines = [
        "# Gateway benchmark: through the gateway vs straight to the worker",
        "",
        f"Run {report['finished']} on {m['nproc']} cores ({m['cpu_model']}), commit `{m['git_commit'][:12]}`"
        f"{' (dirty)' if m['git_dirty'] else ''}. perf_analyzer {report['pa_mode']} mode, "
        f"{report['interval_ms']} ms windows; client, gateway and worker share the cores. "
        "Produced by `bench/gateway_bench.py`.",
        "",
    ]
    if report.get("incomplete"):
        lines += ["**Incomplete:** the run's time budget ran out; the points below are those measured.", ""]
    lines += [
        "| model | protocol | concurrency | direct infer/s | gateway infer/s | ratio | direct p50 µs | gateway p50 µs | added p50 µs | direct p99 µs | gateway p99 µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def mark(r: dict) -> str:
        return "†" if r.get("stabilised_on") == "average" else ""

    for p in report["points"]:
        d, g = p["direct"], p["gateway"]
        lines.append(
            f"| {p['model']} | {p['protocol']} | {p['concurrency']} | {fmt(d.get('infer_per_s'))}{mark(d)} | "
            f"{fmt(g.get('infer_per_s'))}{mark(g)} | {fmt(p.get('ratio'), '.3f')} | {fmt(d.get('p50_us'))} | "
            f"{fmt(g.get('p50_us'))} | {fmt(p.get('added_p50_us'))} | {fmt(d.get('p99_us'))} | {fmt(g.get('p99_us'))} |"
        )
    lines += ["", "† stabilised on the average latency: p99 would not settle within the trials (perf_analyzer "
              "still reports the percentiles)."]
    # A run that gave no measurement at all (– in the tables): what perf_analyzer said last.
    for p in report["points"]:
        for side in ("direct", "gateway", "relay"):
            attempts = p.get(side, {}).get("error")
            if attempts:
                tail = [ln for ln in (attempts[-1].get("output_tail") or "").splitlines() if ln.strip()]
                lines.append(f"- no {side} measurement for {p['model']} {p['protocol']} c={p['concurrency']} "
                             f"after {len(attempts)} attempts: {tail[-1] if tail else 'no output'}"
                             + (f" ({sum('CURLMsg' in ln for ln in tail)} perf_analyzer HTTP client errors "
                                "'Unexpected error: received CURLMsg')" if any("CURLMsg" in ln for ln in tail) else ""))
    if any("relay" in p for p in report["points"]):
        lines += [
            "",
            "## The floor: a byte-copying TCP relay in the gateway's place",
            "",
            "`gateway/examples/tcp_relay.rs` copies bytes between the client's connection and one to the worker, "
            "on one event-loop thread like the gateway: no HTTP/2, no routing. What it adds is what one more "
            "loopback hop and one more process cost on this machine by themselves — the floor under any proxy "
            "here. Measured in the same run, the same load, direct and gateway runs alternating with it.",
            "",
            "| model | protocol | concurrency | relay infer/s | relay ratio | relay added p50 µs | gateway ratio | gateway added p50 µs | relay CPU µs/req |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in report["points"]:
            r = p.get("relay") or {}
            rc = r.get("cpu_pct") or {}
            per_req = (10_000 * rc["relay"] / r["infer_per_s"]
                       if rc.get("relay") is not None and r.get("infer_per_s") else None)
            lines.append(
                f"| {p['model']} | {p['protocol']} | {p['concurrency']} | {fmt(r.get('infer_per_s'))}{mark(r)} | "
                f"{fmt(p.get('relay_ratio'), '.3f')} | {fmt(p.get('relay_added_p50_us'))} | "
                f"{fmt(p.get('ratio'), '.3f')} | {fmt(p.get('added_p50_us'))} | {fmt(per_req, '.0f')} |"
            )
    lines += [
        "",
        "## CPU during each run",
        "",
        "Percent of one core over the whole perf_analyzer run (warm-up and every trial), from /proc; "
        f"*gateway µs/req* = gateway CPU ÷ gateway infer/s. {m['nproc']} cores in all: where the sum stays "
        f"well under {100 * (m['nproc'] or 1)} %, the run was bound by wake-up latency between the processes, "
        "not by CPU.",
        "",
        "| model | protocol | concurrency | direct: worker / client % | gateway run: gateway / worker / client % | gateway µs/req |",
        "|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        dc, gc = p["direct"].get("cpu_pct") or {}, p["gateway"].get("cpu_pct") or {}
        per_req = (10_000 * gc["gateway"] / p["gateway"]["infer_per_s"]
                   if gc.get("gateway") is not None and p["gateway"].get("infer_per_s") else None)
        lines.append(
            f"| {p['model']} | {p['protocol']} | {p['concurrency']} | {fmt(dc.get('worker'), '.0f')} / "
            f"{fmt(dc.get('client'), '.0f')} | {fmt(gc.get('gateway'), '.0f')} / {fmt(gc.get('worker'), '.0f')} / "
            f"{fmt(gc.get('client'), '.0f')} | {fmt(per_req, '.0f')} |"
        )
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['name']}: **{t['value']}** (target {t['target']}) — {'PASS' if t['pass'] else 'FAIL'}")
    r = report.get("routing")
    if r:
        lines += [
            "",
            "## Routing decision (micro-benchmark, `cargo bench -p nereid-gateway --bench routing`)",
            "",
            f"{r['workers']} workers × {r['models']} models, every worker holding every model: "
            f"p50 {r['p50_us']:.2f} µs, p99 **{r['p99_us']:.2f} µs** (target ≤ 10 µs), p99.9 {r['p999_us']:.2f} µs; "
            f"rebuilding the snapshot ({r['workers'] * r['models']:,} rows, off the request path) "
            f"{r['snapshot_rebuild_ms']:.1f} ms.",
        ]
    lines += ["", "Bar to beat (issue 4): nginx in front of Triton adds ~200 µs p50 over gRPC and keeps 0.75 of "
              "the throughput at concurrency 16 (measured on the 2-core development VM).", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 s windows")
    ap.add_argument("--no-build", action="store_true", help="use the binaries already in target/release")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--interval-ms", type=int, default=None, help="perf_analyzer window; default 3000 (quick: 1000)")
    ap.add_argument("--stability", type=int, default=20)
    ap.add_argument("--max-trials", type=int, default=5)
    ap.add_argument("--pa-mode", choices=["async", "sync"], default="async")
    ap.add_argument("--pa-max-threads", type=int, default=4)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--perf-analyzer", default=None, metavar="PATH",
                    help="use this perf_analyzer (wrapper) instead of installing one (offline hosts; with --no-build)")
    ap.add_argument("--no-routing", action="store_true",
                    help="skip the routing micro-benchmark (it needs cargo)")
    ap.add_argument("--routing-only", action="store_true",
                    help="re-run only the routing micro-benchmark and update it in an existing gateway.json/md")
    args = ap.parse_args()
    args.interval_ms = args.interval_ms or (1000 if args.quick else 3000)
    args.retry_unstable = True
    args.http_input_data = None
    models = [m for m in args.models.split(",") if m]
    protocols = [p for p in args.protocols.split(",") if p]

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    t_end = time.monotonic() + TOTAL_BUDGET_S
    if args.routing_only:
        out = Path(args.out_dir)
        report = json.loads((out / "gateway.json").read_text())
        report["routing"] = run_routing_bench(Path(tempfile.mkdtemp(prefix="nereid-routing-")), 900)
        write_report(out, report)
        return 0 if report["routing"] else 1

    if args.no_routing and Path(args.out_dir).resolve() == (ROOT / "bench" / "results").resolve():
        ap.error("--no-routing would leave bench/results/gateway.json without the routing results: give --out-dir")
    if args.perf_analyzer and not args.no_build:
        ap.error("--perf-analyzer goes with --no-build (offline hosts)")
    if not args.perf_analyzer and not build_and_install_pa(["nereid-worker", "nereid-gateway"], build=not args.no_build):
        return 1
    relay_bin = ROOT / "target/release/examples/tcp_relay"
    if not args.no_build or not relay_bin.is_file():
        res = sh(["cargo", "build", "--release", "--locked", "-p", "nereid-gateway", "--example", "tcp_relay"], timeout=900)
        if res.returncode != 0:
            print((res.stdout or "")[-3000:], file=sys.stderr)
            return 1
    pa = Path(args.perf_analyzer).resolve() if args.perf_analyzer else ROOT / ".deps/perf_analyzer/perf_analyzer.sh"
    machine = machine_info()

    workdir = Path(tempfile.mkdtemp(prefix="nereid-gw-bench-"))
    worker = Worker(ROOT / "target/release/nereid-worker", ROOT / "examples/models", workdir, 1)
    gateway = Gateway(ROOT / "target/release/nereid-gateway", worker, workdir)
    relay = Relay(relay_bin, worker, workdir)
    points = []
    budget_spent = False
    try:
        worker.start()
        gateway.start(models)
        relay.start()
        through = ThroughGateway(gateway, worker)
        n = 0
        for model in models:
            for protocol in protocols:
                for c in CONCURRENCY:
                    order = [("direct", worker), ("relay", relay), ("gateway", through)]
                    order = order[n % 3:] + order[:n % 3]
                    n += 1
                    point = {"model": model, "protocol": protocol, "concurrency": c}
                    for name, target in order:
                        left = t_end - time.monotonic()
                        if left < 30:
                            raise BudgetSpent()
                        log(f"{model} {protocol} c={c} {name}")
                        # The relays' CPU: the one on this protocol's port does the work.
                        relay_pid = relay.procs[0 if protocol == "http" else 1].pid if name == "relay" else None
                        meter = CpuMeter({
                            "gateway": gateway.proc.pid if name == "gateway" and gateway.proc else None,
                            "relay": relay_pid,
                            "worker": worker.proc.pid if worker.proc else None,
                        })
                        rec = run_perf_analyzer(pa, target, model, protocol, c, args, workdir, timeout=min(180, left))
                        point[name] = pa_fields(rec) if rec.get("ok") else {"error": rec.get("attempts")}
                        point[name]["cpu_pct"] = meter.finish()
                    d, g = point["direct"], point["gateway"]
                    if d.get("infer_per_s") and g.get("infer_per_s"):
                        point["ratio"] = g["infer_per_s"] / d["infer_per_s"]
                    if d.get("p50_us") is not None and g.get("p50_us") is not None:
                        point["added_p50_us"] = g["p50_us"] - d["p50_us"]
                    r = point["relay"]
                    if d.get("infer_per_s") and r.get("infer_per_s"):
                        point["relay_ratio"] = r["infer_per_s"] / d["infer_per_s"]
                    if d.get("p50_us") is not None and r.get("p50_us") is not None:
                        point["relay_added_p50_us"] = r["p50_us"] - d["p50_us"]
                    log(f"  -> ratio {point.get('ratio')}, added p50 {point.get('added_p50_us')} us")
                    points.append(point)
    except BudgetSpent:
        # What was measured is still reported (marked incomplete), not thrown away.
        budget_spent = True
        log("time budget spent: writing the points measured so far")
    finally:
        relay.stop()
        gateway.stop()
        worker.stop()

    routing = None if args.no_routing else run_routing_bench(workdir, max(60, t_end - time.monotonic()))

    report = {
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "pa_mode": args.pa_mode, "interval_ms": args.interval_ms,
        "points": points, "routing": routing, "incomplete": budget_spent,
    }
    write_report(Path(args.out_dir), report)
    return 0


class BudgetSpent(Exception):
    """The run's time budget ran out before every point was measured."""


def run_routing_bench(workdir: Path, timeout: float) -> dict | None:
    bench_json = workdir / "routing.json"
    res = sh(["cargo", "bench", "--locked", "-p", "nereid-gateway", "--bench", "routing", "--", "--json", str(bench_json)],
             timeout=timeout)
    if res.returncode == 0 and bench_json.is_file():
        return json.loads(bench_json.read_text())
    log("routing micro-benchmark failed:\n" + res.stdout[-2000:])
    return None


def write_report(out: Path, report: dict) -> None:
    points, routing = report["points"], report.get("routing")
    targets = []
    for p in points:
        if p["concurrency"] == 1 and "added_p50_us" in p:
            targets.append({"name": f"added p50, {p['model']} {p['protocol']} c=1 (µs)", "value": round(p["added_p50_us"]),
                            "target": f"≤ {TARGET_ADDED_P50_US:.0f}", "pass": p["added_p50_us"] <= TARGET_ADDED_P50_US})
        if p["concurrency"] == 16 and "ratio" in p:
            targets.append({"name": f"throughput ratio, {p['model']} {p['protocol']} c=16", "value": round(p["ratio"], 3),
                            "target": f"≥ {TARGET_RATIO_C16}", "pass": p["ratio"] >= TARGET_RATIO_C16})
    if routing:
        targets.append({"name": "routing decision p99 (µs)", "value": round(routing["p99_us"], 2), "target": "≤ 10",
                        "pass": routing["p99_us"] <= 10.0})
    report["targets"] = targets
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(report, indent=2))
    write_markdown(out / "gateway.md", report)
    print((out / "gateway.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
