"""Fixtures for the Python compatibility suite: real `nereid-worker` processes (see nereid_harness)."""

from __future__ import annotations

import shutil

import pytest

from nereid_harness import EXAMPLE_MODELS, LIVE_WORKERS, Worker, check_example_models


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
    if rep.failed and LIVE_WORKERS:
        for w in list(LIVE_WORKERS):
            rep.sections.append((f"nereid-worker log ({w.repo.name}, {' '.join(w.args)})", w.log_tail()))


@pytest.fixture(scope="session")
def start_worker(tmp_path_factory):
    """Factory: start_worker(repo, *args, wait_ready=True) -> Worker; stopped at session end
    unless stopped earlier. Prefer the `worker` / `make_worker` fixtures."""
    started: list[Worker] = []

    def start(repo, *args, wait_ready=True):
        w = Worker(repo, list(args), tmp_path_factory.mktemp("worker"), wait_ready=wait_ready)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def worker(start_worker):
    """One worker over the example repository (NONE mode), shared by the read-only tests."""
    check_example_models()
    return start_worker(EXAMPLE_MODELS)


@pytest.fixture
def make_worker(tmp_path):
    """Function-scoped factory for workers over a temporary repository; stopped after the test."""
    started: list[Worker] = []
    counter = [0]

    def start(repo, *args, wait_ready=True):
        counter[0] += 1
        w = Worker(repo, list(args), tmp_path / f"worker{counter[0]}", wait_ready=wait_ready)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def repo_copy(tmp_path):
    """Factory: repo_copy(*model_names) copies example models into a fresh temporary repository."""
    check_example_models()
    dest = tmp_path / "repo"
    dest.mkdir()

    def copy(*names):
        for name in names:
            shutil.copytree(EXAMPLE_MODELS / name, dest / name)
        return dest

    return copy


