"""Preemption: which running task the scheduler stops for a waiting one, and why: the
policy ranks the waiting task above it, a request waits for the lane a training job
holds, or its time slice is used up. Pure functions of a :class:`Scheduler`'s state,
which decide and change nothing; the scheduler's step (``core.py``) carries the choice
out (NOTE [Scheduler slots]). Runs wherever the scheduler does: the controller and the
simulator.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from timeshare.scheduler.task import Kind, State, Task

if TYPE_CHECKING:
    from timeshare.scheduler.core import Scheduler

_RUNNING = State.RUNNING
_WAITING = State.WAITING


def choose_victim(s: Scheduler, best: Task | None, candidates: list[Task], now: float) -> Task | None:
    """The running task (one of ``candidates``, the preemptible ones) to stop for ``best``,
    the best waiting task that could start (None: none could, but a packed lane's slice
    may still end); None: nobody is stopped."""
    policy = s.policy
    victim = None
    if policy.preemptive and best is not None:
        found = blockers(s, best, candidates)
        worst = max(found, key=lambda t: (policy.rank(t, now), t.seq), default=None)
        if worst is not None and policy.rank(best, now) < policy.rank(worst, now):
            victim = worst
    if victim is None and best is not None:
        victim = lane_holder(s, best)
    if victim is None and s.quantum_s:
        victim = slice_over(s, best, candidates, now)
    return victim


def lane_holder(s: Scheduler, best: Task) -> Task | None:
    """With lanes: the training job running in the lane an inference waits in. A job
    is a stream of iterations that may never end; a request is one: the job yields
    its lane at its next iteration boundary and comes back after the request, as
    tasks of one lane take turns in Salus (an endless job would otherwise hold an
    inference that joined its lane forever)."""
    if not s.packs or best.kind is not Kind.INFERENCE:
        return None
    assert s.lanes is not None
    lane_id = best.lane
    if lane_id is None:  # not admitted yet: the lane Algorithm 1 would put it in
        choice = s.lanes.choose(best.persistent, best.ephemeral)
        lane_id = choice[1] if choice is not None else None
    lane = s.lanes.lanes.get(lane_id) if lane_id is not None else None
    holder = s.running.get(lane.busy) if lane is not None and lane.busy is not None else None
    if holder is None or holder.kind is not Kind.TRAINING or not holder.preemptible or holder.state is not _RUNNING:
        return None
    return holder


def blockers(s: Scheduler, best: Task, candidates: list[Task]) -> list[Task]:
    """The running tasks whose stop would let ``best`` start. With memory lanes, a
    ``best`` admitted to (or bound for) a lane another task holds waits for it alone:
    a preempted task keeps its memory, so stopping any other frees at most a slot
    that ``best`` cannot use, and the stopped task, still the best startable one,
    would start again at once (a livelock at one instant). Otherwise a full set of
    slots is what holds ``best`` back, and any running task will do."""
    if s.lanes is not None:
        lane_id = best.lane
        if lane_id is None:  # not admitted yet: the lane Algorithm 1 would put it in
            choice = s.lanes.choose(best.persistent, best.ephemeral)
            lane_id = choice[1] if choice is not None else None
        lane = s.lanes.lanes.get(lane_id) if lane_id is not None else None
        if lane is not None and lane.busy is not None:
            return [t for t in candidates if t.id == lane.busy]
        if len(s.running) < s.slots:
            return []
    return candidates


def slice_over(s: Scheduler, best: Task | None, candidates: list[Task], now: float) -> Task | None:
    """A running task whose time slice is used up and that a waiting task would come
    before. Packing with lanes: the waiting task must share its lane."""
    policy, q = s.policy, s.quantum_s
    assert q is not None, "slice_over is only called with time slices"
    packed_lanes = s.lanes if s.slots == math.inf else None
    packed = packed_lanes is not None
    best_key = policy.key(best) if best is not None else None
    for t in candidates:
        assert t.segment_start is not None, "_run starts a segment for every running task"
        if now - t.segment_start < q or (best is None and not packed):
            continue
        if packed_lanes is not None:
            lane = packed_lanes.lanes.get(t.lane) if t.lane is not None else None
            waiting = [s.tasks[i] for i in lane.tasks if i != t.id and s.tasks[i].state is _WAITING] \
                if lane is not None else []
            if waiting and min(policy.key(w) for w in waiting) < policy.requeue_key(t, now):
                return t
        elif best_key is not None and best_key < policy.requeue_key(t, now):  # not packed: best is set
            return t
    return None
