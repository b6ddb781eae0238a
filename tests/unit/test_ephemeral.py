"""The ephemeral-memory meter (NOTE [Counting ephemeral bytes]) and a lane's guard."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from timeshare.errors import LaneExceededError, MemoryBudgetError
from timeshare.memory.ephemeral import EphemeralMeter, cpu_share, lane_bytes

KIB4 = 1024 * 4  # bytes of 1024 float32


def test_peak_counts_live_new_storages_and_drops_freed_ones():
    x = torch.ones(1024)
    with EphemeralMeter() as m:
        a = x * 2  # new: 4 KiB
        b = a + 1  # new: 8 KiB live
        del a  # freed: 4 KiB live
        c = b * 3  # 8 KiB live
        assert m.live == 2 * KIB4
    assert m.peak == 2 * KIB4
    del b, c
    assert m.live == 0


def test_views_inputs_and_in_place_results_are_not_new_memory():
    x = torch.ones(1024)
    with EphemeralMeter() as m:
        v = x.view(32, 32).t()  # a view of an input
        x.add_(1)  # in place
        y = v.contiguous()  # a copy: new
    assert m.peak == KIB4
    del y


def test_other_threads_are_not_counted():
    x = torch.ones(1 << 16)
    seen = []
    with EphemeralMeter() as m:
        t = threading.Thread(target=lambda: seen.append((x * 2).sum()))
        t.start()
        t.join()
    assert seen and m.peak == 0


def test_a_limit_raises_naming_the_task_its_lane_and_what_it_asked_for():
    x = torch.ones(1024)
    with pytest.raises(LaneExceededError) as info, EphemeralMeter(KIB4 + 100, task="greedy", lane=3):
        a = x * 2
        b = a * 2  # second 4 KiB: over
        del a, b
    err = info.value
    assert isinstance(err, MemoryBudgetError)
    assert (err.task, err.lane, err.lane_bytes, err.asked) == ("greedy", 3, KIB4 + 100, 2 * KIB4)
    assert "greedy" in str(err) and "lane 3" in str(err) and f"{2 * KIB4:,}" in str(err)
    again = pickle.loads(pickle.dumps(err))  # crosses processes as data
    assert (again.task, again.lane, again.lane_bytes, again.asked) == (err.task, err.lane, err.lane_bytes, err.asked)


def test_a_forward_peak_is_two_activations_of_a_linear_chain():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(5)]).eval()
    x = torch.randn(32, 256)
    with torch.no_grad(), EphemeralMeter() as m:
        out = net(x)
    # One layer's input and output are live at once; weights and x are not ephemeral.
    assert m.peak == 2 * 32 * 256 * 4
    del out


def test_lane_bytes_leaves_headroom():
    assert lane_bytes(1000) > 1000


def test_cpu_share_sets_this_threads_count_only():
    before = torch.get_num_threads()
    inside = []

    def run():
        with cpu_share(torch.device("cpu"), threads=1):
            inside.append(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert inside == [1]
    assert torch.get_num_threads() == before  # the caller's thread is untouched
