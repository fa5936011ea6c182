"""Helpers for the Python compatibility suite: real `nereid-worker` processes and onnxruntime references.

Every worker binds port 0 on 127.0.0.1 and reports its ports through `--port-file`; start-up
waits (bounded) until that file exists and `GET /v2/health/ready` answers 200. Nothing here
sleeps for a fixed time and every loop has a deadline.

Environment:
  NEREID_WORKER_BIN  the worker binary (default: <repo>/target/debug/nereid-worker)
  NEREID_ORT_LIB     libonnxruntime.so (default: <repo>/.deps/onnxruntime/libonnxruntime.so)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_MODELS = ROOT / "examples" / "models"
WORKER_BIN = Path(os.environ.get("NEREID_WORKER_BIN", ROOT / "target" / "debug" / "nereid-worker"))
ORT_LIB = Path(os.environ.get("NEREID_ORT_LIB", ROOT / ".deps" / "onnxruntime" / "libonnxruntime.so"))

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 8000

MODEL_NAMES = [
    "identity_fp32",
    "mlp_fp32",
    "convnet_fp32",
    "mixed_types",
    "string_len",
    "autocomplete_add",
    "versioned_scale",
    "nobatch_add",
    "optional_bias",
]

# Workers that are running right now; a failing test gets their log tails in its report.
LIVE_WORKERS: list["Worker"] = []


class WorkerExited(RuntimeError):
    """Raised inside a wait_until predicate to stop waiting at once."""


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Polls `predicate` until it returns a truthy value or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except WorkerExited:
            raise
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last error
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def http_request(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None, timeout: float = 10.0):
    """A raw HTTP request; returns (status, headers, body bytes) for 2xx and error statuses alike."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


class Worker:
    """A running nereid-worker process."""

    def __init__(self, repo: Path, args: list[str], workdir: Path, wait_ready: bool = True):
        self.repo = Path(repo)
        self.args = list(args)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = self.workdir / "ports.json"
        self.log_path = self.workdir / "worker.log"
        if self.port_file.exists():
            self.port_file.unlink()
        if not WORKER_BIN.exists():
            raise RuntimeError(f"worker binary {WORKER_BIN} does not exist (build it with `cargo build -p nereid-worker` or set NEREID_WORKER_BIN)")
        cmd = [
            str(WORKER_BIN),
            "--model-repository", str(self.repo),
            "--address", "127.0.0.1",
            "--http-port", "0",
            "--grpc-port", "0",
            "--metrics-port", "0",
            "--port-file", str(self.port_file),
            *([] if "--exit-timeout-secs" in self.args else ["--exit-timeout-secs", "5"]),
            *self.args,
        ]
        env = dict(os.environ)
        env["NEREID_ORT_LIB"] = str(ORT_LIB)
        env.setdefault("RUST_BACKTRACE", "1")
        env["NO_COLOR"] = "1"
        self.cmd = cmd
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir))
        LIVE_WORKERS.append(self)
        try:
            self._wait_started(wait_ready)
        except BaseException:
            log = self.log_tail()
            self.stop()
            raise RuntimeError(f"worker did not start: {' '.join(cmd)}\n--- worker log ---\n{log}") from None

    def _read_ports(self):
        if self.proc.poll() is not None:
            raise WorkerExited(f"worker exited with status {self.proc.returncode}")
        if not self.port_file.exists():
            return None
        try:
            ports = json.loads(self.port_file.read_text())
        except (json.JSONDecodeError, OSError):
            return None  # still being written
        if all(isinstance(ports.get(k), int) and ports[k] > 0 for k in ("http", "grpc", "metrics")):
            return ports
        return None

    def _wait_started(self, wait_ready: bool):
        deadline = time.monotonic() + START_TIMEOUT_S
        self.ports = wait_until(self._read_ports, START_TIMEOUT_S, what="the port file")
        self.http_port = self.ports["http"]
        self.grpc_port = self.ports["grpc"]
        self.metrics_port = self.ports["metrics"]
        self.http_url = f"127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.base = f"http://{self.http_url}"
        path = "/v2/health/ready" if wait_ready else "/v2/health/live"

        def up():
            if self.proc.poll() is not None:
                raise WorkerExited(f"worker exited with status {self.proc.returncode}")
            try:
                status, _, _ = http_request(self.base + path, timeout=2.0)
            except OSError:
                return False
            return status == 200

        wait_until(up, max(0.1, deadline - time.monotonic()), what=path)

    # -- helpers ---------------------------------------------------------------------------

    def get(self, path: str, **kw):
        return http_request(self.base + path, **kw)

    def post(self, path: str, body: bytes | dict | list | None = None, headers: dict | None = None, timeout: float = 10.0):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        return http_request(self.base + path, method="POST", body=body if body is not None else b"", headers=headers, timeout=timeout)

    def index(self) -> list[dict]:
        status, _, body = self.post("/v2/repository/index", {})
        assert status == 200, body
        return json.loads(body)

    def metrics_text(self) -> str:
        status, _, body = http_request(self.metrics_url)
        assert status == 200, body
        return body.decode()

    def log_tail(self, n: int = LOG_TAIL_CHARS) -> str:
        try:
            self._log.flush()
            text = self.log_path.read_bytes().decode(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return text[-n:]

    def stop(self):
        if self in LIVE_WORKERS:
            LIVE_WORKERS.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


def copy_model(repo, name, base="identity_fp32", edit=None, config=None):
    """repo/name: example model `base` renamed to `name`. `edit` rewrites its config text (and
    must change it); `config` replaces the config instead ("" removes it). Returns the folder."""
    d = repo / name
    shutil.copytree(EXAMPLE_MODELS / base, d)
    cfg = d / "config.pbtxt"
    if config is not None:
        if config == "":
            cfg.unlink(missing_ok=True)
        else:
            cfg.write_text(config)
    elif cfg.exists():
        text = cfg.read_text().replace(f'name: "{base}"', f'name: "{name}"')
        if edit:
            new = edit(text)
            assert new != text, f"edit of {name} changed nothing"
            text = new
        cfg.write_text(text)
    return d


def check_example_models():
    missing = [m for m in MODEL_NAMES if not list((EXAMPLE_MODELS / m).glob("*/model.onnx"))]
    if missing:
        raise RuntimeError(f"example models missing model.onnx: {missing}; run `bash scripts/setup.sh` (or examples/generate_models.py)")


# -- reference results from onnxruntime in Python -----------------------------------------------

_ORT_SESSIONS: dict = {}
_ORT_LOCK = threading.Lock()


def ort_session(model: str, version: int = 1):
    import onnxruntime as ort

    key = (model, version)
    with _ORT_LOCK:
        if key not in _ORT_SESSIONS:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            _ORT_SESSIONS[key] = ort.InferenceSession(str(EXAMPLE_MODELS / model / str(version) / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        return _ORT_SESSIONS[key]


def ort_run(model: str, inputs: dict, version: int = 1) -> dict:
    sess = ort_session(model, version)
    names = [o.name for o in sess.get_outputs()]
    with _ORT_LOCK:
        outs = sess.run(names, inputs)
    return dict(zip(names, outs))


def assert_fp32_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6)
