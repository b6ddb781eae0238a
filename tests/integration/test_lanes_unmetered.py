"""NOTE [Measured shapes run unmetered]: under PACK a model's calls of an input shape are
metered per operator only until the shape's peak is confirmed; then they run without a
meter, in-process and in worker processes. A shape whose memory depends on its values
keeps raising its peak while confirming and stays metered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from timeshare.errors import LaneExceededError
from timeshare.memory.ephemeral import lane_bytes
from timeshare.runtime.facade import Runtime
from timeshare.runtime.lanes import CONFIRMING_CALLS, lane_ask

X = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


class Witness(nn.Module):
    """Returns its output and whether a dispatch mode (a meter) saw its forward."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(64, 64)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(64, 64, generator=g) * 0.1)
            self.lin.bias.copy_(torch.randn(64, generator=g) * 0.1)

    def forward(self, x):
        metered = _get_current_dispatch_mode() is not None
        return torch.relu(self.lin(x)), torch.tensor(metered)


class Growing(nn.Module):
    """Allocates as many KiB as its input's first value says: same shape, any size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        scratch = torch.ones(int(x[0, 0].item()), 256)
        metered = _get_current_dispatch_mode() is not None
        return self.lin(x) + scratch.sum() * 0, torch.tensor(metered)


def witness() -> Witness:
    return Witness()


def _metered(rt: Runtime, name: str, x: torch.Tensor) -> bool:
    return bool(rt.infer(name, x)[1])


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "workers"])
def test_a_shapes_calls_run_unmetered_once_its_peak_is_confirmed(workers):
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", workers=workers) as rt:
        rt.register("w", "tests.integration.test_lanes_unmetered:witness", example_inputs=(X,))
        seen = [_metered(rt, "w", X) for _ in range(1 + CONFIRMING_CALLS + 3)]
        assert seen == [True] * (1 + CONFIRMING_CALLS) + [False] * 3
        assert _metered(rt, "w", torch.randn(4, 64))  # another shape starts metered
        out = rt.infer("w", X)[0]
        with torch.no_grad():
            assert torch.equal(out, torch.relu(Witness().lin(X)))


def test_a_shape_whose_peak_keeps_rising_stays_metered_and_bounded():
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB") as rt:
        rt.register("g", Growing, example_inputs=(torch.full((8, 64), 16.0),))
        rt.infer("g", torch.full((8, 64), 16.0))  # the first call measures the shape
        size = 16.0
        for _ in range(2 * CONFIRMING_CALLS):
            size *= 1.15  # within the lane's headroom, above the measured peak: it rises
            assert _metered(rt, "g", torch.full((8, 64), size))
        with pytest.raises(LaneExceededError):  # still bounded per operator
            rt.infer("g", torch.full((8, 64), 4096.0))


class Cores(nn.Module):
    """Returns the intra-op thread count its forward runs with."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x), torch.tensor(torch.get_num_threads())


def test_in_process_a_confirmed_shape_runs_on_its_lanes_cores_without_a_meter():
    # The unmetered call on the CPU takes the resident call's plain path; the lane's
    # cores are all it keeps of the lane (NOTE [Lanes in the runtime]).
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", lane_threads=2) as rt:
            rt.register("c", Cores, example_inputs=(X,))
            for _ in range(1 + CONFIRMING_CALLS):
                rt.infer("c", X)
            torch.set_num_threads(3)
            assert int(rt.infer("c", X)[1]) == 2
            rt.register("w", Witness, example_inputs=(X,))
            assert [_metered(rt, "w", X) for _ in range(1 + CONFIRMING_CALLS + 1)][-1] is False
    finally:
        torch.set_num_threads(before)


def test_a_measured_shape_asks_for_its_peak_without_reading_what_is_free():
    # A call's ask (``lane_ask``) reads what is free, under the dispatcher's lock, only
    # until its shape's peak is measured; the runtime measures it at the first call.
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB") as rt:
        rt.register("w", Witness, example_inputs=(X,))
        assert rt.diagnostics().models["w"].ephemeral_bytes == {}  # not measured before its first call
        rt.infer("w", X)
        [(key, peak)] = rt.diagnostics().models["w"].ephemeral_bytes.items()
    reads = []

    def free() -> int:
        reads.append(1)
        return 1 << 20

    entry = SimpleNamespace(ephemeral={key: peak})
    assert lane_ask(entry, key, free) == lane_bytes(peak) and reads == []  # type: ignore[arg-type]
    assert lane_ask(entry, "another shape", free) == 1 << 20 and reads == [1]  # type: ignore[arg-type]
