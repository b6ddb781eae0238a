"""How much of the device language models' key/value caches may keep between their
turns (NOTE [Key/value caches under pressure]). Runs in the controller, called by the
engines (``engine.py``) in their turns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeshare.errors import ConfigError

if TYPE_CHECKING:
    from timeshare.llm.engine import Engine


# NOTE [Key/value caches under pressure]
# Between its turns a language model's running generations keep their key/value caches
# on the device, so that the next turn starts at once, unless the device needs the room.
# ``KVBudget(bytes)``, shared by the language models of one runtime, is how much of the
# device their caches may keep there. When a turn begins, the caches of the models that
# ran least recently move to host memory (page-locked on CUDA) until the caches on the
# device, the starting model's included, fit; when a turn ends with generations left,
# the same again, the model ending its turn moving last. They come back at their model's
# next turn, bit for bit (``_kv_back``). A model's caches never move during its own
# turn, so within a turn they may grow past the budget (up to ``max_sequences`` times
# ``max_context`` positions); the budget bounds what stays on the device between turns.
# The move is made by the engine that needs the room, in its own turn, while the other
# engine waits for one (``Engine.move_kv_out``): no engine's batch is touched by two
# threads at once. ``offload_kv`` still moves a model's caches out at every turn's end.
@dataclass(frozen=True, slots=True)
class KVBudgetSnapshot:
    """The budget (``kv_memory``), the bytes of caches on the device now, and the moves to
    host memory made to keep them within it, with their bytes."""

    capacity: int
    on_device: int
    moves: int
    moved_bytes: int


class KVBudget:
    """How many bytes the key/value caches of a runtime's language models may keep on the
    device between their turns (NOTE [Key/value caches under pressure])."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ConfigError(f"kv_memory must be a non-negative number of bytes, got {capacity!r}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._engines: list[Engine] = []
        self.moves = 0  # caches moved to host memory to make room
        self.moved_bytes = 0

    def join(self, engine: Engine) -> None:
        with self._lock:
            self._engines.append(engine)

    def leave(self, engine: Engine) -> None:
        with self._lock:
            if engine in self._engines:
                self._engines.remove(engine)

    def on_device(self) -> int:
        """The bytes of caches on the device now, all models together."""
        with self._lock:
            return sum(e.kv_device_bytes for e in self._engines)

    def snapshot(self) -> KVBudgetSnapshot:
        with self._lock:
            return KVBudgetSnapshot(capacity=self.capacity, on_device=sum(e.kv_device_bytes for e in self._engines),
                                    moves=self.moves, moved_bytes=self.moved_bytes)

    def make_room(self, holder: Engine, *, keep: bool, incoming: int = 0) -> None:
        """Called by ``holder`` in its turn: move caches out, least recent turn first,
        until those on the device fit; ``keep``: the holder's own stay (its turn begins);
        ``incoming``: the holder's bytes about to come back from host memory."""
        with self._lock:
            engines = list(self._engines)
        over = sum(e.kv_device_bytes for e in engines) + incoming - self.capacity
        if over <= 0:
            return
        others = sorted((e for e in engines if e is not holder), key=lambda e: e.last_turn)
        self._move_out(holder, others if keep else [*others, holder], over)

    def free(self, holder: Engine, nbytes: int) -> int:
        """Called by ``holder`` in its turn when the pool its pages come from has none
        left (NOTE [Paged key/value caches]): move the others' caches out, least recent
        turn first, until ``nbytes`` are free; the bytes moved."""
        with self._lock:
            others = sorted((e for e in self._engines if e is not holder), key=lambda e: e.last_turn)
        return self._move_out(holder, others, nbytes)

    def _move_out(self, holder: Engine, victims: list[Engine], want: int) -> int:
        moved_in_all = 0
        for victim in victims:
            if moved_in_all >= want:
                break
            moved = victim.move_kv_out() if victim is not holder else holder.give_up_kv()
            if moved:
                moved_in_all += moved
                with self._lock:
                    self.moves += 1
                    self.moved_bytes += moved
        return moved_in_all
