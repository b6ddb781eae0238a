"""Test hooks: what white-box tests of loading, pinning and shared sets read of the models
running in the test's own process. Never called by production code (a test checks that
nothing under ``src/`` outside this package does). Runs in the controller."""

from __future__ import annotations

from typing import Any

from timeshare.executor.inprocess import InProcessExecutor
from timeshare.worker.worker import Worker


def in_process_worker(runtime: Any) -> Worker | None:
    """The worker that runs ``runtime``'s models in this process (an in-process runtime),
    or None (with worker processes)."""
    executor = runtime.executor
    return executor.worker if isinstance(executor, InProcessExecutor) else None
