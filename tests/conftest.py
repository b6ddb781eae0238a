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


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    before = _segments()
    yield
    leaked = _segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
