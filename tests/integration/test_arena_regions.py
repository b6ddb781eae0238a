"""NOTE [Regions of the arena]: memory a part of the runtime holds apart from any model
(a language model's key/value pages) is a block of the arena, placed as a model is and
never taken or evicted by a model's placement until it is given back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import timeshare
from timeshare.errors import ConfigError, MemoryBudgetError, ModelTooLargeError
from timeshare.runtime.events import EvictionRecord
from timeshare.runtime.observe import RegionView

LINEAR = 256 * 256 * 4 + 256 * 4  # nn.Linear(256, 256) in fp32 (each tensor 512-byte aligned)


def linear(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(256, 256)


def test_a_region_is_held_apart_from_the_models_until_given_back():
    held_apart("cpu")


def test_a_region_that_does_not_fit_is_refused_clearly_and_takes_nothing():
    refused("cpu")


def reference(m: nn.Module, x: torch.Tensor, device: str) -> torch.Tensor:
    """``m``'s output for ``x`` computed on ``device`` (its kernels, as the runtime's), on the CPU."""
    with torch.no_grad():
        return m.to(device)(x.to(device)).cpu()


def held_apart(device: str) -> None:
    """The first test on ``device`` (also run by the GPU tier, ``tests/gpu/test_cuda_regions.py``)."""
    x = torch.randn(3, 256)
    mods = {f"m{i}": linear(i) for i in range(3)}
    want = {n: reference(m, x, device) for n, m in mods.items()}
    for m in mods.values():
        m.cpu()
    with timeshare.Runtime(device, 3 * LINEAR + 4096, poison_evicted=True, profile_repeats=1) as rt:
        evicted: list[str] = []
        rt.subscribe(lambda r: evicted.append(r.model) if isinstance(r, EvictionRecord) else None)
        for name, m in mods.items():
            rt.register(name, lambda m=m: m, m.state_dict(), (x,))
        for name in ("m0", "m1", "m2"):
            assert torch.equal(rt.infer(name, x), want[name])
        del evicted[:]  # the first loads' own (profiling)
        assert rt.snapshot().resident == {n: LINEAR for n in mods}
        used = rt.snapshot().used_bytes
        # Room for one model's bytes: the least recently used idle model leaves for it.
        held = rt.reserve("pages", LINEAR)
        region = held.memory
        assert region.dtype == torch.uint8 and region.numel() == LINEAR == held.nbytes and held.owner == "pages"
        assert evicted == ["m0"] and set(rt.resident()) == {"m1", "m2"}
        snap = rt.snapshot()
        assert snap.reserved == {"pages": LINEAR} and snap.used_bytes == used
        placed = rt.diagnostics().regions["pages"]
        assert placed.offset == held.offset
        # Models come and go around it (each eviction poisoned); it keeps its bytes and place.
        pattern = torch.arange(region.numel(), dtype=torch.int64).remainder(251).to(torch.uint8).to(region.device)
        assert region.device.type == device
        region.copy_(pattern)
        for _ in range(2):
            for name in ("m0", "m1", "m2"):
                assert torch.equal(rt.infer(name, x), want[name])
        assert len(rt.resident()) == 2 and torch.equal(region, pattern)
        assert rt.diagnostics().regions["pages"] == placed
        # Given back, its room serves the models again.
        rt.unreserve("pages")
        assert rt.snapshot().reserved == {}
        for name in ("m0", "m1", "m2"):
            assert torch.equal(rt.infer(name, x), want[name])
        assert set(rt.resident()) == {"m0", "m1", "m2"}


def refused(device: str) -> None:
    """The second test on ``device``."""
    x = torch.randn(3, 256)
    m = linear(0)
    want = reference(m, x, device)
    m.cpu()
    with timeshare.Runtime(device, 2 * LINEAR, profile_repeats=1) as rt:
        rt.register("m", lambda: m, m.state_dict(), (x,), pin=True)
        rt.infer("m", x)
        used = rt.snapshot().used_bytes
        with pytest.raises(MemoryBudgetError, match=r"cannot place the pages .*every resident model is pinned"):
            rt.reserve("pages", 2 * LINEAR, what="the pages")
        with pytest.raises(ModelTooLargeError, match=r"the pages needs .* but the whole arena holds"):
            rt.reserve("pages", 3 * LINEAR, what="the pages")
        for bad in (0, -1, "1MiB", 1.5, True):
            with pytest.raises(ConfigError, match="positive whole number of bytes"):
                rt.reserve("pages", bad)
        snap = rt.snapshot()
        assert snap.reserved == {} and snap.used_bytes == used and rt.resident() == ["m"]
        assert torch.equal(rt.infer("m", x), want)
        assert rt.reserve("pages", 1000).memory.numel() == 1000
        with pytest.raises(ConfigError, match="already holds memory"):
            rt.reserve("pages", 1024)
        assert rt.snapshot().reserved == {"pages": 1024}  # what it takes: whole 512-byte units
        # At the arena's top end, free here: away from the offsets models come back to.
        assert rt.diagnostics().regions["pages"] == RegionView(2 * LINEAR - 1024, 1024)
