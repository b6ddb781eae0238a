"""Which resident model to evict when a new one needs room. Pure logic, no torch.

A policy sees events (a model became resident, was used, left) and, asked for
victims, returns resident models in the order they should go. Pinned models and
models with work in flight are excluded by the caller through ``protected``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from timeshare.errors import ConfigError


class EvictionPolicy:
    """Interface of an eviction policy."""

    name = "base"

    def admitted(self, model: str) -> None:
        raise NotImplementedError

    def touched(self, model: str) -> None:
        raise NotImplementedError

    def removed(self, model: str) -> None:
        raise NotImplementedError

    def candidates(self, protected: Iterable[str] = ()) -> list[str]:
        """Resident, unprotected models, the first to evict first."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def admitted(self, model: str) -> None:
        self._order[model] = None
        self._order.move_to_end(model)

    def touched(self, model: str) -> None:
        if model in self._order:
            self._order.move_to_end(model)

    def removed(self, model: str) -> None:
        self._order.pop(model, None)

    def candidates(self, protected: Iterable[str] = ()) -> list[str]:
        keep = set(protected)
        return [m for m in self._order if m not in keep]


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Create a policy by name; unknown names are rejected with the list of known ones."""
    try:
        return _POLICIES[name.lower()]()
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(_POLICIES)}") from None
