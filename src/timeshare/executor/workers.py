"""The pool's worker processes (``WorkerSet``, runs in the controller, the caller's
process): spawning them, finishing their start-up and teaching them every registered
model, watching their sentinels, and replacing the ones that fail, with a back-off for
replacements that keep dying before they are ready. It knows nothing of tasks or
training segments: the :class:`~timeshare.executor.pool.ProcessPool` runs those on the
workers it holds, and hears of each failed worker (``on_lost``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait

from timeshare import protocol as P
from timeshare.errors import WorkerCrashedError, WorkerTimeoutError
from timeshare.executor.handle import WorkerHandle, spawn_context

log = logging.getLogger(__name__)

# NOTE [Workers at exit]
# At interpreter exit multiprocessing's own exit hook terminates the workers (daemon
# children) and joins them, while the pool's watcher thread still runs: it saw each death,
# replaced the worker and closed process objects that the hook was joining ("process
# object is closed"; once, a hang). So every open worker set is closed by a hook of ours
# first (registered after multiprocessing's, when the first set starts: hooks run last
# registered first): the workers are asked to stop, and nothing is replaced after.
_open_sets: weakref.WeakSet[WorkerSet] = weakref.WeakSet()
_exit_hook = threading.Lock()
_hooked = False


def _close_open_sets() -> None:
    for workers in list(_open_sets):
        try:
            workers.close()
        except Exception:
            log.exception("closing a worker set at exit")


def _hook_exit() -> None:
    global _hooked
    with _exit_hook:
        if not _hooked:
            atexit.register(_close_open_sets)
            _hooked = True

# What went wrong with a replaced worker: it died before it was ready, stopped answering
# within its deadline, died, or broke the protocol (answered something unexpected).
FAILURE_KINDS = ("starting", "hung", "crashed", "protocol")


class WorkerSet:
    """``n`` workers, started in parallel and ready when the constructor returns.

    ``start`` makes a worker's ``Start`` message from its ``worker``, ``parent_pid`` and
    ``arena``; ``share_arena`` gives each spawned worker its own arena handle; ``on_lost``
    is called for each worker replaced, after its replacement is in the list and with no
    lock of the set's held; ``channel_bytes`` and ``channel_max_bytes``: each worker's
    tensor channel (``WorkerHandle``). Its own lock guards the worker list, which others
    read as a ``snapshot``; it calls nobody with it held."""

    def __init__(
        self,
        n: int,
        *,
        start: Callable[..., P.Start],
        share_arena: Callable[[], object],
        startup_timeout_s: float,
        on_lost: Callable[[WorkerHandle], None],
        channel_bytes: int | None = None,
        channel_max_bytes: int | None = None,
    ):
        self._ctx = spawn_context()
        # NOTE [Tensor channel]: each worker's, a replacement's included, is created with it.
        self._channel = (channel_bytes, channel_max_bytes)
        self._start = start
        # A fresh handle per spawned worker: a CUDA IPC handle carries a reference count
        # that each receiving process consumes once, so one handle must not serve two.
        self._share_arena = share_arena
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.RLock()
        self._on_lost = on_lost
        self._next_id = 0
        self._seq = 0
        self._models: dict[str, P.AddModel] = {}  # replayed on every new worker
        self._sets: dict[str, P.AddShared] = {}  # shared sets, replayed before the models (NOTE [Shared tensors])
        self.replacements = 0
        self.failures = {kind: 0 for kind in FAILURE_KINDS}  # replaced workers, by what went wrong
        self.last_failure: dict | None = None  # the latest replaced worker: which, why, when
        self._boot_failures = 0  # replacements in a row that died before they were ready (back-off)
        self._closed = False
        self.workers: list[WorkerHandle] = [self.spawn() for _ in range(n)]  # they boot in parallel
        _hook_exit()  # NOTE [Workers at exit]: after multiprocessing's hook, so it runs before it
        _open_sets.add(self)
        try:
            for w in self.workers:
                self.ready(w)
        except BaseException:
            self.close()
            raise
        # A worker that dies while idle is noticed here, not at its next task.
        self._watcher = threading.Thread(target=self._watch, name="timeshare-pool-watch", daemon=True)
        self._watcher.start()

    def snapshot(self) -> list[WorkerHandle]:
        """The workers now, the active one first: a copy a replacement cannot change."""
        with self._lock:
            return list(self.workers)

    @property
    def failing_to_start(self) -> int:
        """Replacements in a row that died before they were ready."""
        return self._boot_failures

    # ------------------------------------------------------------------ models
    def register(self, msg: P.AddModel) -> None:
        """Every worker started from now on learns the model while it starts."""
        self._models[msg.model] = msg

    def unregister(self, model: str) -> bool:
        """Whether the model was registered."""
        return self._models.pop(model, None) is not None

    def register_shared(self, msg: P.AddShared) -> None:
        self._sets[msg.sid] = msg

    def unregister_shared(self, sid: str) -> bool:
        return self._sets.pop(sid, None) is not None

    def registration(self, model: str) -> P.AddModel:
        return self._models[model]

    def teach(self, w: WorkerHandle, msg: P.AddModel) -> None:
        """Teach ``w`` one model, and first the shared sets it uses that ``w`` lacks; the
        caller holds its lease."""
        for sid in dict.fromkeys(sid for _, sid, _ in msg.shared):
            if sid not in w.taught_sets:
                self.teach_shared(w, self._sets[sid])
        w.request(replace(msg, seq=self.next_seq()), self.startup_timeout_s, f"adding {msg.model}")
        w.taught.add(msg.model)

    def teach_shared(self, w: WorkerHandle, msg: P.AddShared) -> None:
        w.request(replace(msg, seq=self.next_seq()), self.startup_timeout_s, f"adding {msg.sid}")
        w.taught_sets.add(msg.sid)

    def next_seq(self) -> int:
        """A fresh request number (NOTE [One owner per pipe])."""
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ lifecycle
    def spawn(self) -> WorkerHandle:
        """Start a worker process (not added to the set)."""
        start = self._start(worker=self._next_id, parent_pid=os.getpid(), arena=self._share_arena(),
                            environ=tuple(os.environ.items()))  # NOTE [Fork server]
        self._next_id += 1
        return WorkerHandle(self._ctx, start, *self._channel)

    def ready(self, w: WorkerHandle) -> None:
        """Finish a worker's start-up and teach it every model (new workers only)."""
        if w.ready:
            return
        with w.leased(self.startup_timeout_s, "starting"):  # the lease also serializes teaching
            if w.ready:
                return
            try:
                w.wait_ready(self.startup_timeout_s)  # a worker that dies before its Hello is replaced too
                for msg in list(self._models.values()):
                    self.teach(w, msg)
            except BaseException as exc:
                self.replace(w, exc)  # half taught: start over with a fresh one
                raise
            w.ready = True

    def replace(self, w: WorkerHandle, cause: BaseException | str) -> None:
        """Drop a failed worker: a standby becomes active; a new one boots behind it. The
        training jobs it held lose their state (``on_lost``). ``cause`` (what its user
        saw) is kept for the pool's health."""
        with self._lock:
            if self._closed:
                return  # close() stops every worker
            hung = isinstance(cause, WorkerTimeoutError)  # its reader killed it already
            w.kill()
            if w not in self.workers:
                return  # replaced already
            if not w.ready:
                self._boot_failures += 1
            kind = "starting" if not w.ready else "hung" if hung else "crashed" if not w.alive() or \
                isinstance(cause, WorkerCrashedError) else "protocol"
            self.failures[kind] += 1
            self.last_failure = {"worker": w.id, "kind": kind, "cause": str(cause), "at": time.time()}
            new = self.spawn()
            self.workers[self.workers.index(w)] = new  # in place: homes are never the first worker
            self.replacements += 1
            delay = min(30.0, 0.25 * (2 ** self._boot_failures - 1))
        self._on_lost(w)
        log.warning("worker %d replaced by worker %d%s", w.id, new.id,
                    f" ({self._boot_failures} in a row died starting; teaching it in {delay:g} s)" if delay else "")
        # The pool heals by itself: the new worker learns every model now, not at its first task.
        threading.Thread(target=self._teach, args=(new, delay), name=f"timeshare-teach-{new.id}", daemon=True).start()

    def _watch(self) -> None:
        """Replace workers that die while nobody talks to them. One that a thread holds the
        lease of is left to that thread, which sees the death on its pipe."""
        while True:
            with self._lock:
                if self._closed:
                    return
                workers = [w for w in self.workers if w.alive()]
                dead = [w for w in self.workers if w not in workers]
            sentinels = {}
            for w in workers:
                try:
                    sentinels[w.proc.sentinel] = w
                except ValueError:  # released meanwhile
                    continue
            if not sentinels:
                time.sleep(0.5)
                continue
            try:
                ended = wait(list(sentinels), timeout=0.5)
            except (OSError, ValueError):  # a sentinel was closed meanwhile (a replacement): look again
                continue
            for w in dead + [sentinels[x] for x in ended]:
                if w.try_lease():
                    w.unlease()
                    self.replace(w, f"worker {w.id} {w.exit_description()} while idle")

    def _teach(self, w: WorkerHandle, delay_s: float) -> None:
        if delay_s:
            time.sleep(delay_s)  # back off from replacements that keep dying
        try:
            self.ready(w)
        except Exception as exc:  # ready() replaced it already; that replacement teaches itself
            log.warning("worker %d failed while starting: %s", w.id, exc)
            return
        with self._lock:
            self._boot_failures = 0

    def close(self) -> None:
        """Stop every worker (escalating, see ``WorkerHandle.stop``); nothing is replaced after."""
        with self._lock:
            self._closed = True
            workers, self.workers = self.workers, []
        _open_sets.discard(self)
        for w in workers:
            w.stop()
