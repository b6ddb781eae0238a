"""The scheduler: a pure step function. Runs in the controller (the runtime's dispatcher)
and in the simulator, unchanged.

    scheduler.submit(task, now)
    decisions = scheduler.schedule(now)   # Run / Preempt
    ... the executor carries them out ...
    scheduler.update([Finished(...), Stopped(...), Progress(...)])

No I/O, no sleeping, no clock of its own: every call takes ``now``. The executor
calls ``schedule`` again after each arrival and each result, and at
``next_wakeup(now)`` when time slices are in use. This module admits tasks (Salus's
lanes, NOTE [Admission order]), starts and batches them and takes results back; which
running task to stop for a waiting one is ``preemption.py``'s choice.

# NOTE [Scheduler slots]
At most ``slots`` tasks run at once (1 by default: the device is time-shared; PACK:
as many as memory lanes allow). A preempted task gives its slot up when it is told to
stop, not when it has stopped, so the next task starts at once and the executor
overlaps the two (NOTE [Switch protocol]); its memory lane stays busy until it reports
``Stopped``. Only one preemption is outstanding at a time.
"""

from __future__ import annotations

import math
from collections import deque
from heapq import heappop, heappush

from timeshare.errors import ConfigError, MemoryBudgetError
from timeshare.scheduler.lanes import LaneManager
from timeshare.scheduler.policies import Policy, make_policy
from timeshare.scheduler.preemption import choose_victim
from timeshare.scheduler.task import (
    Decision,
    Failed,
    Finished,
    Kind,
    Preempt,
    Progress,
    Result,
    Run,
    State,
    Stopped,
    Task,
)
from timeshare.units import format_bytes

_ASIDE = 64
_WAITING = State.WAITING
_RUNNING = State.RUNNING
_STOPPING = State.STOPPING


def _lane(t: Task) -> int:
    """The lane of an admitted task: set when it is admitted, kept until it leaves."""
    assert t.lane is not None, f"task {t.id} is admitted but has no lane"
    return t.lane


class Scheduler:
    """Orders tasks by ``policy`` (a name or a :class:`Policy`), admits them under
    Salus's memory model when ``capacity`` (bytes) is given, preempts at preemption
    points, and batches waiting requests of one model up to ``max_batch``.

    ``quantum_s``: the time slice after which a running training task yields to
    waiting ones (FIFO time-slicing, FAIR); default: the policy's own (FAIR: 1 s).
    ``slots``: tasks that may run at once (NOTE [Scheduler slots]).
    """

    def __init__(
        self,
        policy: str | Policy = "fifo",
        *,
        capacity: int | None = None,
        slots: int | None = None,
        quantum_s: float | None = None,
        max_batch: int = 1,
    ):
        self.policy = make_policy(policy)
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"capacity must be a positive number of bytes, got {capacity}")
        if slots is not None and slots < 1:
            raise ConfigError(f"slots must be at least 1, got {slots}")
        if quantum_s is not None and quantum_s <= 0:
            raise ConfigError(f"quantum_s must be positive, got {quantum_s}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        self.lanes = LaneManager(capacity) if capacity is not None else None
        self.slots = slots if slots is not None else (math.inf if self.policy.packs else 1)
        # Tasks of different lanes run together (PACK with a memory model).
        self.packs = self.lanes is not None and self.policy.packs
        self.quantum_s = quantum_s if quantum_s is not None else self.policy.default_quantum_s
        self.max_batch = max_batch
        self.batch_factor = 1.0  # raised by the executor while it thrashes
        self.tasks: dict[int, Task] = {}
        self.running: dict[int, Task] = {}
        self.stopping: dict[int, Task] = {}
        self.preemptions = 0
        self._heap: list[tuple] = []  # waiting, not admitted: NOTE [Admission order]
        self._admitted: list[tuple] = []  # waiting, admitted (memory model only)
        self._waiting = 0
        self._seq = 0
        self._by_model: dict[str, deque[Task]] = {}  # waiting requests per model, for batching

    # ------------------------------------------------------------------ inputs
    def submit(self, task: Task, now: float) -> Task:
        """Queue a new task. A task that could never fit the device is refused."""
        if task.id in self.tasks:
            raise ConfigError(f"task id {task.id} is already scheduled")
        if self.lanes is not None and not self.lanes.fits_alone(task.persistent, task.ephemeral):
            raise MemoryBudgetError(
                f"task {task.id} ({task.kind.value} {task.model}) needs {format_bytes(task.persistent)} persistent "
                f"+ {format_bytes(task.ephemeral)} ephemeral memory; the device has {format_bytes(self.lanes.capacity)}"
            )
        self._seq += 1
        task.seq = self._seq
        task.state = _WAITING
        task.ready_at = now
        self.tasks[task.id] = task
        self._enqueue(task)
        return task

    def update(self, results) -> None:
        """Take results back from the executor (a single result or an iterable)."""
        if isinstance(results, (Finished, Stopped, Progress, Failed)):
            results = (results,)
        for r in results:
            self._apply(r)

    def hold(self, task_id: int) -> None:
        """Take a waiting task out of the queue (a paused job) without losing its progress."""
        t = self.tasks[task_id]
        if t.state is not _WAITING:
            raise ConfigError(f"task {task_id} is {t.state.value}; only a waiting task can be held")
        t.state = State.HELD
        self._waiting -= 1

    def release(self, task_id: int, now: float) -> None:
        """Put a held task back in the queue."""
        t = self.tasks[task_id]
        if t.state is State.HELD:
            t.state = _WAITING
            t.ready_at = now
            self._enqueue(t)

    def withdraw(self, task_id: int) -> None:
        """Forget a task that is not running (a cancelled job, an abandoned request)."""
        t = self.tasks.get(task_id)
        if t is None:
            return
        if t.state in (_RUNNING, _STOPPING):
            raise ConfigError(f"task {task_id} is {t.state.value}; report it stopped or finished first")
        if t.state is _WAITING:
            self._waiting -= 1
        t.state = State.FAILED
        self._leave(t)

    # ------------------------------------------------------------------ the step
    def schedule(self, now: float) -> list[Decision]:
        """What to start and what to preempt now."""
        decisions: list[Decision] = []
        if self._waiting:
            if len(self.running) >= self.slots and not any(t.preemptible for t in self.running.values()):
                return decisions  # no slot free, and nothing running may be stopped for one
            self._start(now, decisions)
            if self._waiting and not self.stopping and (self.policy.preemptive or self.quantum_s or self.packs):
                if self._preempt(now, decisions):
                    self._start(now, decisions)
        return decisions

    def next_wakeup(self, now: float) -> float | None:
        """When ``schedule`` must run again if nothing else happens: the end of a time
        slice while others wait. None: only arrivals and results matter."""
        if not self.quantum_s or not self._waiting:
            return None
        q = self.quantum_s
        ends = []
        for t in self.running.values():
            if t.state is _RUNNING and t.preemptible and t.segment_start is not None:
                # The next slice boundary strictly after now: a slice that ended without
                # a preemption (nobody better waited) is looked at again one slice later.
                slices = max(1, math.floor((now - t.segment_start) / q) + 1)
                end = t.segment_start + slices * q
                ends.append(end if end > now else end + q)  # rounding
        return min(ends) if ends else None

    @property
    def waiting(self) -> int:
        return self._waiting

    def expedite(self, task_id: int, deadline: float) -> bool:
        """Bring a waiting task's deadline forward to ``deadline`` (a language model's
        turn that was queued to decode, and now has a request waiting for its first
        token). False if the task is not waiting or is already due as early."""
        t = self.tasks.get(task_id)
        if t is None or t.state is not _WAITING or (t.deadline is not None and t.deadline <= deadline):
            return False
        t.deadline = deadline
        t.qver += 1  # the old heap entry goes stale; the task keeps its place in the count
        heap = self._admitted if self.lanes is not None and self.lanes.admitted(t.id) else self._heap
        heappush(heap, (self.policy.key(t), t.qver, t))
        return True

    def most_urgent_waiting(self) -> Task | None:
        """The waiting task the policy would start first (None: nobody waits). A task that
        holds the device for a series of steps (a language model's decoding) asks this at
        each step to know whether to give it up."""
        if not self._waiting:
            return None
        waiting = [t for t in self.tasks.values() if t.state is _WAITING]
        return min(waiting, key=self.policy.key, default=None)

    # ------------------------------------------------------------------ internals
    def _enqueue(self, t: Task) -> None:
        self._waiting += 1
        t.qver += 1
        # Keys end with the unique seq, so the version and the task are never compared.
        heap = self._admitted if self.lanes is not None and self.lanes.admitted(t.id) else self._heap
        heappush(heap, (self.policy.key(t), t.qver, t))
        if self.max_batch > 1 and t.kind is Kind.INFERENCE:
            self._by_model.setdefault(t.model, deque()).append(t)

    @staticmethod
    def _peek(heap: list) -> Task | None:
        """The heap's best current entry; stale ones (started with a batch, held,
        withdrawn, re-queued) are dropped on the way."""
        while heap:
            _, ver, t = heap[0]
            if t.state is _WAITING and ver == t.qver:
                return t
            heappop(heap)
        return None

    def _admissible(self, t: Task) -> bool:
        return self.lanes is None or self.lanes.choose(t.persistent, t.ephemeral) is not None

    def _startable(self, t: Task) -> bool:
        """Whether an admissible task may be admitted now: a request under PACK only to a
        lane it can run in at once (NOTE [Requests wait in arrival order])."""
        if not self.packs or t.kind is not Kind.INFERENCE:
            return True
        assert self.lanes is not None
        choice = self.lanes.choose(t.persistent, t.ephemeral)
        if choice is None or choice[1] is None:
            return choice is not None
        return self.lanes.lanes[choice[1]].busy is None

    # NOTE [Admission order]: tasks not yet admitted wait in one heap, admitted ones
    # (they hold persistent memory and a lane) in another. Only the best task of the
    # first heap is tried for admission: if Algorithm 1 says it must wait, the ones
    # behind it wait too (no overtaking for memory, and a decision stays O(log n)).
    # Admitted tasks whose lane is busy are stepped over, at most _ASIDE of them.
    #
    # NOTE [Requests wait in arrival order]: with PACK, a request (one inference) is
    # admitted only when it can start at once: where Algorithm 1 would put it in a busy
    # lane (to join or grow it), it stays first in the queue of tasks not admitted, and
    # the ones behind it wait too. Admitted to a busy lane, it would wait for that one
    # lane while later requests took the lanes that free up: a closed-loop client whose
    # request joined a lane fell behind for good (one got 7 requests, another 1,798).
    # Waiting unadmitted, it takes the first lane or memory that frees, before anyone
    # behind it. A training job still joins a busy lane (jobs of one lane take turns
    # in it, NOTE [Salus lanes]), and a request bound for a job's lane still makes the
    # job yield (``preemption.lane_holder``).
    def _take(self) -> Task | None:
        """Pop the best task that can start now (admitting it if needed), or None."""
        aside: list[tuple] = []
        a = None
        if self.lanes is not None:
            lanes = self.lanes.lanes
            while len(aside) < _ASIDE:
                a = self._peek(self._admitted)
                if a is None or lanes[_lane(a)].busy is None:
                    break
                aside.append(heappop(self._admitted))
                a = None
        n = self._peek(self._heap)
        if n is not None and not (self._admissible(n) and self._startable(n)):
            n = None
        if a is not None and (n is None or self.policy.key(a) < self.policy.key(n)):
            heappop(self._admitted)  # ``a`` is the top until the stepped-over ones go back
        else:
            a = None
        for entry in aside:
            heappush(self._admitted, entry)
        if a is not None:
            return a
        if n is None:
            return None
        entry = heappop(self._heap)
        if self.lanes is not None:
            lane = self.lanes.admit(n.id, n.persistent, n.ephemeral)
            assert lane is not None, "admit refused a task that _admissible accepted"
            n.lane = lane
            if self.lanes.lanes[lane].busy is not None:  # joined a busy lane: admitted, waits its turn
                heappush(self._admitted, entry)
                return self._take()
        return n

    def _best_startable(self) -> Task | None:
        """The best waiting task that could start once a running task stops: preempting
        for one that memory cannot admit would only let a worse one in."""
        n = self._peek(self._heap)
        if n is not None and not self._admissible(n):
            n = None
        a = None
        if self.lanes is not None:
            a = self._peek(self._admitted)
            if a is not None:
                busy = self.lanes.lanes[_lane(a)].busy
                if busy is not None and busy not in self.running:
                    a = None  # its lane is held by a task already stopping
        if a is None or n is None:
            return a or n
        return a if self.policy.key(a) < self.policy.key(n) else n

    def _start(self, now: float, decisions: list) -> None:
        lanes = self.lanes
        while len(self.running) < self.slots:
            t = self._take()
            if t is None:
                break
            if lanes is not None:
                lanes.lanes[_lane(t)].busy = t.id
            self._waiting -= 1
            self._run(t, now, t.lane)
            if self.max_batch > 1 and t.kind is Kind.INFERENCE:
                self._gather(t, now)
            decisions.append(Run(t, t.lane))

    def _run(self, t: Task, now: float, lane: int | None) -> None:
        t.state = _RUNNING
        t.lane = lane
        t.segment_start = t.mark = now
        if t.started_at is None:
            t.started_at = now
        t.batch = ()
        self.running[t.id] = t

    def _gather(self, head: Task, now: float) -> None:
        """Start waiting requests of the head's model with it, in arrival order."""
        queue = self._by_model.get(head.model)
        limit = max(1, int(self.max_batch * self.batch_factor)) - 1
        if not queue or limit <= 0:
            return
        batch: list[Task] = []
        while queue and len(batch) < limit:
            t = queue.popleft()
            if t.state is not _WAITING or t is head:
                continue
            self._waiting -= 1
            t.state = _RUNNING
            t.segment_start = t.mark = now
            t.started_at = now
            batch.append(t)
        if not queue:
            del self._by_model[head.model]
        head.batch = tuple(batch)

    def _preempt(self, now: float, decisions: list) -> bool:
        """Preempt one running task if the policy says so; True if it did."""
        # Nothing preemptible running (requests only: PACK steps here at every change)
        # ends it before the best waiting task is looked for.
        candidates = [t for t in self.running.values() if t.state is _RUNNING and t.preemptible]
        if not candidates:
            return False
        best = self._best_startable()
        if best is None and not (self.lanes is not None and self.slots == math.inf):
            return False
        victim = choose_victim(self, best, candidates, now)
        if victim is None:
            return False
        victim.state = _STOPPING
        del self.running[victim.id]
        self.stopping[victim.id] = victim
        victim.preemptions += 1
        self.preemptions += 1
        decisions.append(Preempt(victim, best))
        return True

    def _account(self, t: Task, at: float) -> None:
        if t.mark is not None:
            t.service += max(0.0, at - t.mark)
            t.mark = at

    def _apply(self, r: Result) -> None:
        t = self.tasks.get(r.task_id)
        if t is None:
            raise ConfigError(f"result for unknown task {r.task_id}: {r!r}")
        if isinstance(r, Progress):
            if t.state in (_RUNNING, _STOPPING):
                self._account(t, r.at)
                t.done = r.done
                if r.unit_s is not None:
                    t.unit_s = r.unit_s
            return
        if t.state not in (_RUNNING, _STOPPING):
            raise ConfigError(f"task {t.id} is {t.state.value}; it cannot have {type(r).__name__.lower()}")
        self._account(t, r.at)
        t.mark = None
        self.running.pop(t.id, None)
        self.stopping.pop(t.id, None)
        if isinstance(r, Stopped):
            t.done = r.done
            t.segment_start = None
            if self.lanes is not None and t.lane is not None:
                self.lanes.idle(t.lane)
            t.state = _WAITING
            t.ready_at = r.at
            self._enqueue(t)
            return
        if isinstance(r, Finished):
            t.done = t.work if math.isfinite(t.work) else t.done
            t.state = State.FINISHED
        elif isinstance(r, Failed):
            t.state = State.FAILED
        else:
            raise ConfigError(f"unknown result {r!r}")
        t.finished_at = r.at
        self._leave(t)

    def _leave(self, t: Task) -> None:
        del self.tasks[t.id]
        if self.lanes is not None and self.lanes.admitted(t.id):
            self.lanes.release(t.id)
