"""Resident models in the simulated device memory: a byte budget (or a model count, as
Ray Serve's multiplexing rule), an eviction policy by name and thrashing control. Runs
in the simulator's process.
"""

from __future__ import annotations

from timeshare.errors import ConfigError, ModelTooLargeError
from timeshare.scheduler.eviction import make_eviction_policy
from timeshare.scheduler.thrashing import NothingToEvict, ThrashingDetector, make_room


class ModelCache:
    """``capacity`` bytes or ``max_models`` models (Ray Serve: LRU by count, sizes
    ignored); ``policy`` an eviction policy name; ``detector`` a thrashing detector that
    keeps hot models resident while the device thrashes."""

    def __init__(self, *, capacity: int | None = None, max_models: int | None = None, policy: str = "lru",
                 detector: ThrashingDetector | None = None, **options):
        if (capacity is None) == (max_models is None):
            raise ConfigError("a model cache needs exactly one of capacity (bytes) and max_models")
        self.capacity = capacity
        self.max_models = max_models
        self.policy = make_eviction_policy(policy, **options)
        self.detector = detector
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.loads = 0
        self.evictions = 0

    def __contains__(self, model: str) -> bool:
        return model in self.sizes

    def acquire(self, model: str, nbytes: int, reload_s: float, now: float, in_use=()) -> bool:
        """Make ``model`` resident; True if it had to be loaded. ``in_use``: models a
        running task holds, never evicted."""
        if model in self.sizes:
            self.policy.touched(model, now)
            return False
        if self.capacity is not None and nbytes > self.capacity:
            raise ModelTooLargeError(model, nbytes, self.capacity)
        try:
            make_room(self.policy, self.detector, now, set(in_use), lambda: True if self._fits(nbytes) else None,
                      self._evict)
        except NothingToEvict:
            raise ConfigError(f"cannot make room for {model}: every resident model is in use") from None
        self.sizes[model] = nbytes
        self.used += nbytes
        self.loads += 1
        self.policy.admitted(model, now, reload_s=reload_s)
        self.policy.touched(model, now)
        return True

    def _fits(self, nbytes: int) -> bool:
        if self.max_models is not None:
            return len(self.sizes) < self.max_models
        assert self.capacity is not None, "__init__ sets exactly one of capacity and max_models"
        return self.used + nbytes <= self.capacity

    def _evict(self, model: str) -> None:
        self.used -= self.sizes.pop(model)
        self.policy.removed(model)
        self.evictions += 1
