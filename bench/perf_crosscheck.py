#!/usr/bin/env python3
"""Cross-check: nereid-perf and NVIDIA's perf_analyzer on the same worker and the same load
agree on throughput and p50 latency (issue 3 asks for within 10 %).

    .venv/bin/python bench/perf_crosscheck.py            # identity_fp32 + mlp_fp32, gRPC, concurrency 1,4,16
                                                         # and open loop at fixed request rates; convnet_fp32
                                                         # at concurrency 4,16 through shared memory
    .venv/bin/python bench/perf_crosscheck.py --quick    # 1 s windows

Closed loop measures what each tool can drive (so on 2 shared cores, a heavier client gets less
from the worker); open loop at a rate both sustain measures the same offered load, so it checks
the latency measurement itself, without the clients' own cost deciding the throughput.

Both tools write perf_analyzer-style CSV (nereid-perf's `-f` uses the same column names), read
here by the same parser. The two run one after the other on the same worker, alternating which
goes first per point, sharing the machine's cores with the worker: a client that costs more CPU
per request (perf_analyzer does) takes more cycles from the worker it measures, so each
client's CPU use is recorded next to its numbers. `--pin` puts the worker on CPU 0 and the
clients on CPU 1 instead (then a tiny model makes the client itself the bottleneck). Results:
bench/results/crosscheck.json and crosscheck.md (with `--pin`: crosscheck-pinned.json and .md).
"""

from __future__ import annotations

import argparse
import os
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_bench import ROOT, CpuMeter, Worker, build_and_install_pa, log, machine_info, parse_pa_csv, sh  # noqa: E402

MODELS = ["identity_fp32", "mlp_fp32"]
CONCURRENCY = [1, 4, 16]
# Open-loop rates (requests/s) well inside what both clients and the worker sustain here.
RATES = {"identity_fp32": [1000, 4000], "mlp_fp32": [500, 2000]}
# Closed loop with both tools' --shared-memory system (tensors through registered POSIX
# shared memory; the worker runs with --allow-client-shm=true).
SHM_LOADS = [("convnet_fp32", 4), ("convnet_fp32", 16)]
TOLERANCE = 0.10


def measure(tool: str, cmd: list[str], csv_path: Path, timeout: float) -> dict:
    csv_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    meter = CpuMeter({})
    res = sh(cmd + ["-f", str(csv_path)], timeout=timeout)
    rec = {"tool": tool, "cmd": " ".join(cmd), "rc": res.returncode, "wall_s": round(time.monotonic() - t0, 1),
           "client_cpu_pct": meter.finish().get("client")}
    row = parse_pa_csv(csv_path)
    problems = [l for l in (res.stdout or "").splitlines() if l.startswith("PROBLEM:")]
    # nereid-perf exits 5 when its open-loop generator fell behind the schedule (perf_analyzer
    # has no such check and exits 0): the numbers are still a measurement, kept with a note.
    late_only = (res.returncode == 5 and problems
                 and all("could not keep the schedule" in l for l in problems))
    if late_only:
        rec["late_sends_reported"] = True
    if (res.returncode != 0 and not late_only) or row is None:
        rec["output_tail"] = "\n".join((res.stdout or "").splitlines()[-12:])
        return rec
    rec["infer_per_s"] = row.get("Inferences/Second")
    rec["p50_us"] = row.get("p50 latency")
    rec["p99_us"] = row.get("p99 latency")
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--interval-ms", type=int, default=None)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--pin", action="store_true", help="worker on CPU 0, clients on CPU 1 (needs 2 CPUs)")
    args = ap.parse_args()
    interval = args.interval_ms or (1000 if args.quick else 3000)

    if not build_and_install_pa(["nereid-worker", "nereid-loadtests"], build=not args.no_build):
        return 1
    pa = str(ROOT / ".deps/perf_analyzer/perf_analyzer.sh")
    perf = str(ROOT / "target/release/nereid-perf")
    machine = machine_info()
    workdir = Path(tempfile.mkdtemp(prefix="nereid-crosscheck-"))
    worker = Worker(ROOT / "target/release/nereid-worker", ROOT / "examples/models", workdir, 1)
    points = []
    own_cpus = os.sched_getaffinity(0)
    try:
        # Children inherit this process's CPU set when they start.
        if args.pin:
            os.sched_setaffinity(0, {0})
        worker.start()
        if args.pin:
            os.sched_setaffinity(0, {1})
        loads = [(model, "closed", c) for model in MODELS for c in CONCURRENCY]
        loads += [(model, "open", r) for model in MODELS for r in RATES[model]]
        loads += [(model, "shm", c) for model, c in SHM_LOADS]
        for i, (model, mode, level) in enumerate(loads):
            label = {"closed": f"c={level}", "shm": f"c={level}-shm"}.get(mode, f"{level}req_s")
            load = (["--concurrency-range", f"{level}:{level}"] if mode in ("closed", "shm")
                    else ["--request-rate-range", f"{level}:{level}", "--request-distribution", "constant"])
            if mode == "shm":
                load += ["--shared-memory", "system", "--output-shared-memory-size", "65536"]
            common = ["-m", model, "-u", worker.grpc, "-i", "grpc", *load,
                      "--measurement-interval", str(interval), "--stability-percentage", "20", "--max-trials", "6"]
            runs = [
                ("perf_analyzer", [pa, *common, "--async", "--max-threads", "4", "-b", "1"]),
                ("nereid-perf", [perf, *common, "--metrics-url", f"127.0.0.1:{worker.ports['metrics']}", "-q"]),
            ]
            if i % 2:
                runs.reverse()
            point = {"model": model, "mode": mode, "concurrency": level if mode in ("closed", "shm") else None,
                     "request_rate": level if mode == "open" else None}
            for tool, cmd in runs:
                log(f"{model} {label} {tool}")
                point[tool] = measure(tool, cmd, workdir / f"{tool}-{model}-{label}.csv", timeout=240)
            if any(point[tool].get("infer_per_s") is None for tool, _ in runs):
                # Unstable on a noisy VM: both tools once more with a wider band (as
                # worker_bench.py does), so the two numbers compared come from the same settings.
                log(f"{model} {label}: no stable measurement; both tools again with stability 50 %, 10 trials")
                for tool, cmd in runs:
                    relaxed = [("50" if a == "20" and cmd[j - 1] == "--stability-percentage" else
                                "10" if a == "6" and cmd[j - 1] == "--max-trials" else a)
                               for j, a in enumerate(cmd)]
                    rec = measure(tool, relaxed, workdir / f"{tool}-{model}-{label}.csv", timeout=240)
                    rec["stability_relaxed"] = True
                    point[tool] = rec
            pa_rec, np_rec = point["perf_analyzer"], point["nereid-perf"]
            for key in ("infer_per_s", "p50_us"):
                if pa_rec.get(key) and np_rec.get(key):
                    point[f"{key}_ratio"] = np_rec[key] / pa_rec[key]
            point["agree"] = all(abs(point.get(f"{k}_ratio", 99) - 1) <= TOLERANCE for k in ("infer_per_s", "p50_us"))
            log(f"  -> {point.get('infer_per_s_ratio')}, {point.get('p50_us_ratio')}")
            points.append(point)
    finally:
        worker.stop()
        os.sched_setaffinity(0, own_cpus)

    report = {"finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine,
              "interval_ms": interval, "tolerance": TOLERANCE, "pinned": args.pin, "points": points}
    out = Path(args.out_dir)
    # Pinned and shared-core runs answer different questions: each keeps its own files.
    stem = "crosscheck-pinned" if args.pin else "crosscheck"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    f = lambda v, s=",.0f": "–" if v is None else format(v, s)  # noqa: E731

    def per_req(rec: dict) -> float | None:
        cpu, rate = rec.get("client_cpu_pct"), rec.get("infer_per_s")
        return cpu * 10_000 / rate if cpu is not None and rate else None

    lines = [
        "# nereid-perf vs perf_analyzer on the same worker and load",
        "",
        f"Run {report['finished']} on {machine['nproc']} cores, commit `{machine['git_commit'][:12]}`; gRPC, closed loop "
        f"(concurrency; also with both tools' `--shared-memory system`) and open loop (constant request rate), "
        f"{interval} ms windows; produced by `bench/perf_crosscheck.py`. Agreement: throughput and p50 within "
        f"{TOLERANCE:.0%}. "
        + ("Worker pinned to CPU 0, clients to CPU 1 (a client's own cost does not take cycles from the worker)."
           if args.pin else "Worker and clients share every core (run with `--pin` to separate them)."),
        "",
        "*client CPU µs/req* is each tool's own CPU time per completed request (CPU % of one core × 10 000 ÷ "
        "infer/s): on shared cores, every µs a client spends is taken from the worker it measures, so "
        "closed-loop throughput can only agree where the worker, not the client, is the bottleneck.",
        "",
        "| model | load | perf_analyzer infer/s | nereid-perf infer/s | ratio | perf_analyzer p50 µs | nereid-perf p50 µs | ratio | within 10 % | client CPU % (PA / nereid-perf) | client CPU µs/req (PA / nereid-perf) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        a, b = p["perf_analyzer"], p["nereid-perf"]
        mode = p.get("mode", "closed")
        load = {"closed": f"c={p['concurrency']}", "shm": f"c={p['concurrency']}, shared memory"}.get(
            mode, f"{p['request_rate']} req/s")
        lines.append(f"| {p['model']} | {load} | {f(a.get('infer_per_s'))} | {f(b.get('infer_per_s'))} | "
                     f"{f(p.get('infer_per_s_ratio'), '.3f')} | {f(a.get('p50_us'))} | {f(b.get('p50_us'))} | "
                     f"{f(p.get('p50_us_ratio'), '.3f')} | {'yes' if p['agree'] else 'NO'} | "
                     f"{f(a.get('client_cpu_pct'), '.0f')} / {f(b.get('client_cpu_pct'), '.0f')} | "
                     f"{f(per_req(a), '.0f')} / {f(per_req(b), '.0f')} | "
                     + "; ".join(n for n in [
                         "stability relaxed to 50 %, 10 trials" if a.get("stability_relaxed") or b.get("stability_relaxed") else "",
                         "nereid-perf reported late sends (exit 5)" if b.get("late_sends_reported") else "",
                         "nereid-perf: " + b['output_tail'].splitlines()[-1].replace('|', '\\|') if b.get("output_tail") else "",
                         "perf_analyzer: " + a['output_tail'].splitlines()[-1].replace('|', '\\|') if a.get("output_tail") else "",
                     ] if n)
                     + " |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
