"""Which device (replica) takes a request: routing policies over a fleet's state, one
implementation for the cluster-scale simulator and for a cluster's router.

NOTE [Fleet routing]
The state is arrays (``Fleet``): per model its bytes, its compute seconds when resident
and when not (a pipelined load, measured per model); per device its memory, the models it
holds (in slots, linked in the order they were last routed to, each with the time its
last queued request ends; free slots on a stack), and when its queue is expected to
drain. A step is O(1) or O(log D) but for the scan of a model's holders, a walk of
the device's recency list per eviction, and O(D) fallbacks when the first choices are
too small or gone; ten million requests over a thousand devices take seconds. Two pure steps act on it, the
same compiled functions whoever calls them:
  * ``choose`` reads the state and returns the device (no change to anything). Its random
    choices come from numbers the caller passes, so a decision is a function of its
    arguments: replayable, and testable against a hand-worked answer.
  * ``place`` makes the model resident on the chosen device (evicting the least recently
    routed models that leave room, preferring ones with no queued work) and returns what
    it cost: whether a load is needed, and the reloads owed to evicted models that still
    had requests queued there.
The policies:
  * ``random``: a device uniformly at random.
  * ``least-loaded``: the device whose queue drains first (an indexed heap: O(log D)).
  * ``ray``: Ray Serve's model multiplexing. Replicas holding the model first, the less
    loaded of two drawn at random (power of two choices), unless even that one has
    ``max_ongoing`` requests outstanding; otherwise the one of two random replicas with
    fewer models loaded. Each replica keeps at most ``max_models`` models, least
    recently used out first (by count; bytes must fit too, or the replica would run
    out of memory).
  * ``timeshare``: a model's replicas follow its demand. The request goes to the
    holder (resident or loading) whose queue drains first, unless the model wants
    another replica: its request rate (an exponentially decayed count, time constant
    RATE_TAU_S) needs more replicas than it has, each taking REPLICA_SHARE of a device,
    or that holder would keep the request waiting more than ``replicate_margin``
    times the model's cold time (a burst; Ray's rule waits for ``max_ongoing``
    requests). Then a new replica is weighed against that
    holder by expected completion: the least loaded device and two drawn at random
    offer their drain time plus a pipelined load, plus the cold time of its least
    recently routed model when the load must evict (what is evicted is loaded again
    later, somewhere; only the first victim is priced). Loads follow
    demand, not each momentary queue: at the same loads per request as Ray's rule,
    requests wait less (``timeshare sim cluster`` measures both; the margin trades
    loads for tail latency, ``--margins`` sweeps it).

Queue lengths are not counted request by request: a device's outstanding work is its
expected drain time, and Ray's "outstanding requests" are that work in units of the
model's compute time. This is what a router can know without asking every replica.

NOTE [CPU fallback]
SwitchFlow runs an inference on the CPU when the GPU is busy and the CPU would finish it
sooner. A replica may keep a CPU runtime beside its device's (``cpu_fallback``), with
every model registered there too. Once the router has chosen a replica (and before the
model is placed there), the request runs on that replica's CPU when the device is busy
(its queue has not drained) and the request's expected end on the CPU (the CPU queue,
then the model's cold time on the CPU, measured once) is earlier than on the device (the
device queue, then its ready or cold time): a burst on a busy device spills to the CPU
instead of waiting, and a request to an idle device is never sent elsewhere. The CPU's cold time is used whether or not
the model is still in the CPU runtime's memory, so the choice leans to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from timeshare.errors import ConfigError
from timeshare.scheduler.routing_steps import (
    NO_DEVICE,
    RATE_TAU_S,
    REPLICA_SHARE,
    choose,
    drained,
    place,
    queued,
    retire,
    set_free_at,
)

__all__ = [
    "LEAST_LOADED", "NO_DEVICE", "POLICIES", "RANDOM", "RATE_TAU_S", "RAY", "REPLICA_SHARE", "TIMESHARE", "Fleet",
    "Placement", "Router", "choose", "compile_steps", "cpu_sooner", "drained", "place", "policy_code", "queued",
    "retire", "set_free_at",
]

RANDOM, LEAST_LOADED, RAY, TIMESHARE = 0, 1, 2, 3
POLICIES = {"random": RANDOM, "least-loaded": LEAST_LOADED, "ray": RAY, "timeshare": TIMESHARE}


@dataclass
class Fleet:
    """The arrays ``choose`` and ``place`` work on (NOTE [Fleet routing])."""

    size: np.ndarray  # [M] int64 bytes
    compute_s: np.ndarray  # [M] float64 seconds of one request, resident
    cold_s: np.ndarray  # [M] float64 seconds of one request that loads the model (pipelined)
    load_s: np.ndarray  # [M] float64 seconds of the load alone (what an evicted model owes)
    capacity: np.ndarray  # [D] int64 bytes of model memory
    used: np.ndarray  # [D] int64
    nmodels: np.ndarray  # [D] int32
    free_at: np.ndarray  # [D] float64 when the device's queue is expected to drain
    slot_of: np.ndarray  # [M, D] int32 slot of model m on device d, -1 if not there
    slot_model: np.ndarray  # [D, S] int32 model in the slot, -1 if free
    links: np.ndarray  # [D, S, 2] int32 each slot's neighbours (less, more recently routed), -1: none
    slot_busy: np.ndarray  # [D, S] float64 when the slot's last queued request ends
    holders: np.ndarray  # [M, D] int32 devices holding model m, first nholders[m] valid
    nholders: np.ndarray  # [M] int32
    heap: np.ndarray  # [D] int32 devices, a min-heap on free_at
    heap_pos: np.ndarray  # [D] int32 each device's index in heap
    rate: np.ndarray  # [M] float64 requests per second, decayed with RATE_TAU_S, as of rate_at
    rate_at: np.ndarray  # [M] float64
    ends: np.ndarray  # [D, 2] int32 the least and the most recently routed slot, -1: none
    free: np.ndarray  # [D, S] int32 a stack of free slots, its top at S - nmodels - 1
    holder_pos: np.ndarray  # [M, D] int32 where device d is in holders[m], -1 if not there
    max_models: int = 0  # per device, 0: no count limit (only bytes)
    max_ongoing: float = 5.0  # Ray's max_ongoing_requests
    replicate_margin: float = 4.0  # timeshare: a wait of this many cold times of the model is a burst
    max_capacity: int = 0  # the largest device its slots were sized for

    @classmethod
    def create(cls, size, compute_s, cold_s, load_s, capacity, *, max_models: int = 0,
               max_ongoing: float = 5.0, replicate_margin: float = 4.0) -> Fleet:
        size = np.asarray(size, dtype=np.int64)
        capacity = np.asarray(capacity, dtype=np.int64)
        m, d = len(size), len(capacity)
        if m == 0 or d == 0:
            raise ConfigError("a fleet needs at least one model and one device")
        if (size <= 0).any() or (capacity < 0).any() or not (capacity > 0).any():
            raise ConfigError("model sizes must be positive, device capacities non-negative, and one device "
                              "must have memory (a device of 0 bytes is one not started or gone: never chosen)")
        fits = capacity.max() // max(1, int(size.min())) + 1
        slots = int(min(fits, max_models if max_models > 0 else fits)) + 1
        fleet = cls(size, np.asarray(compute_s, np.float64), np.asarray(cold_s, np.float64),
                   np.asarray(load_s, np.float64), capacity, np.zeros(d, np.int64), np.zeros(d, np.int32),
                   np.zeros(d, np.float64), np.full((m, d), -1, np.int32), np.full((d, slots), -1, np.int32),
                   np.full((d, slots, 2), -1, np.int32), np.zeros((d, slots), np.float64),
                   np.full((m, d), -1, np.int32), np.zeros(m, np.int32), np.arange(d, dtype=np.int32),
                   np.arange(d, dtype=np.int32), np.zeros(m, np.float64), np.zeros(m, np.float64),
                   np.full((d, 2), -1, np.int32), np.tile(np.arange(slots, dtype=np.int32), (d, 1)),
                   np.full((m, d), -1, np.int32),
                   int(max_models), float(max_ongoing), float(replicate_margin), int(capacity.max()))
        for gone in np.flatnonzero(capacity == 0):  # not started: never chosen until admitted
            retire(int(gone), fleet.arrays())
        return fleet

    def params(self) -> tuple[float, float, float]:
        """The scalars the compiled functions take: max_models, max_ongoing, replicate_margin."""
        return (float(self.max_models), self.max_ongoing, self.replicate_margin)

    def arrays(self) -> tuple:
        """The arrays in the order the compiled functions take them."""
        return (self.size, self.compute_s, self.cold_s, self.load_s, self.capacity, self.used, self.nmodels,
                self.free_at, self.slot_of, self.slot_model, self.links, self.slot_busy, self.holders,
                self.nholders, self.heap, self.heap_pos, self.rate, self.rate_at, self.ends, self.free, self.holder_pos)


def policy_code(name: str) -> int:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None


class Router:
    """Routing over a ``Fleet`` from Python (a cluster's front end): the compiled steps of
    NOTE [Fleet routing] with a seeded source of the random numbers they take."""

    def __init__(self, fleet: Fleet, policy: str, *, seed: int = 0):
        self.fleet = fleet
        self.policy = policy_code(policy)
        self.rng = np.random.default_rng(seed)

    def route(self, model: int, now: float) -> Placement:
        """The device for one request of ``model`` at ``now``, made resident there."""
        return self.place(model, self.choose(model, now), now)

    def choose(self, model: int, now: float) -> int:
        """The device the policy picks for one request of ``model`` (nothing changes)."""
        f = self.fleet
        u = self.rng.random(4)
        d = choose(self.policy, model, now, u, f.params(), f.arrays())
        if d == NO_DEVICE:
            raise ConfigError(f"model {model} ({int(f.size[model])} bytes) fits on no device")
        return int(d)

    def place(self, model: int, device: int, now: float) -> Placement:
        """Make ``model`` resident on ``device`` (as ``choose`` picked it) for one request."""
        f = self.fleet
        resident, owed_s, owed_n = place(model, device, now, f.params(), f.arrays())
        return Placement(device, not resident, float(owed_s), int(owed_n))

    def cost_s(self, model: int, device: int) -> float:
        """What one request of ``model`` is expected to take on ``device``: its ready time
        if the model is resident there, else its cold time (a pipelined load)."""
        f = self.fleet
        return float(f.compute_s[model] if f.slot_of[model, device] >= 0 else f.cold_s[model])


    def retire(self, device: int) -> None:
        """The device is gone (or not started): its models are no longer resident there and
        it is never chosen until ``admit``."""
        retire(device, self.fleet.arrays())

    def admit(self, device: int, capacity: int, now: float) -> None:
        """The device (started, or replaced) takes requests, with ``capacity`` bytes, empty.
        Its slots were sized for the largest device the fleet was created with."""
        if capacity > self.fleet.max_capacity:
            raise ConfigError(f"a device of {capacity} bytes is larger than this fleet was sized for "
                              f"({self.fleet.max_capacity} bytes)")
        retire(device, self.fleet.arrays())
        self.fleet.capacity[device] = capacity
        set_free_at(device, now, self.fleet.free_at, self.fleet.heap, self.fleet.heap_pos)

    def drained(self, device: int, now: float) -> None:
        """Nothing is outstanding on the device: its queue drains now and none of its
        models is busy (the estimates made when requests were routed are dropped)."""
        drained(device, now, self.fleet.arrays())

    def queued(self, device: int, model: int, until: float) -> None:
        """A request of ``model`` was queued on ``device`` and is expected to end at
        ``until``, and with it the device's queue."""
        f = self.fleet
        queued(device, model, until, f.arrays())


def cpu_sooner(now: float, device_free_at: float, device_s: float, cpu_free_at: float, cpu_s: float) -> bool:
    """NOTE [CPU fallback]: whether a request runs on its replica's CPU: the device is
    busy (its queue drains after ``now``) and the request ends sooner on the CPU (that
    queue, then ``cpu_s``) than on the device (that queue, then ``device_s``)."""
    return device_free_at > now and max(now, cpu_free_at) + cpu_s < device_free_at + device_s


def compile_steps() -> None:
    """Compile the steps now (seconds, once per process) rather than on a first request:
    run each on a scratch fleet of two devices."""
    scratch = Fleet.create([1, 1], [0.001, 0.001], [0.002, 0.002], [0.001, 0.001], [1, 0])
    for policy in POLICIES:
        router = Router(scratch, policy)
        placed = router.route(0, 0.0)
        router.queued(placed.device, 0, 0.002)
        router.drained(placed.device, 0.003)
    router.retire(0)
    router.admit(1, 1, 0.0)


@dataclass(frozen=True)
class Placement:
    """Where a request goes: the device, whether its model loads there, and the reloads
    (seconds, count) owed to models evicted for it that still had requests queued there."""

    device: int
    loads: bool
    owed_s: float
    owed_loads: int
