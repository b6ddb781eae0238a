"""One served model as the HTTP side sees it: its inputs and outputs in Open Inference
Protocol terms, its state (with, after a failed load, why: NOTE [Permanent and transient
failures]), where it comes from (``model_source``) and its queue of waiting requests.
Runs in the server's event loop; nothing here touches the runtime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from timeshare.config import ModelConfig, TensorSpec
from timeshare.dtypes import TORCH_DTYPES, parse_dtype
from timeshare.errors import BadRequest, LoadFailed, Unavailable
from timeshare.llm import hfdir
from timeshare.models.spec import Builder
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.hops import RequestTimes
from timeshare.server.status import ModelFailure
from timeshare.server.tensors import datatype_of


class ModelState(enum.Enum):
    LOADING = "LOADING"  # registering or warming up; requests queue
    READY = "READY"
    UNLOADING = "UNLOADING"  # queued requests finish, new ones are refused
    UNAVAILABLE = "UNAVAILABLE"  # not registered (unloaded, or it failed to load: see ``reason`` and ``failure``)


@dataclass(frozen=True)
class OutputSpec:
    name: str
    datatype: str
    shape: list[int]


@dataclass
class Pending:
    """A request waiting for its model: its inputs in the forward's order."""

    tensors: list[torch.Tensor]
    rows: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    times: RequestTimes | None = None  # its stamps, NOTE [Request hops]
    _key: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> tuple:
        """Requests with equal keys can run as one batch (concatenated along dim 0);
        made once, though a request is compared with each one taken before it."""
        if self._key is None:
            self._key = tuple((tuple(t.shape[1:]), t.dtype) for t in self.tensors)
        return self._key


class Endpoint:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.inputs: list[TensorSpec] = cfg.inputs if cfg.inputs is not None else _zoo_inputs(cfg)
        # What every request's check needs of the inputs, made once (they never change).
        self._names = [s.name for s in self.inputs]
        self._known = frozenset(self._names)
        self._specs = [(s, TORCH_DTYPES.get(s.datatype), s.shape, s.min is not None or s.max is not None)
                       for s in self.inputs]
        self.outputs: list[OutputSpec] = []  # known after the first inference
        self.state = ModelState.UNAVAILABLE
        self.reason = "not loaded yet"
        # Why its last load failed, permanent or transient (NOTE [Permanent and transient
        # failures]); None once it loads, and after an unload (the operator's choice).
        self.failure: ModelFailure | None = None
        self.retries = 0  # transient failures in a row: the back-off before the next load
        self.retry: asyncio.Task | None = None  # the next load after a transient failure (``load_later``)
        self.optional = cfg.optional  # readiness does not wait for it
        self.pinned = cfg.pinned
        self.batchable = cfg.batching  # also cleared when an output has no batch dimension to split
        self.queue: deque[Pending] = deque()
        self.in_flight: list[Pending] = []  # the batches on the device (one, but in front of a cluster)
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # one admin operation at a time
        self.runner: asyncio.Task | None = None
        self.batch_s = 1.0  # moving average of a batch's device time, for Retry-After
        self.load_s = 1.0

    # ------------------------------------------------------------------ inputs
    def check(self, given: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """The inputs in the forward's order, and their rows; :class:`BadRequest` names
        the first problem."""
        names = self._names
        if len(given) != len(names) or not self._known.issuperset(given):
            extra = sorted(set(given) - self._known)
            if extra:
                raise BadRequest(f"model {self.name!r} has no input {extra[0]!r}; its inputs are {names}")
            missing = [n for n in names if n not in given]
            raise BadRequest(f"model {self.name!r} needs input {missing[0]!r}; its inputs are {names}")
        ordered, rows = [], None
        for spec, dtype, want, bounded in self._specs:
            t = given[spec.name]
            if t.dtype != dtype:
                got = datatype_of(t.dtype)
                raise BadRequest(f"input {spec.name!r} of model {self.name!r} must be {spec.datatype}, got {got}")
            shape = t.shape
            if len(shape) != len(want) or any(s != -1 and s != g for s, g in zip(want, shape)):
                raise BadRequest(f"input {spec.name!r} of model {self.name!r} must have shape {spec.shape} "
                                 f"(-1: any size), got {list(shape)}")
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise BadRequest(f"inputs of model {self.name!r} disagree on the batch size: "
                                 f"{spec.name!r} has {shape[0]}, an earlier one {rows}")
            if bounded and t.numel():
                values = t.numpy()  # numpy: torch has no min/max for uint16/32/64
                lo, hi = int(values.min()), int(values.max())
                if (spec.min is not None and lo < spec.min) or (spec.max is not None and hi > spec.max):
                    raise BadRequest(f"input {spec.name!r} of model {self.name!r}: values must lie in "
                                     f"[{spec.min}, {spec.max}], got [{lo}, {hi}]")
            ordered.append(t)
        assert rows is not None
        if not 1 <= rows <= self.cfg.max_batch:
            raise BadRequest(f"model {self.name!r} takes 1 to {self.cfg.max_batch} rows per request, got {rows}")
        return ordered, rows

    def example_inputs(self) -> tuple:
        if self.cfg.zoo is not None:
            return zoo_get(self.cfg.zoo).example_inputs(self.cfg.example_batch, parse_dtype(self.cfg.dtype) or
                                                        torch.float32)
        g = torch.Generator().manual_seed(0)
        out = []
        for spec in self.inputs:
            shape = [self.cfg.example_batch] + [d if d >= 0 else 1 for d in spec.shape[1:]]
            dtype = TORCH_DTYPES[spec.datatype]
            if dtype.is_floating_point:
                out.append(torch.randn(shape, generator=g).to(dtype))
            elif dtype == torch.bool:
                out.append(torch.zeros(shape, dtype=dtype))
            else:
                lo = spec.min if spec.min is not None else 0
                hi = spec.max if spec.max is not None else lo
                out.append(torch.randint(lo, hi + 1, shape, generator=g).to(dtype))
        return tuple(out)

    # ------------------------------------------------------------------ queue
    def take_batch(self) -> list[Pending]:
        """The oldest live request and, when the model batches, the next ones with the
        same shapes, up to ``max_batch`` rows."""
        while self.queue and self.queue[0].future.done():  # timed out or cancelled
            self.queue.popleft()
        if not self.queue:
            return []
        first = self.queue.popleft()
        batch, rows = [first], first.rows
        if self.batchable:
            kept: deque[Pending] = deque()
            while self.queue:
                p = self.queue.popleft()
                if p.future.done():
                    continue
                if p.key == first.key and rows + p.rows <= self.cfg.max_batch:
                    batch.append(p)
                    rows += p.rows
                else:
                    kept.append(p)
            self.queue = kept
        return batch

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def unavailable(self) -> Unavailable:
        """What a request gets while the model is not loaded: after a permanent failure
        ``LoadFailed`` with the cause (503 without Retry-After, NOTE [Permanent and transient
        failures]), else ``Unavailable`` (503 with Retry-After)."""
        load = f"POST /v2/repository/models/{self.name}/load"
        if self.failure is not None and self.failure.permanent:
            return LoadFailed(f"model {self.name!r} failed to load and cannot serve until the cause is fixed and it "
                              f"is loaded again ({load}): {self.failure.cause}")
        return Unavailable(f"model {self.name!r} is not loaded ({self.state.value}: {self.reason}); {load}")

    def load_later(self, load: Callable[[Endpoint], Awaitable[None]]) -> None:
        """After a transient failure (NOTE [Permanent and transient failures]): ``load(self)``
        after a back-off, 1 s and twice as long after each failure in a row, at most a
        minute, under the endpoint's lock, unless it has loaded, been unloaded or failed for
        good meanwhile. The service cancels it when it stops."""
        delay = min(60.0, 2.0 ** self.retries)
        self.retries += 1

        async def again() -> None:
            await asyncio.sleep(delay)
            async with self.lock:
                if self.failure is not None and not self.failure.permanent:
                    await load(self)

        self.retry = asyncio.create_task(again(), name=f"timeshare-reload-{self.name}")

    def retry_after(self, resident: bool) -> int:
        """Seconds until a place in the queue is likely to free up: the queued rows in
        batches of the measured duration, after a load if the model is not resident."""
        rows = sum(p.rows for p in self.queue) if self.batchable else len(self.queue)
        batches = math.ceil(rows / (self.cfg.max_batch if self.batchable else 1))
        estimate = (batches + 1) * self.batch_s + (0.0 if resident else self.load_s)
        return max(1, math.ceil(estimate))

    # ------------------------------------------------------------------ description
    def metadata(self) -> dict:
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": "pytorch_timeshare",
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in self.inputs],
            "outputs": [dataclasses.asdict(o) for o in self.outputs],
        }


def model_source(cfg: ModelConfig) -> tuple[Builder, str | Path | list[Path] | None]:
    """How to build a configured model, and its weights file or shards (None: the module's
    own values); a zoo model's seeded weights are generated on first use."""
    if cfg.zoo is not None:
        return zoo_get(cfg.zoo).builder, cfg.weights or weights_path(cfg.zoo)
    if cfg.path is not None:  # a Hugging Face directory: its class, its shards
        return functools.partial(hfdir.build_module, cfg.path), hfdir.shard_files(cfg.path)
    assert cfg.build is not None, "ModelConfig._source: exactly one of zoo, build and path"
    return cfg.build, cfg.weights


def _zoo_inputs(cfg: ModelConfig) -> list[TensorSpec]:
    assert cfg.zoo is not None, "a model without 'inputs' is a zoo model (ModelConfig._source)"
    zoo = zoo_get(cfg.zoo)
    example = zoo.example_inputs(1, parse_dtype(cfg.dtype) or torch.float32)
    specs = []
    for i, t in enumerate(example):
        bounds = zoo.input_bounds[i] if i < len(zoo.input_bounds) else None
        name = zoo.input_names[i] if i < len(zoo.input_names) else f"input_{i}"
        specs.append(TensorSpec(name=name, datatype=datatype_of(t.dtype), shape=[-1, *t.shape[1:]],
                                min=bounds[0] if bounds else None, max=bounds[1] if bounds else None))
    return specs


def flatten_outputs(obj, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """A model's output as named tensors: a tensor is "output"; tuple items are
    "output_0", ...; dict keys and dataclass fields keep their names, nested with
    "." (dicts, dataclasses) or "_i" (sequences). Values that are not tensors are left out."""
    if isinstance(obj, torch.Tensor):
        return [(name or "output", obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict"):  # a namedtuple
        obj = obj._asdict()
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += flatten_outputs(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += flatten_outputs(v, f"{name}_{i}" if name else f"output_{i}")
    return out


def split_outputs(named: list[tuple[str, torch.Tensor]], rows: list[int]) -> list[dict[str, torch.Tensor]] | None:
    """Each request's share of a batch's outputs, or None when an output has no batch
    dimension to split along."""
    total = sum(rows)
    parts: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for n, t in named:
        if t.dim() == 0 or t.shape[0] != total:
            return None
        for part, piece in zip(parts, torch.split(t, rows)):
            part[n] = piece
    return parts


def describe_outputs(named: list[tuple[str, torch.Tensor]], rows: int) -> list[OutputSpec]:
    return [OutputSpec(n, datatype_of(t.dtype), [-1 if i == 0 and d == rows else d for i, d in enumerate(t.shape)])
            for n, t in named]
