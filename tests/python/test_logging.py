"""Triton's logging extension through tritonclient: read and change the worker's log settings
over HTTP and gRPC while it runs, see the change take effect in its log, and have invalid
settings refused without changing anything."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


@pytest.fixture
def logging_worker(repo_copy, make_worker):
    return make_worker(repo_copy("identity_fp32"))


def _unknown_model(h, name):
    with pytest.raises(InferenceServerException):
        h.get_model_metadata(name)


def test_log_settings_are_read_and_changed_at_run_time(logging_worker):
    w = logging_worker
    h = httpclient.InferenceServerClient(w.http_url)
    g = grpcclient.InferenceServerClient(w.grpc_url)
    try:
        assert "logging" in h.get_server_metadata()["extensions"]
        settings = h.get_log_settings()
        assert settings == {
            "log_file": "",
            "log_info": True,
            "log_warning": True,
            "log_error": True,
            "log_verbose_level": 0,
            "log_format": "default",
        }, settings

        # At level 0 a client error (logged at DEBUG) is not written; at level 1 it is.
        _unknown_model(h, "quiet_model_name")
        assert h.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
        _unknown_model(h, "verbose_model_name")
        log = w.log_path.read_text(errors="replace")
        assert "verbose_model_name" in log and "quiet_model_name" not in log, log[-2000:]

        # gRPC sees the same settings and changes them back.
        got = g.get_log_settings(as_json=True)["settings"]
        assert got["log_verbose_level"] == {"uint32_param": 1}, got
        got = g.update_log_settings({"log_verbose_level": 0, "log_info": False}, as_json=True)["settings"]
        assert got["log_verbose_level"] == {"uint32_param": 0} and got["log_info"] == {"bool_param": False}, got
        _unknown_model(h, "quiet_again_model_name")
        assert "quiet_again_model_name" not in w.log_path.read_text(errors="replace")
    finally:
        h.close()
        g.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_invalid_log_settings_are_refused_and_change_nothing(logging_worker, protocol):
    c = (httpclient.InferenceServerClient(logging_worker.http_url) if protocol == "http"
         else grpcclient.InferenceServerClient(logging_worker.grpc_url))
    try:
        for settings, needle in [
            ({"log_file": "/tmp/nereid.log"}, "must be empty"),
            ({"log_format": "json"}, "'default' or 'ISO8601'"),
            ({"log_verbosity": 1}, "unknown log setting 'log_verbosity'"),
            ({"log_info": False, "log_color": True}, "unknown log setting"),
        ]:
            with pytest.raises(InferenceServerException) as e:
                c.update_log_settings(settings)
            assert needle in str(e.value), str(e.value)
        current = c.get_log_settings() if protocol == "http" else c.get_log_settings(as_json=True)["settings"]
        assert current["log_info"] in (True, {"bool_param": True}), current
    finally:
        c.close()


def _log_until_loaded(repo, env_changes, terminal):
    """The worker's output up to 'model repository loaded', written to a pseudo-terminal or to
    a pipe (as under a log collector)."""
    import os
    import pty
    import select
    import subprocess
    import time

    from nereid_harness import ORT_LIB, WORKER_BIN

    # RUST_LOG could hide the line waited for.
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "RUST_LOG")}
    env.update(env_changes)
    env["NEREID_ORT_LIB"] = str(ORT_LIB)
    cmd = [str(WORKER_BIN), "--model-repository", str(repo), "--address", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    if terminal:
        reader, writer = pty.openpty()
    else:
        reader, writer = os.pipe()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer, env=env)
    os.close(writer)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while b"model repository loaded" not in out:
            left = deadline - time.monotonic()
            assert left > 0, f"no 'model repository loaded' in 30 s:\n{out.decode(errors='replace')}"
            if select.select([reader], [], [], left)[0]:
                try:
                    chunk = os.read(reader, 65536)
                except OSError:  # the terminal closed: the worker exited
                    chunk = b""
                assert chunk, f"the worker exited:\n{out.decode(errors='replace')}"
                out += chunk
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(reader)
    return out


@pytest.mark.parametrize(
    "terminal,env,coloured",
    [(True, {}, True), (True, {"NO_COLOR": "1"}, False), (False, {}, False)],
    ids=["terminal", "terminal-NO_COLOR", "pipe"],
)
def test_log_colours_only_on_a_terminal_without_no_color(repo_copy, terminal, env, coloured):
    """Colour codes in a log file or a pod's log break searches such as `grep model=x`."""
    out = _log_until_loaded(repo_copy("identity_fp32"), env, terminal)
    assert (b"\x1b[" in out) == coloured, out.decode(errors="replace")
    if not coloured:
        assert b"model=identity_fp32" in out, out.decode(errors="replace")
