"""A worker process's end of a call's tensors (runs in the worker): its tensor channel,
mapped again when the controller grows it (NOTE [Tensor channel]), and the pinned staging
buffer for inputs that came pickled (NOTE [Input staging]). The controller's end is
``executor/handle.py``; the channel's layout is ``worker/channel.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from timeshare import protocol as P
from timeshare.device import HostRegistrar
from timeshare.errors import ModelError
from timeshare.transfer.host_store import InputStaging
from timeshare.tree import map_tensors, tensors_in
from timeshare.worker import channel as C

log = logging.getLogger(__name__)


class CallTensors:
    """Where a call's inputs come from and its outputs go to, in one worker process."""

    def __init__(self, start: P.Start, device: torch.device, registrar: HostRegistrar | None, alignment: int,
                 where: str):
        self.device = device
        self.registrar = registrar
        self.where = where
        self.cuda = device.type == "cuda"
        self.staging = InputStaging(registrar, alignment=alignment)  # inputs that came pickled
        # NOTE [Tensor channel]: mapped (and on CUDA page-locked) before the Hello.
        self.channel = C.Channel.attach(start.channel, registrar) if start.channel is not None else None

    def inputs_of(self, msg: P.RunModel | P.Profile) -> tuple[tuple, dict, int]:
        """The call's args and kwargs where the model runs, and the first channel byte after
        them (NOTE [Tensor channel]): views of the channel where the controller wrote them,
        mapping first a channel it has grown."""
        if msg.channel is not None and (self.channel is None or msg.channel.name != self.channel.spec.name):
            old, self.channel = self.channel, None
            if old is not None:
                old.release()
            self.channel = C.Channel.attach(msg.channel, self.registrar)
        channel = self.channel
        args, kwargs, end = msg.args, msg.kwargs, 0
        if msg.refs:
            if channel is None:
                raise ModelError(f"{msg.refs} inputs are in a tensor channel this worker was not given")
            (args, kwargs), end = C.views((args, kwargs), channel.buffer)
        if not self.cuda:
            return args, kwargs, end  # already where the model runs
        return (*self._to_device(args, kwargs), end)

    def _to_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """On CUDA each input is uploaded once, with a non-blocking copy: from the page-locked
        channel where it lies there (NOTE [Tensor channel]), else (it came pickled) from the
        pinned staging buffer, in one call for args and kwargs (NOTE [Input staging])."""
        channel, device = self.channel, self.device
        tensors = tensors_in((args, kwargs))
        if not tensors:
            return args, kwargs
        in_channel = [channel is not None and channel.holds(t) for t in tensors]
        staged = iter(self.staging.upload([t for t, c in zip(tensors, in_channel) if not c], device)
                      if not all(in_channel) else [])
        moved = []
        for t, c in zip(tensors, in_channel):
            if c:
                up = t.detach().to(device, non_blocking=True)
                moved.append(up.requires_grad_() if t.requires_grad else up)
            else:
                moved.append(next(staged))
        if channel is not None and any(in_channel):
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            channel.mark_in_flight(done)  # the uploads read the channel until then
        it = iter(moved)
        return map_tensors((args, kwargs), lambda _t: next(it))

    def outputs(self, out: Any, in_end: int, to_host: Callable[[Any], Any]) -> tuple[Any, int, int, list]:
        """Each output copied once, into the channel after the inputs (from the device,
        queued, on CUDA); one that does not fit comes down to the host (``to_host``) and is
        pickled. Returns what the Result carries, the tensors in the channel, their bytes
        there, and the tensors left to pickling."""
        if self.channel is not None:
            enc = C.encode(out, self.channel.buffer, in_end, non_blocking=self.cuda, keep=to_host)
            return enc.value, enc.refs, enc.need - in_end, enc.left
        return to_host(out), 0, 0, []

    def settle(self) -> None:
        """Nothing of this worker reads the channel once this returns: before any answer to
        a call, a Failure too, since the controller then writes the next call's inputs."""
        if self.channel is None:
            return
        try:
            self.channel.settle()
        except Exception:
            log.exception("%s: waiting for the uploads from the tensor channel", self.where)

    def release(self) -> None:
        """The staging buffer and the channel's mapping go (the worker is exiting)."""
        self.staging.release()
        if self.channel is not None:
            self.channel.release()
