"""NOTE [One random state per process]: seeded builds and packed jobs' iterations share
PyTorch's process-wide generator without drawing from each other's state."""

from __future__ import annotations

import threading

import torch
from torch import nn

from timeshare.seeding import LOCK, JobRandomState, seeded

CPU = torch.device("cpu")


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _reference(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    saved = torch.get_rng_state()
    try:
        torch.set_rng_state(gen.get_state())
        return _build().state_dict()
    finally:
        torch.set_rng_state(saved)


def test_a_jobs_iteration_started_during_a_seeded_build_leaves_the_build_its_seed():
    job = JobRandomState(seed=123, device=CPU)
    halfway, inside, built = threading.Event(), threading.Event(), {}

    def slow_build() -> nn.Module:
        first = nn.Linear(8, 16)
        halfway.set()
        inside.wait(0.5)  # unguarded, the job's iteration would have swapped its state in by now
        return nn.Sequential(first, nn.ReLU(), nn.Linear(16, 4))

    def build():
        with seeded(0):
            built["sd"] = slow_build().state_dict()

    b = threading.Thread(target=build)
    b.start()
    assert halfway.wait(10)
    with job.active():
        inside.set()
        threading.Event().wait(0.2)  # the build's second layer is drawn meanwhile, unguarded
        torch.rand(4)
    b.join(10)
    want = _reference(0)
    assert all(torch.equal(built["sd"][k], want[k]) for k in want)


def _draws_of(job: JobRandomState, iterations: int, pause_s: float = 0.0) -> list[torch.Tensor]:
    out = []
    for _ in range(iterations):
        with job.active():
            a = torch.rand(3)
            threading.Event().wait(pause_s)
            out.append(torch.cat([a, torch.rand(3)]))
    return out


def test_packed_jobs_that_draw_each_get_the_numbers_they_get_alone():
    alone = {seed: _draws_of(JobRandomState(seed, CPU), 4) for seed in (1, 2)}
    got: dict[int, list[torch.Tensor]] = {}
    threads = [threading.Thread(target=lambda s=s: got.__setitem__(s, _draws_of(JobRandomState(s, CPU), 4, 0.02)))
               for s in (1, 2)]
    outer = torch.get_rng_state()
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(torch.equal(x, y) for s in (1, 2) for x, y in zip(got[s], alone[s], strict=True))
    assert torch.equal(torch.get_rng_state(), outer)  # everyone else's state put back


def test_a_job_that_draws_nothing_stops_taking_the_lock_after_its_first_iteration():
    job = JobRandomState(seed=5, device=CPU)
    with job.active():
        torch.ones(3) * 2
    assert job.draws is False
    entered = threading.Event()
    with LOCK:  # another thread holding the generators does not hold this job up now
        t = threading.Thread(target=lambda: _enter(job, entered))
        t.start()
        assert entered.wait(5)
    t.join(5)

    drawing = JobRandomState(seed=5, device=CPU)
    with drawing.active():
        torch.rand(1)
    assert drawing.draws is True


def _enter(job: JobRandomState, entered: threading.Event) -> None:
    with job.active():
        entered.set()
