import random

import pytest

from timeshare.errors import ConfigError, TimeshareError
from timeshare.memory.allocator import Allocator, Block


def test_first_fit_alignment_and_coalescing():
    a = Allocator(4096, alignment=512)
    x = a.allocate(100, "x")
    y = a.allocate(600, "y")
    z = a.allocate(512, "z")
    assert (x.offset, x.size) == (0, 512)
    assert (y.offset, y.size) == (512, 1024)
    assert (z.offset, z.size) == (1536, 512)
    assert a.used == 2048 and a.free == 2048
    a.release(y)
    assert a.largest_free == 2048  # the tail, not the 1024 hole
    a.release(x)
    assert a.free_ranges()[0] == (0, 1536)  # x and y's holes merged
    a.release(z)
    assert a.free_ranges() == [(0, 4096)]
    a.check()


def test_returns_none_when_nothing_fits_and_refuses_double_free():
    a = Allocator(2048, alignment=512)
    b = a.allocate(1024, "b")
    assert a.allocate(1025, "c") is None
    assert a.fits(1024) and not a.fits(1025)
    a.release(b)
    with pytest.raises(TimeshareError, match="double free"):
        a.release(b)
    with pytest.raises(TimeshareError, match="'never'.* is not allocated here"):
        a.release(Block(0, 512, "never"))


def test_rejects_bad_configuration():
    with pytest.raises(ConfigError, match="power of two"):
        Allocator(4096, alignment=300)
    with pytest.raises(ConfigError, match="smaller than one aligned block"):
        Allocator(100, alignment=512)
    with pytest.raises(ConfigError, match="negative"):
        Allocator(4096).allocate(-1, "x")


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_the_invariants(seed):
    rng = random.Random(seed)
    a = Allocator(1 << 20, alignment=256)
    live: list[Block] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.release(live.pop(rng.randrange(len(live))))
        else:
            b = a.allocate(rng.randint(0, 40_000), "m")
            if b is not None:
                assert b.offset % 256 == 0
                live.append(b)
        a.check()
        assert a.used == sum(b.size for b in live)
    for b in live:
        a.release(b)
    assert a.free_ranges() == [(0, a.capacity)]


def test_allocate_at_takes_exactly_that_range_or_nothing():
    a = Allocator(8192, alignment=512)
    x = a.allocate(1024, "x")
    a.allocate(1024, "y")
    a.release(x)
    assert a.allocate_at(512, 1024, "z") is None  # would overlap y at 1024
    z = a.allocate_at(0, 512, "z")
    assert z == Block(0, 512, "z")
    w = a.allocate_at(4096, 1000, "w")  # in the middle of the tail free range
    assert w == Block(4096, 1024, "w")
    assert a.free_ranges() == [(512, 512), (2048, 2048), (5120, 3072)]
    assert a.allocate_at(100, 512, "bad") is None  # unaligned
    assert a.allocate_at(8192 - 512, 1024, "bad") is None  # past the end
    a.check()
