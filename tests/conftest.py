"""Shared test set-up: a persistent weights cache, hardware markers, and a check that
the suite leaves no shared-memory segment behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TIMESHARE_CACHE", str(ROOT / ".cache"))


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
