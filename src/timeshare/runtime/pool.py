"""The controller's pool of worker processes: start-up, model registration on every
worker, task dispatch with deadlines, and replacement of failed workers. Runs in the
controller (the caller's process).

One worker is active and runs tasks; the others are standbys, fully initialized, that
take over at once when the active one fails, while a replacement boots behind them.
"""

from __future__ import annotations

import logging
import os

from timeshare import protocol as P
from timeshare.errors import WorkerError, WorkerTimeoutError
from timeshare.worker.proc import WorkerHandle, spawn_context

log = logging.getLogger(__name__)


class ProcessPool:
    def __init__(
        self,
        n: int,
        *,
        device: str,
        arena_name: str,
        arena_capacity: int,
        profile_repeats: int,
        fixed_group_bytes: int,
        load_timeout_s: float,
        task_timeout_s: float,
        startup_timeout_s: float,
    ):
        self._ctx = spawn_context()
        self._template = dict(device=device, arena_name=arena_name, arena_capacity=arena_capacity,
                              profile_repeats=profile_repeats, fixed_group_bytes=fixed_group_bytes,
                              load_timeout_s=load_timeout_s)
        self.task_timeout_s = task_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._next_id = 0
        self._seq = 0
        self._models: dict[str, P.AddModel] = {}  # replayed on every new worker
        self.replacements = 0
        self.workers: list[WorkerHandle] = [self._spawn() for _ in range(n)]  # they boot in parallel
        try:
            for w in self.workers:
                w.wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ models
    def add(self, msg: P.AddModel) -> None:
        """Teach every worker the model; a failure on any is a registration error."""
        self._models[msg.model] = msg
        try:
            for w in self.workers:
                self._ready(w)
                w.request(self._renumber(msg), self.startup_timeout_s, f"adding {msg.model}")
        except BaseException:
            self.remove(msg.model)
            raise

    def remove(self, model: str) -> None:
        if self._models.pop(model, None) is None:
            return
        for w in list(self.workers):
            try:
                self._ready(w)
                w.request(P.RemoveModel(self._next_seq(), model), self.startup_timeout_s, f"removing {model}")
            except WorkerError as exc:
                log.warning("removing %s: %s", model, exc)
                self._replace(w)

    # ------------------------------------------------------------------ tasks
    def run(self, model: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str):
        msg = P.Run(self._next_seq(), model, offset, resident, args, kwargs, strategy)
        return self._task(msg, f"running {model}").value

    def profile(self, model: str, offset: int, args: tuple, kwargs: dict):
        msg = P.Profile(self._next_seq(), model, offset, args, kwargs)
        return self._task(msg, f"profiling {model}").value

    def release(self, model: str) -> None:
        """Nothing to wait for: a worker finishes every copy before it answers a task."""
        return None

    def _task(self, msg, what: str):
        w = self.workers[0]  # the active worker
        self._ready(w)
        try:
            return w.request(msg, self.task_timeout_s, what)
        except WorkerError as exc:
            if not w.alive() or isinstance(exc, WorkerTimeoutError):
                self._replace(w)
            raise

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> WorkerHandle:
        start = P.Start(worker=self._next_id, parent_pid=os.getpid(), **self._template)
        self._next_id += 1
        return WorkerHandle(self._ctx, start)

    def _ready(self, w: WorkerHandle) -> None:
        """Finish a worker's start-up and teach it every model (new workers only)."""
        if w.ready:
            return
        w.wait_ready(self.startup_timeout_s)
        for msg in self._models.values():
            w.request(self._renumber(msg), self.startup_timeout_s, f"adding {msg.model}")

    def _replace(self, w: WorkerHandle) -> None:
        """Drop a failed worker: a standby becomes active; a new one boots behind it."""
        w.kill()
        i = self.workers.index(w)
        self.workers.pop(i)
        self.workers.append(self._spawn())
        self.replacements += 1
        log.warning("worker %d replaced by worker %d", w.id, self.workers[-1].id)

    def _renumber(self, msg: P.AddModel) -> P.AddModel:
        return P.AddModel(self._next_seq(), msg.model, msg.builder, msg.entries, msg.store_name,
                          msg.store_nbytes, msg.order)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def pids(self) -> list[int]:
        return [w.os_pid for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
