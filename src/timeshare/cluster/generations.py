"""A cluster's generations of language models: which replica generates (for an adapter,
the one that generated for it last while it has room, its slot likely still holding it;
else the one that generated for the model last while it has room; else the least busy),
the stream of a generation's events, and its cancellation (NOTE [Language models on a
cluster] and [Adapters on a cluster] in ``cluster/llm.py``). Runs in the front end's
process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from timeshare.cluster.actors import GENERATE, OBSERVE
from timeshare.cluster.replicas import ReplicaLostError, ReplicaSet
from timeshare.errors import Overloaded, Timeout, UnknownModelError
from timeshare.llm.model import LLMDef

# The adapters whose last replica is remembered: past this many (a resolver serves any
# name it finds), the least recently routed is forgotten, its slot likely reused since.
ADAPTER_HOMES = 4096


def generations_per_replica(llms: Sequence[LLMDef]) -> int:
    """A replica's generations at once, each holding a thread of its actor's "generate"
    group: as many as its language models decode together."""
    return max(1, sum(spec.max_sequences for spec in llms))


class Generations:
    """The generations of ``llms`` on ``replicas``, and how many run where."""

    def __init__(self, replicas: ReplicaSet, llms: Sequence[LLMDef]):
        self.replicas = replicas
        self.max_sequences = {spec.name: spec.max_sequences for spec in llms}  # NOTE [Language models on a cluster]
        self._llm_home: dict[str, int] = {}  # language model -> the replica that generated for it last
        # (model, adapter) -> the replica that generated for it last, least recently routed first
        self._adapter_home: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._generating: dict[tuple[int, str], int] = {}  # (replica, model) -> generations in flight
        self.per_replica = generations_per_replica(llms)

    def generate(self, model: str, prompt: list[int], params: Any, gen_id: str,
                 adapter: str | None = None) -> tuple[int, Any, Callable]:
        """Start a generation of language model ``model`` (NOTE [Language models on a
        cluster]): the replica's slot, the stream of its events (each a Ray object
        reference), and what ends its count in flight."""
        most = self.max_sequences.get(model)
        if most is None:
            raise UnknownModelError(f"no language model named {model!r}; known: {sorted(self.max_sequences)}")
        replicas = self.replicas
        with replicas.lock:
            live = [i for i, s in enumerate(replicas.slots) if s.alive and s.actor is not None]
            if not live:
                raise ReplicaLostError(f"generation for {model!r}: no replica is alive")

            def load(i: int) -> int:
                return sum(n for (j, _), n in self._generating.items() if j == i)

            def room(i: int | None) -> bool:
                return i in live and self._generating.get((i, model), 0) < most \
                    and load(i) < self.per_replica

            homes = ([self._adapter_home.get((model, adapter))] if adapter is not None else []) \
                + [self._llm_home.get(model)]
            home = next((i for i in homes if room(i)), None)
            if home is None:
                home = min(live, key=load)
            if load(home) >= self.per_replica:
                raise Overloaded(f"every replica generates {self.per_replica} sequences already", 1)
            self._llm_home[model] = home
            if adapter is not None:
                self._adapter_home[(model, adapter)] = home
                self._adapter_home.move_to_end((model, adapter))
                while len(self._adapter_home) > ADAPTER_HOMES:
                    self._adapter_home.popitem(last=False)
            key = (home, model)
            self._generating[key] = self._generating.get(key, 0) + 1
            actor = replicas.slots[home].actor
        done = threading.Event()

        def finished() -> None:
            if not done.is_set():
                done.set()
                with replicas.lock:
                    self._generating[key] -= 1

        try:
            stream = actor.generate.options(num_returns="streaming", concurrency_group=GENERATE).remote(
                model, prompt, params, gen_id, replicas.call_timeout_s, adapter)
        except BaseException:
            finished()
            raise
        return home, stream, finished

    def forget(self, model: str, adapter: str) -> None:
        """``adapter`` of ``model`` was loaded again or unloaded: no replica is its home."""
        with self.replicas.lock:
            self._adapter_home.pop((model, adapter), None)

    def events(self, stream: Any, timeout_s: float):
        """The events of a generation's stream, each waited for at most ``timeout_s``
        (then ``Timeout``); the replica's own error as raised there."""
        ray = self.replicas.ray
        while True:
            ready, _ = ray.wait([stream], timeout=timeout_s)
            if not ready:
                raise Timeout(f"no token within {timeout_s:g} s (cluster.call_timeout_s)")
            try:
                ref = next(stream)
            except StopIteration:
                return
            try:
                yield ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else None
                if cause is None:
                    raise
                raise cause from None

    def died(self, exc: BaseException) -> bool:
        """Whether ``exc`` says a replica's actor died."""
        return isinstance(exc, self.replicas.ray.exceptions.RayActorError)

    def cancel(self, i: int, gen_id: str) -> None:
        slot = self.replicas.slots[i]
        if slot.alive and slot.actor is not None:
            slot.actor.cancel_generation.options(concurrency_group=OBSERVE).remote(gen_id)  # not waited for
