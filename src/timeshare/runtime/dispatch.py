"""The runtime's dispatcher: the scheduler (``timeshare.scheduler``) driven by real
threads and the monotonic clock. Runs in the controller (the caller's process).

Every call that needs the runtime (an inference, a profile, statistics, an eviction)
and every training job is a scheduler task. A caller submits its task and waits until
the scheduler's decision runs it; a training job asks at each preemption point whether
it must stop (NOTE [Preemption points]); Preempt decisions for a job in a worker
process are sent at once (NOTE [Switch protocol]). Policies, by name: "priority"
(default: latency-critical calls preempt best-effort training at its next iteration
boundary), "fifo" with ``time_slice_s`` (FIFO time-slicing: a call waits until the
training job's slice ends), "fair", "srtf", "edf", "pack".
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from timeshare.errors import ConfigError
from timeshare.memory.ephemeral import LaneBound, job_lane_sizes
from timeshare.protocol import CallTimings
from timeshare.runtime.turns import Grant, Preemptible, Switch, Ticket
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.lanes import LanesView
from timeshare.scheduler.task import Finished, Kind, Preempt, Priority, Progress, State, Stopped, Task

log = logging.getLogger(__name__)

# A waiter's deadline when the scheduler asks for no wake-up: it is woken by whoever starts
# its task (NOTE [Hand-offs]), so waking at this deadline means a wake-up was lost.
_SAFETY_S = 5.0
KEEP_SWITCHES = 1000  # switch records kept, the latest
# With lanes, how long a job's segment keeps a home that another job shares and waits
# for before the dispatcher stops it (``share_home``).
SHARE_S = 0.2


class Dispatcher:
    """``lane_memory``: with "pack", the bytes for lanes of ephemeral memory (NOTE [Salus
    lanes]): tasks of different lanes run at the same time, at most ``slots`` (None: as
    many as lanes allow; with workers, one per worker). Other policies run one task at a
    time and take no lanes."""

    def __init__(self, policy: str = "priority", *, time_slice_s: float | None = None,
                 lane_memory: int | None = None, slots: int | None = None, lane_threads: int = 1,
                 clock=time.monotonic):
        self.packs = policy == "pack"
        self.lane_threads = lane_threads  # CPU cores of each lane's forward or iteration
        if self.packs:
            if lane_memory is None or lane_memory <= 0:
                raise ConfigError("scheduling 'pack' needs lane_memory: the bytes for ephemeral memory")
            self.scheduler = Scheduler(policy, capacity=lane_memory, quantum_s=time_slice_s, slots=slots)
        else:
            self.scheduler = Scheduler(policy, quantum_s=time_slice_s, slots=1)
        self.clock = clock
        self._lock = threading.Lock()
        self._held: _Hold | None = None  # NOTE [Uncontended calls]: the call holding the device without a task
        self._wakers: dict[int, _Waiter] = {}  # NOTE [Hand-offs]: task id -> its waiting thread's lock
        self._shrinking: dict[int, Task] = {}  # waiting tasks whose ask shrinks (NOTE [Asks that shrink])
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._jobs: dict[int, Preemptible] = {}  # task id -> its job
        self._job_tasks: dict[Preemptible, Task] = {}  # a job -> its task
        self._sized: set[Preemptible] = set()  # jobs re-admitted with their measured memory (lanes)
        self._resizing: dict[Preemptible, tuple[int, int]] = {}  # ... once stopped: (persistent, lane) bytes
        self._outbox: list[Preemptible] = []  # stops decided, not yet sent
        # NOTE [Switch records]: jobs told to stop that have not reported their stop, each
        # with the record of the switch to the inference it makes way for, once known.
        self._awaiting: dict[Preemptible, Switch | None] = {}
        self._switches: dict[int, Switch] = {}  # an inference's task id -> the switch made for it
        self._switch_log: list[Switch] = []  # the latest records, oldest first
        self._user: tuple[Kind, str] | None = None  # the last non-control task given the device
        self._previous: dict[int, tuple[Kind, str] | None] = {}  # task id -> the user before it

    # NOTE [Hand-offs]
    # A call that must wait sleeps on a lock of its own (``_wakers``, taken locked, one per
    # waiting task), and only the thread that starts its task releases it, handing over the
    # call's turn with it, so that the woken call takes no lock of the dispatcher's: the scheduler's
    # step runs once per change of state (an arrival, a call's end, a job's progress, a
    # stop, a deadline brought forward), in the thread that made the change, and wakes
    # exactly the tasks it started. No waiter re-runs the step on another's behalf and no
    # waiter polls: one sleeps with a deadline only when the scheduler asks to be looked at
    # again (``next_wakeup``: a time slice ending), and whoever wakes at it runs the step.
    # Asks that shrink (NOTE [Asks that shrink]) are refitted inside the step for every
    # waiting task that has one, since lanes change only there.
    #
    # NOTE [Uncontended calls]
    # With one slot (every policy but "pack") and nothing running, stopping or waiting, a
    # call takes the device with one lock and no scheduler task (``_held``): nothing could
    # have been chosen instead of it, and nothing can be preempted for an inference. While
    # it holds, arrivals queue in the scheduler as usual and the step is deferred (nothing
    # may start beside it); its end runs the step, which hands the device to the best of
    # them. A call so taken is no preemptible segment and holds no lane.

    def hold(self, model: str = "", kind: Kind = Kind.CONTROL, *, priority: Priority = Priority.LATENCY_CRITICAL,
                 unit_s: float = 0.0, deadline_s: float | None = None, arrived_at: float | None = None,
                 ephemeral: int = 0, ticket: Ticket | None = None, at_most: bool = False) -> _Hold:
        """Hold the runtime for one call (a context manager); yields its :class:`Grant`.
        Re-entrant in a thread (a call inside a call). ``deadline_s`` (an SLO) counts
        from ``arrived_at`` (on this dispatcher's clock) when given, else from now.
        ``ephemeral``: with lanes, the bytes the call's lane must hold (all of them: it
        runs alone). ``ticket``: bound to the task while it waits, so that another
        thread can bring its deadline forward (``Ticket.expedite``). ``at_most``:
        ``ephemeral`` is an upper bound, lowered while the task waits to what the lanes
        could ever give it beside the persistent memory admitted (NOTE [Asks that shrink])."""
        return _Hold(self, model, kind, priority, unit_s, deadline_s, arrived_at, ephemeral, ticket, at_most)

    def _enter(self, hold: _Hold) -> Grant:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth:
            local.depth = depth + 1
            hold.task = None
            return Grant(nested=True)
        lock = self._lock
        with lock:
            sched = self.scheduler
            now = self.clock()
            if self._held is None and sched.lanes is None and sched.slots == 1 and not sched.waiting \
                    and not sched.running and not sched.stopping:
                # NOTE [Uncontended calls]
                self._held = hold
                hold.task = None
                previous = self._user if hold.kind is Kind.INFERENCE else None
                if hold.kind is not Kind.CONTROL:
                    self._user = (hold.kind, hold.model)
                local.depth = 1
                return Grant(0.0, previous)
            task = self._submit(hold, now)
            hold.task = task
            if task.state is State.RUNNING:  # started by its own arrival's step
                turn = self._grant_of(task, self._previous.pop(task.id, None))
                waiter = None
            else:
                waiter = self._wakers[task.id] = self._new_waiter()
                timeout = self._timeout()
        if waiter is not None:
            try:
                turn = self._wait(task, waiter, timeout)
            except BaseException:  # interrupted while queued: leave no task behind
                with lock:
                    self._wakers.pop(task.id, None)
                    self._shrinking.pop(task.id, None)
                    self._switches.pop(task.id, None)
                    if hold.ticket is not None:
                        hold.ticket.bind(None, None)
                    if task.state is State.WAITING:
                        self.scheduler.withdraw(task.id)
                    elif task.state is State.RUNNING:
                        self.scheduler.update(Finished(task.id, self.clock()))
                    self._step()
                raise
        if hold.ticket is not None:
            hold.ticket.bind(None, None)
        local.depth = 1
        return turn

    def _exit(self, hold: _Hold) -> None:
        local = self._local
        if local.depth > 1:
            local.depth -= 1
            return
        local.depth = 0
        with self._lock:
            if hold.task is None:  # NOTE [Uncontended calls]
                self._held = None
                if not self.scheduler.waiting:
                    return  # nothing could start: no step
            else:
                self.scheduler.update(Finished(hold.task.id, self.clock()))
            self._step()

    def _submit(self, hold: _Hold, now: float) -> Task:
        """With the lock held: the call's task, queued, and the step run for it."""
        start = now if hold.arrived_at is None else min(hold.arrived_at, now)
        task = Task(next(self._ids), hold.kind, hold.model, now, 1.0, hold.unit_s, hold.priority,
                    None if hold.deadline_s is None else start + hold.deadline_s, ephemeral=hold.ephemeral)
        self.scheduler.submit(task, now)
        if hold.ticket is not None:
            hold.ticket.bind(self, task.id)
        if hold.at_most and self.scheduler.lanes is not None:
            self._shrinking[task.id] = task
        self._step()
        return task

    def _wait(self, task: Task, waiter: _Waiter, timeout: float) -> Grant:
        """Sleep until the task runs; its turn, as the thread that started it made it
        (NOTE [Hand-offs]): the woken call takes no lock of the dispatcher's. A deadline
        only when the scheduler asks for a wake-up (a slice ends): whoever wakes at it
        runs the step."""
        while not waiter.lock.acquire(timeout=timeout):
            with self._lock:
                if waiter.grant is None:
                    self._step()
                    if waiter.grant is not None and timeout == _SAFETY_S:
                        log.warning("task %d (%s) started only at its waiter's deadline: a lost wake-up",
                                    task.id, task.model)
                if waiter.grant is not None:
                    return waiter.grant
                timeout = self._timeout()
        assert waiter.grant is not None, "a waiter was released without its turn"
        return waiter.grant

    def _grant_of(self, task: Task, previous: tuple[Kind, str] | None) -> Grant:
        return Grant(self.clock() - task.arrival, previous, lane=task.lane, lane_bytes=self._lane_size(task.lane),
                    switch=self._switches.pop(task.id, None))

    # NOTE [Asks that shrink]
    # A task that asks for "as much as it can get" (a language model's turn sized by an
    # estimate, a call whose memory is not measured yet) must not wait for more than the
    # lanes can give: persistent memory admitted (a training job's state) and the lanes
    # of long-lived tasks (a training job's, for its whole life) may never leave. While
    # such a task waits, its ask is lowered to the bytes free beside them, when some are,
    # so that it gets a lane of its own at once and the tasks queued behind it do not
    # wait forever; its bound is then the lane it gets. (Growing a job's lane instead would
    # make it wait for the job's iterations, which never leave their lane.)
    def _fit(self, task: Task) -> None:
        lanes = self.scheduler.lanes
        if lanes is None or task.state is not State.WAITING or lanes.admitted(task.id):
            return
        free = lanes.capacity - lanes.used - task.persistent
        if 0 < free < task.ephemeral:
            task.ephemeral = free

    @property
    def lane_capacity(self) -> int | None:
        """The bytes for lanes (None without lanes)."""
        lanes = self.scheduler.lanes
        return None if lanes is None else lanes.capacity

    def lanes(self) -> LanesView | None:
        """The lanes now, for operators (None without lanes): ``LaneManager.view``."""
        with self._lock:
            lanes = self.scheduler.lanes
            return None if lanes is None else lanes.view(self.scheduler.tasks)

    def free_lane_bytes(self) -> int:
        """With lanes: what a task of unknown memory asks for (NOTE [Lanes in the runtime])."""
        with self._lock:
            return self._free_lane_bytes()

    def _free_lane_bytes(self) -> int:
        lanes = self.scheduler.lanes
        if lanes is None:
            return 0
        free = lanes.capacity - lanes.used
        return free if free > 0 else lanes.capacity  # nothing free: wait for the device to drain

    def _lane_size(self, lane: int | None) -> int | None:
        lanes = self.scheduler.lanes
        if lanes is None or lane is None:
            return None
        return lanes.lanes[lane].size

    def expedite(self, task_id: int, since: float) -> None:
        """A waiting task is due since ``since`` (this dispatcher's clock), if not earlier."""
        with self._lock:
            if self.scheduler.expedite(task_id, since):
                self._step()

    @property
    def sleeping(self) -> int:
        """Threads asleep on their own lock until their task starts (NOTE [Hand-offs])."""
        with self._lock:
            return len(self._wakers)

    def most_urgent_waiting(self) -> tuple[Priority, float | None] | None:
        """The priority and deadline of the waiting task that would run first (None:
        nobody waits)."""
        with self._lock:
            task = self.scheduler.most_urgent_waiting()
            return None if task is None else (task.priority, task.deadline)

    def notify(self) -> None:
        """A job was paused, resumed or cancelled: its thread, if it waits, looks again."""
        with self._lock:
            for task_id in list(self._wakers):
                if task_id in self._jobs:
                    self._release(task_id)

    # ------------------------------------------------------------------ the step
    def _step(self) -> None:
        """With the lock held: one scheduler step; carry out its decisions, waking the
        waiter of each task started (NOTE [Hand-offs]). Deferred while an uncontended call
        holds the device (NOTE [Uncontended calls]): its end runs it."""
        if self._held is not None:
            return
        if self._shrinking:
            for task in list(self._shrinking.values()):
                if task.state is State.WAITING:
                    self._fit(task)
                else:
                    del self._shrinking[task.id]
        decisions = self.scheduler.schedule(self.clock())
        for d in decisions:  # the stops first: NOTE [Switch records]
            if not isinstance(d, Preempt):
                continue
            job = self._jobs.get(d.task.id)
            if job is None:
                continue
            switch = self._awaiting.get(job)
            if switch is None and d.by is not None and d.by.kind is Kind.INFERENCE:
                switch = self._switches[d.by.id] = self._new_switch(job, d.by.model)
            self._awaiting[job] = switch
            # A worker segment stops now (NOTE [Switch protocol]).
            self._outbox.append(job)
        for d in decisions:
            if not isinstance(d, Preempt):
                for t in (d.task, *d.task.batch):
                    if t.kind is Kind.INFERENCE and not self.packs and t.id not in self._switches:
                        self._record_switch_to(t)
                    previous = None
                    if t.kind is not Kind.CONTROL:
                        if t.kind is Kind.INFERENCE:
                            previous = self._user
                        self._user = (t.kind, t.model)
                    waiter = self._wakers.pop(t.id, None)
                    if waiter is not None:  # its turn, handed over with the wake-up
                        waiter.grant = self._grant_of(t, previous)
                        waiter.lock.release()
                    elif previous is not None:  # started by its own arrival: read back by the call
                        self._previous[t.id] = previous
        if self._outbox:
            self._send_stops()

    # NOTE [Switch records]
    # A switch is recorded by the dispatcher, which decides every stop, and only it fills
    # the record in. A stop the scheduler decides for an inference makes the record at
    # once, handed to the inference's turn (``Grant.switch``). A job stopped for anything
    # else (a control call, a slice's end) and still stopping when an inference starts
    # makes the record then, for that inference (not with lanes: an inference in another
    # lane runs beside the job, it does not replace it). The job reports its stop and clean times
    # (``job_stopped``, from its worker's reply; or, where no segment reported one, the
    # time it took to report ``Stopped``), the inference its start, load and total times
    # (``served``, from its call's timings), in whichever order they come; the executor
    # never sees the record.
    def _new_switch(self, job: Preemptible, model: str) -> Switch:
        switch = Switch(job.name, model, time.perf_counter())
        self._switch_log.append(switch)
        del self._switch_log[:-KEEP_SWITCHES]
        return switch

    def _record_switch_to(self, task: Task) -> None:
        """With the lock held, as an inference starts: the record of the switch from a job
        still stopping with none (NOTE [Switch records])."""
        job = next((j for j, switch in self._awaiting.items() if switch is None), None)
        if job is not None:
            self._switches[task.id] = self._awaiting[job] = self._new_switch(job, task.model)

    def served(self, switch: Switch, timings: CallTimings | None) -> None:
        """The inference a switch made way for is back: ``timings``, its call's (None
        in-process)."""
        with self._lock:
            switch.total_s = time.perf_counter() - switch.requested_at
            if timings is not None and timings.sent_at is not None:
                switch.start_s = timings.received_at - timings.sent_at
            switch.load_s = None if timings is None else timings.load_s

    def job_stopped(self, job: Preemptible, stop_sent_at: float, stopped_at: float, cleaned_at: float) -> None:
        """A job's segment in a worker stopped as told: the stop went out at ``stop_sent_at``,
        the job stopped at ``stopped_at`` and was cleaned up at ``cleaned_at``."""
        with self._lock:
            switch = self._awaiting.pop(job, None)
            if switch is not None:
                switch.stop_s = max(0.0, stopped_at - stop_sent_at)
                switch.clean_s = cleaned_at - stopped_at

    def switches(self) -> list[dict]:
        """The latest switch records, oldest first."""
        with self._lock:
            return [s.as_dict() for s in self._switch_log]

    def share_home(self, job: Preemptible, holder: str, held_s: float) -> None:
        """With lanes: ``job`` waits for a home that job ``holder``'s segment has held for
        ``held_s``; the jobs take turns there, each at least ``SHARE_S``."""
        if held_s < SHARE_S:
            return
        with self._lock:
            other = next((j for j in self._job_tasks if j.name == holder and j is not job), None)
        if other is not None:
            other.stop()  # outside the lock: NOTE [Stops outside the lock]

    def _release(self, task_id: int) -> None:
        """Wake a job's thread to look again (no turn: it reads its task's state)."""
        waiter = self._wakers.pop(task_id, None)
        if waiter is not None:
            waiter.lock.release()

    # NOTE [Stops outside the lock]
    # A Preempt for a job reaches it through ``job.stop``, which takes the pool's lock.
    # The dispatcher never calls it with its own condition held: decisions queue stops
    # in an outbox, and the step sends them after releasing the condition, then takes it
    # back. The pool never calls the dispatcher: a job asks it whether it holds its turn
    # and in which lane before it starts a segment, in its own thread.
    def _send_stops(self) -> None:
        while self._outbox:
            pending, self._outbox = self._outbox, []
            self._lock.release()
            try:
                for job in pending:
                    job.stop()
            finally:
                self._lock.acquire()

    def _new_waiter(self) -> _Waiter:
        return _Waiter()

    def _timeout(self) -> float:
        """With the lock held: how long a waiter may sleep. Until the scheduler's next
        wake-up when it asks for one (a slice ends), else a safety deadline."""
        wake = self.scheduler.next_wakeup(self.clock())
        if wake is None:
            return _SAFETY_S
        return max(0.001, min(_SAFETY_S, wake - self.clock()))

    # ------------------------------------------------------------------ training jobs
    # A job's scheduler task, its progress at each preemption point, its wait for its next
    # turn, its lane's size once its iterations have measured it (Salus's resize at
    # iteration boundaries), and its end; each change runs the step (NOTE [Hand-offs]).
    def job_task(self, job: Preemptible) -> Task:
        """The job's task, created (queued) on first use."""
        with self._lock:
            task = self._job_tasks.get(job)
            if task is None:
                now = self.clock()
                task = Task(next(self._ids), Kind.TRAINING, job.name, now,
                            float(job.iterations) if job.iterations else float("inf"), 0.0, Priority.BEST_EFFORT)
                # With lanes, a job's memory is unknown until its iterations measure it:
                # it asks for what is free now, then is re-admitted (``_resize``).
                task.ephemeral = self._free_lane_bytes()
                self._job_tasks[job] = task
                self._jobs[task.id] = job
                self.scheduler.submit(task, now)
            return task

    def lane_bound(self, job: Preemptible) -> LaneBound | None:
        """With lanes: what the job's next iteration runs with (its lane, the lane's size,
        the cores); None without lanes."""
        with self._lock:
            task = self._job_tasks.get(job)
            if not self.packs or task is None:
                return None
            return LaneBound(job.name, task.lane, self._lane_size(task.lane), self.lane_threads)

    def _resize(self, job: Preemptible) -> None:
        """With the condition held, at a preemption point: once the job has measured its
        memory, it is to be re-admitted with it (persistent state, and one iteration's
        peak with headroom where it fits) in place of the whole budget, as Salus resizes
        lanes at iteration boundaries. The job stops first; its admission is swapped for
        the new one once it has (``_swap``), so that its memory is counted until its
        segment has stopped. Sizes that can never fit are refused here, while the job
        still holds its admission."""
        stats = job.stats
        if not self.packs or stats.ephemeral_bytes is None or job in self._sized:
            return
        sizes = job_lane_sizes(job.name, stats.persistent_bytes or 0, stats.ephemeral_bytes, self.lane_capacity or 0)
        self._sized.add(job)
        self._resizing[job] = sizes

    def _swap(self, job: Preemptible, task: Task) -> Task:
        """With the condition held and the job stopped (its task waiting): the resize
        ``_resize`` decided. The old task leaves its lane and the new one is queued in
        the same step, keeping its progress."""
        sizes = self._resizing.pop(job, None)
        if sizes is None:
            return task
        assert task.state is State.WAITING, task.state
        self.scheduler.withdraw(task.id)
        new = Task(next(self._ids), Kind.TRAINING, job.name, task.arrival, task.work, task.unit_s, task.priority,
                   persistent=sizes[0], ephemeral=sizes[1])
        new.done, new.service = task.done, task.service
        self._jobs.pop(task.id, None)
        self._job_tasks[job] = new
        self._jobs[new.id] = job
        self.scheduler.submit(new, self.clock())
        return new

    def must_yield(self, job: Preemptible) -> bool:
        """At a preemption point: must the job stop now? Reports its progress."""
        task = self.job_task(job)
        with self._lock:
            self._resize(job)
            if job in self._resizing:  # it stops, and is re-admitted with its sizes once it has
                return True
            if task.state is State.RUNNING:
                stats = job.stats
                unit = stats.step_seconds / stats.iterations if stats.iterations else None
                self.scheduler.update(Progress(task.id, self.clock(), float(stats.iterations), unit))
            self._step()
            return task.state is not State.RUNNING

    def wait_for_training_turn(self, job: Preemptible) -> None:
        """Stop the job's segment in the scheduler's books and wait until it runs again
        (or is cancelled). A paused job is held out of the queue until resumed. The job's
        thread sleeps on its waker (NOTE [Hand-offs]); ``notify`` wakes it for a pause,
        a resume or a cancel."""
        task = self.job_task(job)
        with self._lock:
            if task.state in (State.RUNNING, State.STOPPING):
                self._stopped(job, task)
            if task.state is State.WAITING:
                task = self._swap(job, task)
        while True:
            with self._lock:
                if job.cancelled:
                    self._wakers.pop(task.id, None)
                    return
                if job.paused:
                    if task.state in (State.RUNNING, State.STOPPING):  # given the device, then paused: hand it back
                        self._stopped(job, task)
                    if task.state is State.WAITING:
                        self.scheduler.hold(task.id)
                elif task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self._step()
                # Given the device, even if already told to stop again: the job runs one
                # iteration first, so back-to-back calls cannot starve it.
                if task.state in (State.RUNNING, State.STOPPING) and not job.paused:
                    self._wakers.pop(task.id, None)
                    return
                waiter = self._wakers.get(task.id)
                if waiter is None:
                    waiter = self._wakers[task.id] = self._new_waiter()
                timeout = self._timeout()
            waiter.lock.acquire(timeout=timeout)

    def _stopped(self, job: Preemptible, task: Task) -> None:
        """With the lock held: the job has stopped; a switch made from now on is not from
        it. A record still without its stop time (no segment ran to report one: the job
        stopped in this process, or before its segment started) gets the time the job
        took to stop here (NOTE [Switch records])."""
        switch = self._awaiting.pop(job, None)
        if switch is not None and switch.stop_s is None:
            switch.stop_s, switch.clean_s = max(0.0, time.perf_counter() - switch.requested_at), 0.0
        self.scheduler.update(Stopped(task.id, self.clock(), float(job.stats.iterations)))

    def holds_turn(self, job: Preemptible) -> bool:
        """Whether the scheduler gave the job the device (it may already be told to stop:
        it still runs one iteration, see ``wait_for_training_turn``)."""
        with self._lock:
            task = self._job_tasks.get(job)
            return task is not None and task.state in (State.RUNNING, State.STOPPING)

    def job_ended(self, job: Preemptible) -> None:
        with self._lock:
            task = self._job_tasks.pop(job, None)
            self._awaiting.pop(job, None)
            self._sized.discard(job)
            self._resizing.pop(job, None)
            if task is None:
                return
            self._jobs.pop(task.id, None)
            if task.state in (State.RUNNING, State.STOPPING):
                self.scheduler.update(Finished(task.id, self.clock()))
            elif task.id in self.scheduler.tasks:
                if task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self.scheduler.withdraw(task.id)
            self._step()


class _Waiter:
    """A waiting thread's lock, taken at creation and released by the thread that starts
    its task, with the task's turn (None for a job's thread woken to look again)."""

    __slots__ = ("lock", "grant")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.grant: Grant | None = None


class _Hold:
    """One call's hold on the runtime (``Dispatcher.hold``): a context manager that
    yields the call's :class:`Grant`."""

    __slots__ = ("dispatcher", "model", "kind", "priority", "unit_s", "deadline_s", "arrived_at", "ephemeral", "ticket",
                 "at_most", "task")

    def __init__(self, dispatcher: Dispatcher, model: str, kind: Kind, priority: Priority, unit_s: float,
                 deadline_s: float | None, arrived_at: float | None, ephemeral: int, ticket: Ticket | None,
                 at_most: bool) -> None:
        self.dispatcher, self.model, self.kind, self.priority = dispatcher, model, kind, priority
        self.unit_s, self.deadline_s, self.arrived_at = unit_s, deadline_s, arrived_at
        self.ephemeral, self.ticket, self.at_most = ephemeral, ticket, at_most
        self.task: Task | None = None

    def __enter__(self) -> Grant:
        return self.dispatcher._enter(self)

    def __exit__(self, *exc) -> None:
        self.dispatcher._exit(self)
