"""Shared test set-up: a persistent weights cache, hardware markers, and a check that
the suite leaves no shared-memory segment behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def weights_cache():
    """Zoo weights made once, in the checkout's .cache (unless TIMESHARE_CACHE names another
    directory), for this process and the workers and servers it starts; the environment is
    given back at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIMESHARE_CACHE", os.environ.get("TIMESHARE_CACHE") or str(ROOT / ".cache"))
        yield


def _segments() -> set[str]:
    try:
        return {p for p in os.listdir("/dev/shm") if p.startswith("psm_")}
    except FileNotFoundError:
        return set()


# The leak check spans the whole run: under pytest-xdist it runs in the controller, before the
# first test worker starts and after the last one ends, since one worker cannot tell its own
# segments from another's in /dev/shm.
_BEFORE = pytest.StashKey[set[str]]()
_LEAKED = pytest.StashKey[list[str]]()


def _in_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if not _in_xdist_worker(session.config):
        session.config.stash[_BEFORE] = _segments()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    leaked = sorted(_segments() - before)
    if leaked:
        session.config.stash[_LEAKED] = leaked
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    leaked = config.stash.get(_LEAKED, None)
    if leaked:
        terminalreporter.write_line(f"FAILED: shared-memory segments left behind: {leaked}", red=True)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
