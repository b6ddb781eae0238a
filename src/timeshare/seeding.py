"""PyTorch's random state is one per process, shared by every thread in it.

NOTE [One random state per process]
PyTorch's default generators (the CPU's, and one per CUDA device) are process-wide, and
``nn.init`` and dropout draw from them with no way to pass a generator of one's own. In one
process several things want them at once: seeded model builds (training jobs, zoo weights,
written language models) and packed training jobs, whose iterations run side by side in
lanes, each with its own random state swapped in. Unguarded, a build in one thread drew
its weights from the state a packed job had swapped in from another (seen as a packed
job ending with weights unlike the same job alone, about 1 run in 60).

So every use that replaces or relies on the process's state holds ``LOCK``:
- a seeded block (``seeded``) holds it throughout;
- a job's iteration (``JobRandomState.active``) holds it throughout, swapping the job's
  state in and out, until the job is known not to draw at all: its first iteration is
  run that way and tells (the state it left equals the state it got). A job that drew
  nothing then runs its later iterations without the lock or a swap, beside the other
  lanes; one that did keeps holding it, so packed jobs that draw random numbers take
  turns per iteration, and each stays reproducible.
A job that draws nothing in its first iteration but does later draws from whatever the
process's state is then; its results are reproducible only when it runs alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

LOCK = threading.RLock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block (a seeded build) with the process's generators seeded with ``seed`` and
    no other thread using them; their states before (the CPU's, and every CUDA device's
    once CUDA is in use) are put back after."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class JobRandomState:
    """One training job's random state (CPU, and ``device``'s when it is a CUDA device),
    seeded with ``seed``, kept between its iterations."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.cpu = gen.get_state()
        self.cuda: torch.Tensor | None = None
        if device.type == "cuda":
            with LOCK, torch.random.fork_rng(devices=[device]):
                with torch.cuda.device(device):  # manual_seed seeds the current device only
                    torch.cuda.manual_seed(seed)
                self.cuda = torch.cuda.get_rng_state(device)
        self.draws: bool | None = None  # unknown until the first iteration has run

    def export(self) -> dict:
        """The state as data, to go on elsewhere (a checkpoint)."""
        return {"cpu": self.cpu.clone(), "cuda": None if self.cuda is None else self.cuda.clone(), "draws": self.draws}

    def load(self, state: dict) -> None:
        self.cpu = state["cpu"].clone()
        if self.cuda is not None and state["cuda"] is not None:
            self.cuda = state["cuda"].clone()
        self.draws = state["draws"]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run one iteration with the job's own state in the process's generators
        (NOTE [One random state per process])."""
        if self.draws is False:
            yield
            return
        with LOCK:
            outer_cpu = torch.get_rng_state()
            outer_cuda = torch.cuda.get_rng_state(self.device) if self.cuda is not None else None
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            try:
                yield
            finally:
                cpu = torch.get_rng_state()
                cuda = torch.cuda.get_rng_state(self.device) if self.cuda is not None else None
                drew = not torch.equal(cpu, self.cpu) or (
                    cuda is not None and self.cuda is not None and not torch.equal(cuda, self.cuda))
                self.cpu, self.cuda = cpu, cuda
                self.draws = bool(self.draws) or drew
                torch.set_rng_state(outer_cpu)
                if outer_cuda is not None:
                    torch.cuda.set_rng_state(outer_cuda, self.device)
