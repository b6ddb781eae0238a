"""Shared test set-up: a persistent weights cache, hardware markers, and a check that
the suite leaves no shared-memory segment behind."""

from __future__ import annotations

import functools
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


# How `make test` spreads the suite over pytest-xdist's workers (-n 3 --dist loadgroup
# --no-loadscope-reorder): Ray's tests together on one worker (two local Ray clusters at once
# would fight over two cores), each module with a module- or session-scoped fixture of its own
# on one worker (built once, not once per worker), every other test on its own; the longest
# chains first, so the single tests even out the end.
RAY_MODULES = {"test_cluster.py", "test_cluster_server.py", "test_cluster_llm.py"}
# Modules of single tests that each take tens of seconds: dealt out before the short ones.
SLOW_MODULES = ("test_campaign.py", "test_cli.py", "test_bench_llm.py", "test_faults.py", "test_checkpoints.py",
                "test_chaos.py", "test_llm_workers.py", "test_direct_access.py", "test_dedup.py")


@functools.cache
def _shares_a_fixture(path: Path) -> bool:
    text = path.read_text()
    return 'scope="module"' in text or 'scope="session"' in text


def _distribute(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        if name in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))
            return 0
        if _shares_a_fixture(item.path):
            item.add_marker(pytest.mark.xdist_group(name))
            return 1
        return 2 if name in SLOW_MODULES else 3

    ranks = {id(item): rank(item) for item in items}
    items.sort(key=lambda item: ranks[id(item)])  # stable: each module keeps its own order


def _name_groups(items) -> None:
    """The ``@group`` suffix of every grouped test's id, which is what --dist loadgroup
    schedules by. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2 no
    longer reads (the id lives in ``item._id``): without this every xdist_group was
    ignored, Ray's modules ran on both workers at once and shared fixtures were built
    on both."""
    try:
        from _pytest.nodes import NodeId
    except ImportError:  # a pytest that keeps the id in _nodeid: xdist's own suffix works
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    import torch

    _distribute(items)
    if _in_xdist_worker(config) and config.getvalue("loadgroup"):
        _name_groups(items)

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
