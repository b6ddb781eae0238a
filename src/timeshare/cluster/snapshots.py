"""The replicas' snapshots added up into one, as a server shows a cluster's (NOTE [A
cluster behind the server] in ``cluster/backend.py``). Runs in the server's process."""

from __future__ import annotations

from typing import Any

# The counters of a runtime's snapshot (the rest are levels: memory, residency, queues).
COUNTERS = ("loads", "evictions", "failures", "preemptions", "training_seconds", "training_iterations")


def add_snapshots(values: list) -> Any:
    """The replicas' snapshots added up: numbers summed, mappings key by key, lists
    joined, None where none has a value; anything else is the first's."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, bool):
        return all(present)
    if isinstance(first, (int, float)):
        return sum(present)
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in present for k in v)
        return {k: add_snapshots([v.get(k) for v in present]) for k in keys}
    if isinstance(first, list):
        return [x for v in present for x in v]
    return first
