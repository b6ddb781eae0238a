"""Closing a CPU arena can never pull memory from under a view or a copy thread
(NOTE [Mappings outlive close]); the memory goes back once the last view is gone."""

from __future__ import annotations

import gc
import os

import torch

from timeshare.memory.arena import Arena
from timeshare.transfer.copy import CpuCopyEngine


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


def test_a_view_and_a_copy_in_flight_outlive_close_and_the_memory_goes_with_the_last_of_them():
    arena = Arena(torch.device("cpu"), 1 << 20)
    name = arena.share()[1]
    block = arena.allocate(4096, "m")
    assert block is not None
    view = arena.region(block)
    src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    engine = CpuCopyEngine(deadline_s=10, delay_s=0.2)  # the copy starts after the close below
    try:
        load = engine.start(src, view, [(0, 2048), (2048, 4096)], "test")
        arena.close()
        assert not os.path.exists(f"/dev/shm/{name}")  # the name is gone at once
        load.wait_all()  # the copy thread wrote into the closed arena's bytes: still mapped
        assert torch.equal(view, src)
        assert _mapped(name)
    finally:
        engine.close()
    del view, load
    gc.collect()
    assert not _mapped(name)  # the last view took the mapping, and the memory, with it


def test_an_attached_arena_sees_the_creators_bytes_and_closing_it_unlinks_nothing():
    owner = Arena(torch.device("cpu"), 1 << 16)
    try:
        peer = Arena.attach(owner.share(), owner.capacity, torch.device("cpu"))
        owner.buffer[:8] = torch.arange(8, dtype=torch.uint8)
        assert torch.equal(peer.buffer[:8], torch.arange(8, dtype=torch.uint8))
        peer.close()
        assert os.path.exists(f"/dev/shm/{owner.share()[1]}")
    finally:
        owner.close()
