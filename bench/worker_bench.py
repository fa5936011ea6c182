#!/usr/bin/env python3
"""Worker benchmark: served throughput (perf_analyzer against a real nereid-worker) compared
with what ONNX Runtime does in-process through the worker's own batch path (nereid-ort-bench).

    .venv/bin/python bench/worker_bench.py            # full run (bounded: < 20 minutes)
    .venv/bin/python bench/worker_bench.py --quick    # smoke run (concurrency 1,16; 1 s windows)
    .venv/bin/python bench/worker_bench.py --gpu 0    # GPU host: KIND_GPU instances, CUDA baseline

Steps: build the release binaries, install perf_analyzer (bench/setup_perf_analyzer.sh), start
the worker on examples/models with ephemeral ports, run perf_analyzer per model x protocol x
concurrency while reading the worker's statistics before and after each run (average executed
batch = d(inference_count) / d(execution_count)), stop the worker, run nereid-ort-bench per
model x batch size x intra-op threads, then write bench/results/worker.json and worker.md.

With --gpu ID (a `cuda` build and onnxruntime-gpu's library in NEREID_ORT_LIB) the worker serves
a copy of examples/models whose instance groups are `--gpu-instances` KIND_GPU instances on that
GPU, nereid-ort-bench runs on the same GPU, and the results go to worker-gpu.json / .md.

Only the standard library is used. Every wait is bounded; the worker is stopped on every exit
path (try/finally, SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import atexit
import csv
import datetime as dt
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["identity_fp32", "mlp_fp32", "convnet_fp32"]
# "+shm": perf_analyzer --shared-memory system (Triton's system shared-memory extension): the
# tensors go through POSIX shared memory, the requests still over the protocol.
PROTOCOLS = ["grpc", "http", "grpc+shm"]
FULL_CONCURRENCY = [1, 4, 16, 64, 128]
QUICK_CONCURRENCY = [1, 16]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]
ORT_THREADS = [1, 2]
TOTAL_BUDGET_S = 19 * 60  # the whole run, build included
READY_TIMEOUT_S = 90
MAX_WORKER_RESTARTS = 2

# Targets (see bench/README.md).
TARGET_CONVNET_RATIO = 0.90  # convnet @ concurrency 128: served infer/s >= 0.90 x best in-process rows/s
TARGET_IDENTITY_GRPC_C16 = 25_000.0  # identity over gRPC @ concurrency 16: infer/s


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sh(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Runs cmd in its own process group; on timeout kills the whole group."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out + f"\n[bench] timed out after {timeout:.0f}s", None)
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def build_and_install_pa(packages: list[str], build: bool = True) -> bool:
    """Builds `packages` in release mode (`--locked`; skipped when `build` is false) and installs
    perf_analyzer; on failure prints the tail of the output and returns False."""
    steps = [["bash", str(ROOT / "bench/setup_perf_analyzer.sh")]]
    if build:
        steps.insert(0, ["cargo", "build", "--release", "--locked", *[a for p in packages for a in ("-p", p)]])
    for cmd in steps:
        res = sh(cmd, timeout=900)
        if res.returncode != 0:
            print((res.stdout or "")[-3000:], file=sys.stderr)
            return False
    return True


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process `pid` (all its threads), from /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """CPU used during one client run by the named processes (`pids`: name → pid, or None when
    not running) and by the client — the children this script ran meanwhile — as a percentage
    of one core over the run's wall time."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = pids
        self.start = {k: cpu_seconds(p) for k, p in self.pids.items()}
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.client0 = r.ru_utime + r.ru_stime
        self.t0 = time.monotonic()

    def finish(self) -> dict:
        wall = time.monotonic() - self.t0
        out = {}
        for k, p in self.pids.items():
            now = cpu_seconds(p)
            if now is not None and self.start[k] is not None and wall > 0:
                out[k] = round(100 * (now - self.start[k]) / wall, 1)
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        if wall > 0:
            out["client"] = round(100 * (r.ru_utime + r.ru_stime - self.client0) / wall, 1)
        return out


def kill_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    if proc.poll() is not None:
        return
    try:
        if grace > 0:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


# --------------------------------------------------------------------------------------------
# Machine / provenance


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": mem_gib,
        "kernel": os.uname().release,
        "git_commit": commit,
        "git_dirty": dirty,
        "loadavg_start": loadavg(),
    }


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Worker process


class LoopbackPorts:
    """A server on loopback whose ports (`self.ports`: "http", "grpc") are known once started."""

    ports: dict

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"


class Worker(LoopbackPorts):
    def __init__(self, binary: Path, repo: Path, workdir: Path, intra_op_threads: int):
        self.binary, self.repo, self.workdir = binary, repo, workdir
        self.intra_op_threads = intra_op_threads
        self.proc: subprocess.Popen | None = None
        self.ports: dict = {}
        self.starts = 0
        self.log_paths: list[Path] = []
        self.exits: list[dict] = []  # unexpected exits seen

    def start(self) -> None:
        self.starts += 1
        port_file = self.workdir / f"ports-{self.starts}.json"
        log_path = self.workdir / f"worker-{self.starts}.log"
        self.log_paths.append(log_path)
        cmd = [str(self.binary), "--model-repository", str(self.repo), "--address", "127.0.0.1",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
               "--intra-op-threads", str(self.intra_op_threads), "--allow-client-shm=true",
               "--port-file", str(port_file)]
        log(f"starting worker: {' '.join(cmd)}")
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if not self.ports and port_file.is_file():
                try:
                    self.ports = json.loads(port_file.read_text())
                except json.JSONDecodeError:
                    pass
            if self.ports:
                try:
                    with urllib.request.urlopen(f"http://{self.http}/v2/health/ready", timeout=2) as r:
                        if r.status == 200:
                            log(f"worker ready: {self.ports}")
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"worker not ready within {READY_TIMEOUT_S}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            log("stopping worker (SIGTERM)")
            kill_group(self.proc, grace=20.0)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_paths:
            return ""
        try:
            return "\n".join(self.log_paths[-1].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stats(self, model: str) -> dict | None:
        try:
            s = http_json(f"http://{self.http}/v2/models/{model}/stats")["model_stats"]
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            log(f"stats({model}) failed: {e}")
            return None
        return s[0] if s else None


def stats_delta(before: dict | None, after: dict | None) -> dict:
    if not before or not after:
        return {"error": "statistics unavailable"}

    def d(path: list[str]) -> int:
        a, b = after, before
        for p in path:
            a, b = a.get(p, {}), b.get(p, {})
        return int(a or 0) - int(b or 0)

    inf = d(["inference_count"])
    exe = d(["execution_count"])
    out = {
        "inference_count": inf,
        "execution_count": exe,
        "avg_exec_batch": (inf / exe) if exe > 0 else None,
        "success": d(["inference_stats", "success", "count"]),
        "fail": d(["inference_stats", "fail", "count"]),
    }
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        n = d(["inference_stats", key, "count"])
        ns = d(["inference_stats", key, "ns"])
        out[f"{key}_us_per_request"] = (ns / n / 1e3) if n > 0 else None
    hist: dict[int, int] = {}
    prev = {b["batch_size"]: b["compute_infer"]["count"] for b in before.get("batch_stats", [])}
    for b in after.get("batch_stats", []):
        n = b["compute_infer"]["count"] - prev.get(b["batch_size"], 0)
        if n > 0:
            hist[int(b["batch_size"])] = n
    out["exec_batch_histogram"] = dict(sorted(hist.items()))
    return out


# --------------------------------------------------------------------------------------------
# perf_analyzer


def parse_pa_csv(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    row = rows[0]
    out = {}
    for k, v in row.items():
        if k is None:
            continue
        k = k.strip()
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            out[k] = v
    return out


def run_perf_analyzer(pa: Path, worker: Worker, model: str, protocol: str, concurrency: int, args,
                      workdir: Path, timeout: float) -> dict:
    wire, _, memory = protocol.partition("+")
    url = worker.grpc if wire == "grpc" else worker.http
    csv_path = workdir / f"pa-{model}-{protocol}-c{concurrency}.csv"
    base = [str(pa), "-m", model, "-u", url, "-i", wire, "-b", "1",
            "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(args.interval_ms)]
    if args.pa_mode == "async":
        base += ["--async", "--max-threads", str(args.pa_max_threads)]
    else:
        base += ["--sync"]
    if memory == "shm":
        base += ["--shared-memory", "system", "--output-shared-memory-size", "65536"]
    if wire == "http" and args.http_input_data:
        base += ["--input-data", args.http_input_data]
    # Stabilised on p99 first; a point whose p99 will not settle (concurrency 1 on shared cores,
    # where one descheduled request moves it) is measured again stabilised on the average
    # latency — perf_analyzer still reports the percentiles.
    attempts = [(args.stability, args.max_trials, True)]
    if args.retry_unstable:
        attempts.append((max(args.stability, 50), 3, True))
        attempts.append((args.stability, args.max_trials, False))
    record: dict = {"model": model, "protocol": protocol, "concurrency": concurrency, "attempts": []}
    t_end = time.monotonic() + timeout
    for stability, trials, on_p99 in attempts:
        left = t_end - time.monotonic()
        if left < 5:
            break
        csv_path.unlink(missing_ok=True)
        cmd = base + ["--stability-percentage", str(stability), "--max-trials", str(trials), "-f", str(csv_path)]
        if on_p99:
            cmd.append("--percentile=99")
        before = worker.stats(model)
        t0 = time.monotonic()
        res = sh(cmd, timeout=left)
        wall = time.monotonic() - t0
        after = worker.stats(model) if worker.alive() else None
        (workdir / f"pa-{model}-{protocol}-c{concurrency}.log").write_text(res.stdout or "")
        parsed = parse_pa_csv(csv_path)
        attempt = {"cmd": " ".join(cmd), "rc": res.returncode, "wall_s": round(wall, 1),
                   "stability": stability, "max_trials": trials, "stabilised_on": "p99" if on_p99 else "average",
                   "unstable": "Failed to obtain stable measurement" in (res.stdout or "")}
        if res.returncode != 0 or parsed is None:
            attempt["output_tail"] = "\n".join((res.stdout or "").splitlines()[-15:])
        record["attempts"].append(attempt)
        if parsed is not None:
            record.update({"ok": True, "pa": parsed, "server": stats_delta(before, after),
                           "unstable": attempt["unstable"], "stability_used": stability,
                           "stabilised_on": attempt["stabilised_on"]})
            return record
        if not worker.alive():
            break
    record["ok"] = False
    return record


def pa_fields(rec: dict) -> dict:
    pa = rec.get("pa") or {}

    def g(*names):
        for n in names:
            if n in pa and isinstance(pa[n], float):
                return pa[n]
        return None

    return {
        "infer_per_s": g("Inferences/Second"),
        "p50_us": g("p50 latency"),
        "p90_us": g("p90 latency"),
        "p95_us": g("p95 latency"),
        "p99_us": g("p99 latency"),
        "avg_us": g("Avg latency"),
        "client_send_us": g("Client Send"),
        "network_server_us": g("Network+Server Send/Recv"),
        "server_queue_us": g("Server Queue"),
        "server_compute_input_us": g("Server Compute Input"),
        "server_compute_infer_us": g("Server Compute Infer"),
        "server_compute_output_us": g("Server Compute Output"),
        "client_recv_us": g("Client Recv"),
        "stabilised_on": rec.get("stabilised_on"),
    }


# --------------------------------------------------------------------------------------------
# In-process baseline


def run_ort_bench(binary: Path, model: str, seconds: float, threads: list[int], batches: list[int],
                  timeout: float, gpu: int | None = None,
                  conv_algo_search: int | None = None) -> tuple[list[dict], str | None]:
    cmd = [str(binary), "--model-dir", str(ROOT / "examples/models" / model),
           "--batch-sizes", ",".join(map(str, batches)), "--intra-op-threads", ",".join(map(str, threads)),
           "--seconds", str(seconds), "--warmup-seconds", str(min(0.3, seconds)), "--json"]
    if gpu is not None:
        cmd += ["--gpu", str(gpu)]
        if conv_algo_search is not None:
            cmd += ["--cudnn-conv-algo-search", str(conv_algo_search)]
    log(" ".join(cmd))
    res = sh(cmd, timeout=timeout)
    rows = []
    for line in (res.stdout or "").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    err = None if res.returncode == 0 else f"rc={res.returncode}: " + "\n".join(res.stdout.splitlines()[-10:])
    return rows, err


def gpu_repository(dest: Path, models: list[str], gpu: int, instances: int, conv_algo_search: int | None,
                   pad_batch: bool = False) -> Path:
    """A copy of examples/models whose `models` run `instances` KIND_GPU instances on `gpu`
    (with Triton's onnxruntime `cudnn_conv_algo_search` parameter where given)."""
    shutil.copytree(ROOT / "examples/models", dest)
    group = f"instance_group [ {{ count: {instances} kind: KIND_GPU gpus: [ {gpu} ] }} ]"
    if conv_algo_search is not None:
        group += f'\nparameters {{ key: "cudnn_conv_algo_search" value: {{ string_value: "{conv_algo_search}" }} }}'
    if pad_batch:
        group += '\nparameters { key: "nereid.pad_batch" value: { string_value: "true" } }'
    for model in models:
        cfg = dest / model / "config.pbtxt"
        text = cfg.read_text()
        m = re.search(r"^instance_group\s*\[", text, flags=re.M)
        if m:
            # The list ends at its matching bracket (one line or several).
            depth, end = 0, m.end() - 1
            for end in range(m.end() - 1, len(text)):
                depth += {"[": 1, "]": -1}.get(text[end], 0)
                if depth == 0:
                    break
            text = text[:m.start()] + group + text[end + 1:]
        else:
            text += "\n" + group + "\n"
        cfg.write_text(text)
    return dest


def gpu_name(gpu: int) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def nearest_batch(measured: list[int], avg: float) -> int:
    # Nearest measured batch size; a tie goes to the larger (the stronger baseline).
    return min(measured, key=lambda b: (abs(b - avg), -b))


# --------------------------------------------------------------------------------------------
# Report


def fmt(v, spec: str = ",.0f", none: str = "–") -> str:
    if v is None:
        return none
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def write_markdown(path: Path, report: dict) -> None:
    m = report["machine"]
    cfg = report["config"]
    L = []
    L.append("# Nereid worker benchmark")
    L.append("")
    if cfg["quick"]:
        L.append("> **Quick smoke run** (`--quick`): short windows, few concurrency levels; numbers are not "
                 "representative.")
        L.append("")
    L.append(f"- Date: {report['date']}")
    L.append(f"- Machine: {m['nproc']} CPUs, {m['cpu_model']}, {m['mem_gib']} GiB, Linux {m['kernel']}")
    if cfg.get("gpu") is not None:
        L.append(f"- GPU {cfg['gpu']}: {cfg.get('gpu_name') or 'unknown'}; every benchmarked model runs "
                 f"{cfg['gpu_instances']} KIND_GPU instance(s) on it (CUDA execution provider, "
                 f"cudnn_conv_algo_search {cfg.get('gpu_conv_algo_search')}"
                 f"{', every batch padded to max_batch_size (nereid.pad_batch)' if cfg.get('gpu_pad_batch') else ''}"
                 "); the in-process baseline runs on the same GPU with the same cudnn_conv_algo_search, "
                 "one fixed batch size per point, unpadded")
    L.append(f"- Load average at start: {m['loadavg_start']} (at end: {report.get('loadavg_end')})")
    L.append(f"- Git commit: `{m['git_commit']}`{' (working tree dirty)' if m['git_dirty'] else ''}")
    L.append(f"- Worker: `{cfg['worker_cmd']}` (ONNX Runtime intra-op threads per instance: "
             f"{cfg['worker_intra_op_threads']}; model configs from examples/models)")
    L.append(f"- perf_analyzer: {cfg['perf_analyzer_version']}, {cfg['pa_mode']} mode"
             f"{' (max threads ' + str(cfg['pa_max_threads']) + ')' if cfg['pa_mode'] == 'async' else ''}, "
             f"`-b 1`, {cfg['interval_ms']} ms windows, stability {cfg['stability']} %, max trials "
             f"{cfg['max_trials']}; client runs on the same machine as the worker")
    L.append(f"- In-process baseline: `nereid-ort-bench` (InstanceSession::run, single-request path), "
             f"{cfg['ort_seconds']} s per point")
    L.append(f"- Total wall time: {report.get('wall_s', 0):.0f} s")
    L.append("")

    L.append("## Targets")
    L.append("")
    L.append("| target | measured | threshold | result |")
    L.append("|---|---|---|---|")
    for t in report["targets"]:
        L.append(f"| {t['name']} | {t['measured_text']} | {t['threshold_text']} | **{t['result']}** |")
    L.append("")

    L.append("## Served (perf_analyzer → nereid-worker)")
    L.append("")
    L.append("Latencies in µs (client-side). *avg exec batch* = Δinference_count / Δexecution_count from "
             "`/v2/models/{m}/stats` over the run. *vs in-proc* = served infer/s ÷ in-process rows/s at the "
             f"measured batch size nearest the average executed batch (intra-op threads = "
             f"{cfg['worker_intra_op_threads']}, like the worker). *vs best* (convnet) = served infer/s ÷ "
             "best in-process rows/s over all batch sizes and thread settings (in brackets: best over batch "
             "sizes ≤ the model's max_batch_size).")
    L.append("")
    L.append("| model | proto | conc | infer/s | p50 | p99 | avg exec batch | in-proc rows/s @ batch | vs in-proc "
             "| vs best | server queue | server infer | failed reqs | notes |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in report["served"]:
        f = r.get("fields", {})
        srv = r.get("server") or {}
        notes = []
        if not r.get("ok"):
            notes.append(r.get("error") or "perf_analyzer failed")
        if r.get("unstable"):
            notes.append("unstable")
        if r.get("stability_used") and r.get("stability_used") != cfg["stability"]:
            notes.append(f"stability relaxed to {r['stability_used']} %")
        base = r.get("baseline") or {}
        inproc = (f"{fmt(base.get('rows_per_s'))} @ {base.get('batch')}" if base.get("rows_per_s") else "–")
        vs_best = "–"
        if r.get("ratio_best") is not None:
            vs_best = f"{r['ratio_best']:.2f}"
            if r.get("ratio_best_within_max_batch") is not None:
                vs_best += f" ({r['ratio_best_within_max_batch']:.2f})"
        L.append(
            f"| {r['model']} | {r['protocol']} | {r['concurrency']} | {fmt(f.get('infer_per_s'))} | "
            f"{fmt(f.get('p50_us'))} | {fmt(f.get('p99_us'))} | {fmt(srv.get('avg_exec_batch'), '.2f')} | "
            f"{inproc} | {fmt(r.get('ratio'), '.2f')} | {vs_best} | {fmt(f.get('server_queue_us'))} | "
            f"{fmt(f.get('server_compute_infer_us'))} | {fmt(srv.get('fail'), 'd')} | {'; '.join(notes)} |")
    L.append("")

    L.append("## In-process ONNX Runtime (nereid-ort-bench): rows/s")
    L.append("")
    ip = report["inproc"]
    batches = sorted({row["batch"] for row in ip})
    L.append("| model | intra-op threads | " + " | ".join(f"b={b}" for b in batches) + " |")
    L.append("|---|---:|" + "---:|" * len(batches))
    keys = sorted({(row["model"], row["intra_op_threads"]) for row in ip},
                  key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 99, k[1]))
    for model, th in keys:
        cells = []
        for b in batches:
            row = next((x for x in ip if x["model"] == model and x["intra_op_threads"] == th and x["batch"] == b), None)
            cells.append(fmt(row["rows_per_s"]) if row else "–")
        L.append(f"| {model} | {th} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("p50 / p99 per-run latency (µs):")
    L.append("")
    L.append("| model | intra-op threads | " + " | ".join(f"b={b}" for b in batches) + " |")
    L.append("|---|---:|" + "---:|" * len(batches))
    for model, th in keys:
        cells = []
        for b in batches:
            row = next((x for x in ip if x["model"] == model and x["intra_op_threads"] == th and x["batch"] == b), None)
            cells.append(f"{fmt(row['latency_us']['p50'])} / {fmt(row['latency_us']['p99'])}" if row else "–")
        L.append(f"| {model} | {th} | " + " | ".join(cells) + " |")
    L.append("")

    L.append("## Anomalies")
    L.append("")
    if report["anomalies"]:
        for a in report["anomalies"]:
            L.append(f"- {a}")
    else:
        L.append("- none observed (no perf_analyzer errors, no failed requests, no worker warnings/errors/crashes)")
    L.append("")
    path.write_text("\n".join(L))


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,16, 1 s windows, short in-process points")
    ap.add_argument("--no-build", action="store_true", help="skip cargo build (use the binaries in target/release)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--concurrency", default=None, help="comma-separated; default 1,4,16,64,128 (quick: 1,16)")
    ap.add_argument("--interval-ms", type=int, default=None, help="perf_analyzer window; default 3000 (quick: 1000)")
    ap.add_argument("--stability", type=int, default=20, help="perf_analyzer --stability-percentage")
    ap.add_argument("--max-trials", type=int, default=5, help="perf_analyzer --max-trials")
    ap.add_argument("--no-retry-unstable", dest="retry_unstable", action="store_false",
                    help="do not retry a point that produced no result with a relaxed stability criterion")
    ap.add_argument("--pa-mode", choices=["async", "sync"], default="async",
                    help="perf_analyzer API mode (async keeps client threads few on a small host)")
    ap.add_argument("--pa-max-threads", type=int, default=4, help="perf_analyzer --max-threads in async mode")
    ap.add_argument("--http-input-data", default=None, help="perf_analyzer --input-data for HTTP (e.g. zero)")
    ap.add_argument("--worker-intra-op-threads", type=int, default=1)
    ap.add_argument("--ort-seconds", type=float, default=None, help="in-process seconds per point; default 2 (quick: 0.5)")
    ap.add_argument("--ort-threads", default=",".join(map(str, ORT_THREADS)))
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="hard bound on the whole run")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--gpu", type=int, default=None, metavar="ID",
                    help="serve the models as KIND_GPU instances on this GPU and run the baseline there "
                         "(a `cuda` build; onnxruntime-gpu's library in NEREID_ORT_LIB)")
    ap.add_argument("--gpu-instances", type=int, default=1, help="KIND_GPU instances per model with --gpu")
    ap.add_argument("--gpu-conv-algo-search", type=int, choices=[0, 1, 2], default=1,
                    help="with --gpu: the models' cudnn_conv_algo_search parameter, also given to the baseline "
                         "(default 1, HEURISTIC: ONNX Runtime's own EXHAUSTIVE re-searches per batch shape)")
    ap.add_argument("--gpu-pad-batch", action="store_true",
                    help="with --gpu: the models run every batch padded to max_batch_size (nereid.pad_batch)")
    ap.add_argument("--perf-analyzer", default=None, metavar="PATH",
                    help="use this perf_analyzer (wrapper) instead of installing one (offline hosts)")
    ap.add_argument("--keep-raw", action="store_true", help="keep perf_analyzer CSV/logs and worker logs (path printed)")
    args = ap.parse_args()

    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    models = [m for m in args.models.split(",") if m]
    protocols = [p for p in args.protocols.split(",") if p]
    concurrency = ints(args.concurrency) if args.concurrency else (QUICK_CONCURRENCY if args.quick else FULL_CONCURRENCY)
    args.interval_ms = args.interval_ms or (1000 if args.quick else 3000)
    ort_seconds = args.ort_seconds or (0.5 if args.quick else 2.0)
    ort_threads = ints(args.ort_threads)
    batches = ints(args.batch_sizes)
    for p in protocols:
        if p not in PROTOCOLS:
            ap.error(f"--protocols: unknown protocol {p!r}")

    # SIGTERM behaves like Ctrl-C so the finally blocks stop the worker.
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    t_start = time.monotonic()
    deadline = Deadline(args.budget_s)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="nereid-bench-"))
    if not args.keep_raw:
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    report: dict = {"date": dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
                    "machine": machine_info(), "served": [], "inproc": [], "anomalies": [], "targets": []}
    anomalies: list[str] = report["anomalies"]
    la, ncpu = report["machine"]["loadavg_start"], report["machine"]["nproc"] or 1
    if la and la[0] > 0.5 * ncpu:
        anomalies.append(f"machine busy at start: 1-min load average {la[0]} on {ncpu} CPUs "
                         "(other work was running; every number here is unreliable)")
    worker_bin = ROOT / "target/release/nereid-worker"
    ort_bin = ROOT / "target/release/nereid-ort-bench"

    # 1. Build.
    if not args.no_build:
        # GPU runs need the CUDA execution provider: the `cuda` feature.
        build = ["cargo", "build", "--release", "--locked", "-p", "nereid-worker"]
        if args.gpu is not None:
            build += ["--features", "cuda"]
        log(" ".join(build))
        res = sh(build, timeout=min(12 * 60, deadline.left() - 120), cwd=ROOT)
        if res.returncode != 0:
            print(res.stdout[-5000:], file=sys.stderr)
            log("build failed")
            return 2
    for b in (worker_bin, ort_bin):
        if not b.is_file():
            log(f"missing {b} (build first)")
            return 2

    # 2. perf_analyzer.
    if args.perf_analyzer:
        pa = Path(args.perf_analyzer).resolve()
    else:
        res = sh(["bash", str(ROOT / "bench/setup_perf_analyzer.sh")], timeout=min(300, deadline.left()), cwd=ROOT)
        if res.returncode != 0:
            print(res.stdout[-3000:], file=sys.stderr)
            log("perf_analyzer setup failed")
            return 2
        pa = Path(res.stdout.strip().splitlines()[-1].strip())
    pa_version = sh([str(pa), "--version"], timeout=30).stdout.strip()

    # Time reserved for the in-process baseline after the served runs.
    ort_points = len(models) * len(ort_threads) * len(batches)
    ort_reserve = ort_points * (ort_seconds + min(0.3, ort_seconds) + 0.3) + 20 * len(models) + 30

    served_repo = ROOT / "examples/models"
    if args.gpu is not None:
        served_repo = gpu_repository(workdir / "models", models, args.gpu, args.gpu_instances,
                                     args.gpu_conv_algo_search, args.gpu_pad_batch)
    worker = Worker(worker_bin, served_repo, workdir, args.worker_intra_op_threads)
    report["config"] = {
        "quick": args.quick, "models": models, "protocols": protocols, "concurrency": concurrency,
        "interval_ms": args.interval_ms, "stability": args.stability, "max_trials": args.max_trials,
        "pa_mode": args.pa_mode, "pa_max_threads": args.pa_max_threads, "http_input_data": args.http_input_data,
        "perf_analyzer_version": pa_version, "worker_intra_op_threads": args.worker_intra_op_threads,
        "ort_seconds": ort_seconds, "ort_threads": ort_threads, "batch_sizes": batches,
        "gpu": args.gpu, "gpu_instances": args.gpu_instances, "gpu_conv_algo_search": args.gpu_conv_algo_search,
        "gpu_pad_batch": args.gpu_pad_batch,
        "gpu_name": gpu_name(args.gpu) if args.gpu is not None else None,
        "worker_cmd": (f"target/release/nereid-worker --model-repository "
                       f"{'examples/models' if args.gpu is None else 'examples/models (KIND_GPU copy)'} --address 127.0.0.1 "
                       f"--http-port 0 --grpc-port 0 --metrics-port 0 --intra-op-threads "
                       f"{args.worker_intra_op_threads} --allow-client-shm=true --port-file …"),
    }
    max_batch: dict[str, int] = {}
    try:
        # 3. Served runs.
        worker.start()
        for model in models:
            try:
                cfg = http_json(f"http://{worker.http}/v2/models/{model}/config")
                max_batch[model] = int(cfg.get("max_batch_size", 0))
            except Exception as e:  # noqa: BLE001
                anomalies.append(f"{model}: GET /v2/models/{model}/config failed: {e}")
        for model in models:
            for protocol in protocols:
                for c in concurrency:
                    point_timeout = (args.max_trials + 4) * args.interval_ms / 1000 + 30
                    if args.retry_unstable:
                        point_timeout += 3 * args.interval_ms / 1000 + 10
                    rec: dict
                    if deadline.left() - ort_reserve < point_timeout * 0.5:
                        rec = {"model": model, "protocol": protocol, "concurrency": c, "ok": False,
                               "error": "skipped: time budget"}
                        anomalies.append(f"{model}/{protocol}/c={c}: skipped (time budget exhausted)")
                        report["served"].append(rec)
                        continue
                    if not worker.alive():
                        if worker.starts > MAX_WORKER_RESTARTS:
                            rec = {"model": model, "protocol": protocol, "concurrency": c, "ok": False,
                                   "error": "skipped: worker down"}
                            report["served"].append(rec)
                            continue
                        worker.start()
                    log(f"perf_analyzer {model} {protocol} c={c}")
                    rec = run_perf_analyzer(pa, worker, model, protocol, c, args, workdir,
                                            timeout=min(point_timeout, deadline.left() - ort_reserve))
                    rec["fields"] = pa_fields(rec)
                    if not worker.alive():
                        rc = worker.proc.returncode if worker.proc else None
                        msg = f"worker exited (rc={rc}) during {model}/{protocol}/c={c}; log tail:\n{worker.log_tail(15)}"
                        anomalies.append(msg)
                        worker.exits.append({"during": f"{model}/{protocol}/c={c}", "rc": rc})
                        worker.proc = None
                    if not rec.get("ok"):
                        last = rec["attempts"][-1] if rec.get("attempts") else {}
                        rec["error"] = f"perf_analyzer rc={last.get('rc')}"
                        anomalies.append(f"{model}/{protocol}/c={c}: perf_analyzer produced no result "
                                         f"(rc={last.get('rc')}): {(last.get('output_tail') or '').strip()[-600:]}")
                    elif rec.get("unstable"):
                        anomalies.append(f"{model}/{protocol}/c={c}: measurement unstable "
                                         f"(stability {rec.get('stability_used')} %)")
                    srv = rec.get("server") or {}
                    if srv.get("fail"):
                        anomalies.append(f"{model}/{protocol}/c={c}: {srv['fail']} failed requests in server stats")
                    f = rec["fields"]
                    log(f"  -> infer/s={fmt(f.get('infer_per_s'))} p50={fmt(f.get('p50_us'))}us "
                        f"p99={fmt(f.get('p99_us'))}us avg_exec_batch={fmt(srv.get('avg_exec_batch'), '.2f')}")
                    report["served"].append(rec)
    except RuntimeError as e:  # worker start-up failures: report them, still run the baseline
        anomalies.append(f"worker: {e}")
        log(f"worker failure: {e}")
    finally:
        rc = worker.stop()
        if rc not in (None, 0):
            anomalies.append(f"worker exited with status {rc} on SIGTERM (expected 0)")
        # Worker log: warnings, errors, panics.
        for p in worker.log_paths:
            try:
                text = p.read_text(errors="replace")
            except OSError:
                continue
            # tritonserver's line formats (W/E + month and day; ISO8601's "Z W"), or tracing's.
            warned = (r"^(\x1b\[[0-9;]*m)?[WE](\x1b\[0m)?\d{4} \d\d:|^\S+Z [WE] \d+ |\b(WARN|ERROR)\b"
                      r"|panicked|SIGSEGV|core dumped")
            bad = [ln for ln in text.splitlines() if re.search(warned, ln)]
            if bad:
                anomalies.append(f"worker log {p.name}: {len(bad)} warning/error lines, e.g.: "
                                 + " | ".join(re.sub(r"\x1b\[[0-9;]*m", "", b)[:300] for b in bad[:5]))

    # 4. In-process baseline (worker stopped: nothing else of ours is running).
    for model in models:
        left = deadline.left()
        if left < 20:
            anomalies.append(f"{model}: in-process baseline skipped (time budget exhausted)")
            continue
        points = len(ort_threads) * len(batches)
        rows, err = run_ort_bench(ort_bin, model, ort_seconds, ort_threads, batches,
                                  timeout=min(left, points * (ort_seconds + 2) + 30), gpu=args.gpu,
                                  conv_algo_search=args.gpu_conv_algo_search)
        if err:
            anomalies.append(f"{model}: nereid-ort-bench failed: {err}")
        report["inproc"].extend(rows)

    # 5. Ratios and targets.
    def inproc_rows(model: str, threads: int | None = None) -> list[dict]:
        return [r for r in report["inproc"] if r["model"] == model and (threads is None or r["intra_op_threads"] == threads)]

    for rec in report["served"]:
        ips = rec.get("fields", {}).get("infer_per_s")
        avg = (rec.get("server") or {}).get("avg_exec_batch")
        model = rec["model"]
        same = inproc_rows(model, args.worker_intra_op_threads) or inproc_rows(model, 1)
        if ips and avg and same:
            b = nearest_batch([r["batch"] for r in same], avg)
            base = next(r for r in same if r["batch"] == b)
            rec["baseline"] = {"batch": b, "intra_op_threads": base["intra_op_threads"], "rows_per_s": base["rows_per_s"]}
            rec["ratio"] = ips / base["rows_per_s"] if base["rows_per_s"] else None
        if model == "convnet_fp32" and ips and inproc_rows(model):
            best = max(inproc_rows(model), key=lambda r: r["rows_per_s"])
            rec["best_inproc"] = {"batch": best["batch"], "intra_op_threads": best["intra_op_threads"],
                                  "rows_per_s": best["rows_per_s"]}
            rec["ratio_best"] = ips / best["rows_per_s"]
            mb = max_batch.get(model)
            within = [r for r in inproc_rows(model) if mb and r["batch"] <= mb]
            if within:
                bw = max(within, key=lambda r: r["rows_per_s"])
                rec["best_inproc_within_max_batch"] = {"batch": bw["batch"], "intra_op_threads": bw["intra_op_threads"],
                                                       "rows_per_s": bw["rows_per_s"]}
                rec["ratio_best_within_max_batch"] = ips / bw["rows_per_s"]

    def served(model, protocol, c):
        return next((r for r in report["served"] if r["model"] == model and r["protocol"] == protocol
                     and r["concurrency"] == c), None)

    for protocol in protocols:
        r = served("convnet_fp32", protocol, 128)
        t = {"name": f"convnet_fp32 over {protocol} @ concurrency 128: served infer/s ÷ best in-process rows/s",
             "threshold": TARGET_CONVNET_RATIO, "threshold_text": f"≥ {TARGET_CONVNET_RATIO:.2f}"}
        if r and r.get("ratio_best") is not None:
            best = r["best_inproc"]
            t.update(measured=r["ratio_best"], result="PASS" if r["ratio_best"] >= TARGET_CONVNET_RATIO else "FAIL",
                     measured_text=(f"{r['ratio_best']:.3f} ({fmt(r['fields']['infer_per_s'])} / "
                                    f"{fmt(best['rows_per_s'])} at b={best['batch']}, {best['intra_op_threads']} thr)"))
        else:
            t.update(measured=None, result="NOT MEASURED", measured_text="–")
        report["targets"].append(t)
    if "grpc" in protocols:
        r = served("identity_fp32", "grpc", 16)
        t = {"name": "identity_fp32 over grpc @ concurrency 16: infer/s", "threshold": TARGET_IDENTITY_GRPC_C16,
             "threshold_text": f"≥ {TARGET_IDENTITY_GRPC_C16:,.0f}"}
        ips = r.get("fields", {}).get("infer_per_s") if r else None
        if ips:
            t.update(measured=ips, measured_text=fmt(ips), result="PASS" if ips >= TARGET_IDENTITY_GRPC_C16 else "FAIL")
        else:
            t.update(measured=None, measured_text="–", result="NOT MEASURED")
        report["targets"].append(t)

    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.monotonic() - t_start
    report["worker_restarts"] = max(0, worker.starts - 1)
    if args.keep_raw:
        report["raw_dir"] = str(workdir)
    stem = "worker" if args.gpu is None else ("worker-gpu-padded" if args.gpu_pad_batch else "worker-gpu")
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_markdown(out_dir / f"{stem}.md", report)
    if args.keep_raw:
        log(f"raw perf_analyzer output and worker logs kept in {workdir}")
    log(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')} ({report['wall_s']:.0f} s)")
    print((out_dir / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        log(f"interrupted: {e}")
        sys.exit(130)
