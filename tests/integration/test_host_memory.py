"""Memory given back, counted: shared-memory mappings of the controller and of every
worker (read from /proc/<pid>/maps, so runs beside ours cannot disturb the count) and
the arena's allocator bytes, before and after register, unregister and close; inputs
through workers on the CPU."""

from __future__ import annotations

import os
import time

import torch

import timeshare
from tests import models
from tests.exact import nan_free, same

X = torch.randn(2, 8)


def shm_mappings(pid: int | str = "self") -> dict[str, int]:
    """Bytes of every POSIX shared-memory segment ``pid`` maps, by segment name."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                name = fields[5].removeprefix("/dev/shm/")
                found[name] = found.get(name, 0) + end - start
    return found


def exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_unregister_and_close_give_every_byte_back_with_workers():
    mine = set(shm_mappings())
    rt = timeshare.Runtime(device="cpu", memory="4MiB", workers=2, profile_repeats=1)
    try:
        pids = rt.worker_pids()
        ours = set(shm_mappings()) - mine
        base = {p: set(shm_mappings(p)) for p in pids}
        arena = ours & set.intersection(*base.values())  # the one segment every process maps
        assert len(arena) == 1
        # Beside it, each worker maps its own tensor channel, which the controller maps too
        # (NOTE [Tensor channel]).
        channels = [base[p] - arena for p in pids]
        assert all(len(c) == 1 for c in channels) and set.union(*channels) == ours - arena

        rt.register("m", "tests.models:out_of_order", None, (X,))
        assert set(shm_mappings()) - mine == ours  # the controller keeps no view of a host store
        store = set(shm_mappings(pids[0])) - base[pids[0]]
        assert len(store) == 1
        (name,) = store
        host = rt.snapshot().host_bytes
        assert host > 0 and shm_mappings(pids[0])[name] >= host  # the segment, page-rounded
        assert exists(name) and all(set(shm_mappings(p)) == base[p] | store for p in pids)  # every worker maps it
        with torch.no_grad():
            expected = models.out_of_order().eval()(X)
        assert torch.equal(rt.infer("m", X)["y"], expected["y"])
        assert rt.stats()["used_bytes"] > 0

        rt.unregister("m")
        assert rt.stats()["used_bytes"] == 0 and rt.snapshot().host_bytes == 0
        assert not exists(name) and set(shm_mappings()) - mine == ours
        assert all(set(shm_mappings(p)) == base[p] for p in pids)  # the workers let go of it too
    finally:
        rt.close()
    assert not any(exists(n) for n in ours) and set(shm_mappings()) - mine == set()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_unregister_and_close_give_every_byte_back_in_process():
    mine = set(shm_mappings())
    rt = timeshare.Runtime(device="cpu", memory="4MiB", profile_repeats=1)
    try:
        arena = set(shm_mappings()) - mine
        assert len(arena) == 1
        rt.register("m", models.out_of_order, None, (X,))
        assert set(shm_mappings()) - mine == arena  # the host store is private memory, not shared
        rt.infer("m", X)
        snap = rt.snapshot()
        assert snap.used_bytes > 0 and snap.host_bytes > 0
        assert snap.host_pinned_bytes == 0  # nothing is page-locked for the CPU
        rt.unregister("m")
        snap = rt.snapshot()
        assert snap.used_bytes == 0 and snap.host_bytes == 0 and snap.resident == {}
    finally:
        rt.close()
    assert not any(exists(n) for n in arena) and set(shm_mappings()) - mine == set()


def test_inputs_of_every_kind_reach_a_worker_and_outputs_come_back_equal():
    """Inputs cross as host tensors in one message, args and kwargs together; the
    outputs are the in-process ones."""
    x = torch.randn(4, 8).t().contiguous().t()  # transposed layout
    with timeshare.Runtime(device="cpu", memory="4MiB", profile_repeats=1) as local:
        local.register("h", models.optional_head, None, (x,))
        expected = local.infer("h", x, use_head=True)
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=1, profile_repeats=1) as rt:
        rt.register("h", "tests.models:optional_head", None, (x,))
        assert same(rt.infer("h", x, use_head=True), expected) and nan_free(expected)
