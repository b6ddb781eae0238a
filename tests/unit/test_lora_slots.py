"""NOTE [Adapters in slots], on a module of two layers of projections: each row gets its
own slot's correction, PEFT's ``x @ A^T @ B^T * scale``, and nothing of another slot's,
not even an inf."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from timeshare.decode.lora import LoraLayers, LoraSpec, LoraStacks, LoraUse, pack
from timeshare.errors import ConfigError


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _setup(slots: int = 4, rank: int = 3):
    torch.manual_seed(0)
    module = _Tiny().eval()
    spec = LoraSpec.of(module, slots, rank, torch.float32)
    stacks = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    layers = LoraLayers(stacks, rows=4, device=torch.device("cpu"))
    layers.attach(module)
    return module, spec, stacks, layers


def _factors(spec: LoraSpec, rank: int, seed: int, fill: float | None = None):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in spec.targets:
        a, b = torch.randn(rank, t.fan_in, generator=gen), torch.randn(t.fan_out, rank, generator=gen)
        if fill is not None:  # what an overflow of x @ A in half precision gives
            a.fill_(fill)
        out.append((a, b, 0.5))
    return out


def _image(factors):
    return [pack(a, b, scale, torch.float32) for a, b, scale in factors]


def _reference(module: nn.Module, x: torch.Tensor, factors) -> torch.Tensor:
    """The module with each projection's output plus PEFT's correction, computed plainly."""
    i = 0
    for layer in module.layers:
        for proj in layer:
            a, b, scale = factors[i]
            x = torch.nn.functional.linear(x, proj.weight, proj.bias) + (x @ a.t() @ b.t()) * scale
            i += 1
    return x


def test_each_row_gets_its_own_slots_correction_and_nothing_of_another_slot():
    module, spec, stacks, layers = _setup()
    one, two = _factors(spec, 2, 1), _factors(spec, 3, 2)
    stacks.write(1, _image(one))
    stacks.write(2, _image(two))
    stacks.write(3, _image(_factors(spec, 3, 3, fill=float("inf"))))  # a slot no row uses, its x @ A all inf
    x = torch.randn(4, 1, 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # products this small run on one thread, and the count is put back
    try:
        with torch.no_grad():
            plain = module(x)
            layers.use([0, 1, 2, 0], LoraUse(3, (1 << len(spec.targets)) - 1))
            got = module(x)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[0], plain[0]) and torch.allclose(got[3], plain[3])  # the base's rows
    assert torch.allclose(got[1], _reference(module, x[1:2], one)[0], atol=1e-5)
    assert torch.allclose(got[2], _reference(module, x[2:3], two)[0], atol=1e-5)


def test_a_batch_of_one_adapter_and_a_rank_prefix_give_the_same_numbers():
    module, spec, stacks, layers = _setup()
    low = _factors(spec, 2, 4)
    stacks.write(2, _image(low))
    x = torch.randn(3, 2, 6)
    with torch.no_grad():
        layers.use([2, 2, 2], LoraUse(2, (1 << len(spec.targets)) - 1))  # one adapter, its rank only
        got = module(x)
        layers.use([2, 2, 0], None)  # mixed, every rank
        mixed = module(x)
    want = _reference(module, x, low)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(mixed[:2], want[:2], atol=1e-5)


def test_slot_zero_is_the_bases_and_has_no_column_to_write_or_clear():
    _, spec, stacks, _ = _setup()
    stacks.write(spec.slots - 1, _image(_factors(spec, 2, 5)))
    kept = [a.clone() for a in stacks.a]
    for bad in (0, spec.slots):
        with pytest.raises(ConfigError, match="is not one of 1.."):
            stacks.clear(bad)
        with pytest.raises(ConfigError, match="is not one of 1.."):
            stacks.write(bad, _image(_factors(spec, 2, 6)))
    assert all(torch.equal(a, k) for a, k in zip(stacks.a, kept))  # the last slot's column untouched
