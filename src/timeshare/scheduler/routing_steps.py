"""The compiled steps of NOTE [Fleet routing] (``scheduler/routing.py``): pure functions
over a fleet's arrays, compiled with numba, that the cluster simulator's loop and a
cluster's router (``routing.Router``) call alike. ``choose`` applies the routing
policies and changes nothing; ``place`` makes a model resident (evicting in recency
order); ``queued``, ``drained`` and ``retire`` keep the queues and the devices up to
date; the rest keep the least-loaded heap and each device's recency list. Runs in the
process that routes: a cluster's front end, or the simulator. Argument order: see
``Fleet.arrays``; ``choose``'s policies are the codes of ``routing.POLICIES``.
Compiled once per machine, not once per process: numba caches the machine code beside
this file (``cache=True``; 10 s of compiling on a 2-core machine, paid by every front
end, server and simulator process before); numba checks this file alone, so a compiled
caller elsewhere must not be cached (``sim/fleet.py``'s loop is not). No step calls itself: a recursive function
loaded from numba's cache crashed the process (numba 0.68).
"""

from __future__ import annotations

import numba
import numpy as np

NO_DEVICE = -1  # no device can ever hold the model
REPLICA_SHARE = 0.3  # of a device, what one replica of a model is planned to take
RATE_TAU_S = 10.0  # the time constant of each model's request rate, an exponentially decayed count


@numba.njit(nogil=True, cache=True)
def _sift_down(i, free_at, heap, heap_pos):
    n = len(heap)
    while True:
        left = 2 * i + 1
        if left >= n:
            return
        child = left
        if left + 1 < n and free_at[heap[left + 1]] < free_at[heap[left]]:
            child = left + 1
        if free_at[heap[child]] < free_at[heap[i]]:
            a, b = heap[i], heap[child]
            heap[i], heap[child] = b, a
            heap_pos[b], heap_pos[a] = i, child
            i = child
        else:
            return


@numba.njit(nogil=True, cache=True)
def _sift_up(i, free_at, heap, heap_pos):
    while i > 0:
        parent = (i - 1) // 2
        if free_at[heap[i]] < free_at[heap[parent]]:
            a, b = heap[i], heap[parent]
            heap[i], heap[parent] = b, a
            heap_pos[b], heap_pos[a] = i, parent
            i = parent
        else:
            return


@numba.njit(nogil=True, cache=True)
def set_free_at(d, t, free_at, heap, heap_pos):
    """Device ``d``'s queue drains at ``t`` now; the heap is kept in order."""
    old = free_at[d]
    free_at[d] = t
    if t > old:
        _sift_down(heap_pos[d], free_at, heap, heap_pos)
    else:
        _sift_up(heap_pos[d], free_at, heap, heap_pos)


@numba.njit(nogil=True, cache=True)
def queued(d, m, until, st):
    """A request of model ``m`` queued on device ``d`` ends at ``until``, the device's
    queue drains then, and ``m`` is busy there until then."""
    free_at, slot_of, slot_busy, heap, heap_pos = st[7], st[8], st[11], st[14], st[15]
    set_free_at(d, until, free_at, heap, heap_pos)
    s = slot_of[m, d]
    if s >= 0 and until > slot_busy[d, s]:
        slot_busy[d, s] = until


@numba.njit(nogil=True, cache=True)
def drained(d, now, st):
    """Device ``d`` has nothing outstanding at ``now``."""
    free_at, slot_busy, heap, heap_pos = st[7], st[11], st[14], st[15]
    set_free_at(d, now, free_at, heap, heap_pos)
    for k in range(slot_busy.shape[1]):
        if slot_busy[d, k] > now:
            slot_busy[d, k] = now


@numba.njit(nogil=True, cache=True)
def _random_device(m, x, size, capacity):
    """A device large enough for model ``m``, uniformly at random from ``x`` in [0, 1):
    drawn, and drawn again from a sequence ``x`` seeds while it is too small (a device of
    0 bytes is one not started or gone); after 64 draws, the first that fits from there."""
    ndev = len(capacity)
    for _ in range(64):
        d = int(x * ndev) % ndev
        if capacity[d] >= size[m]:
            return d
        x = (x * 7919.0 + 0.6180339887) % 1.0
    for k in range(ndev):
        d = (int(x * ndev) + k) % ndev
        if capacity[d] >= size[m]:
            return d
    return -1


@numba.njit(nogil=True, cache=True)
def _fits_somewhere(m, size, capacity):
    for d in range(len(capacity)):
        if capacity[d] >= size[m]:
            return True
    return False


@numba.njit(nogil=True, cache=True)
def _least_loaded(m, size, capacity, heap, free_at):
    """The device whose queue drains first among those large enough for ``m`` (the
    heap's top when it is one)."""
    d = heap[0]
    if capacity[d] >= size[m]:
        return d
    best, best_t = -1, np.inf
    for d in range(len(capacity)):
        if capacity[d] >= size[m] and free_at[d] < best_t:
            best, best_t = d, free_at[d]
    return best


@numba.njit(nogil=True, cache=True)
def choose(policy, m, now, u, params, st):
    """The device for a request of model ``m`` at ``now`` (NOTE [Fleet routing]); ``u``:
    four uniform numbers in [0, 1); ``params``: (max_models, max_ongoing, replicate_margin);
    ``st``: ``Fleet.arrays()``. NO_DEVICE when no device is large enough."""
    max_ongoing, margin = params[1], params[2]
    (size, compute_s, cold_s, load_s, capacity, used, nmodels, free_at, slot_of, slot_model, links, slot_busy,
     holders, nholders, heap, heap_pos, rate, rate_at, ends, free, holder_pos) = st
    if not _fits_somewhere(m, size, capacity):
        return -1
    if policy == 0:  # random
        return _random_device(m, u[0], size, capacity)
    if policy == 1:  # least-loaded
        return _least_loaded(m, size, capacity, heap, free_at)
    n = nholders[m]
    if policy == 2:  # Ray Serve's multiplexing
        if n > 0:
            a = holders[m, int(u[0] * n) % n]
            b = holders[m, int(u[1] * n) % n]
            qa = max(free_at[a] - now, 0.0) / compute_s[m]
            qb = max(free_at[b] - now, 0.0) / compute_s[m]
            pick, q = (a, qa) if qa <= qb else (b, qb)
            if q < max_ongoing:
                return pick
        a = _random_device(m, u[2], size, capacity)
        b = _random_device(m, u[3], size, capacity)
        if nmodels[a] != nmodels[b]:
            return a if nmodels[a] < nmodels[b] else b
        return a if free_at[a] <= free_at[b] else b
    # timeshare: the holder whose queue drains first, unless the model's demand wants
    # another replica and a new one finishes sooner
    best, best_t = -1, np.inf
    for k in range(n):
        d = holders[m, k]
        if free_at[d] < best_t:
            best, best_t = d, free_at[d]
    decayed = rate[m] * np.exp(-(now - rate_at[m]) / RATE_TAU_S) + 1.0 / RATE_TAU_S
    want = max(1, int(np.ceil(decayed * compute_s[m] / REPLICA_SHARE)))
    if best >= 0 and n >= want and best_t - now <= margin * cold_s[m]:
        return best
    best_t = max(best_t, now) + compute_s[m] if best >= 0 else np.inf
    for k in range(3):  # a new replica: on the least loaded device, or on one of two at random
        d = heap[0] if k == 0 else _random_device(m, u[k + 1], size, capacity)
        if capacity[d] < size[m] or slot_of[m, d] >= 0:
            continue
        t = max(free_at[d], now) + cold_s[m]
        if used[d] + size[m] > capacity[d] and ends[d, 0] >= 0:
            t += cold_s[slot_model[d, ends[d, 0]]]  # it evicts: what is evicted is loaded again, later
        if t < best_t:
            best, best_t = d, t
    if best < 0:
        best = _least_loaded(m, size, capacity, heap, free_at)
    return best


@numba.njit(nogil=True, cache=True)
def _unlink(d, s, links, ends):
    before, after = links[d, s, 0], links[d, s, 1]
    if before >= 0:
        links[d, before, 1] = after
    else:
        ends[d, 0] = after
    if after >= 0:
        links[d, after, 0] = before
    else:
        ends[d, 1] = before
    links[d, s, 0] = -1
    links[d, s, 1] = -1


@numba.njit(nogil=True, cache=True)
def _append(d, s, links, ends):
    """Slot ``s`` becomes device ``d``'s most recently routed."""
    last = ends[d, 1]
    links[d, s, 0] = last
    links[d, s, 1] = -1
    if last >= 0:
        links[d, last, 1] = s
    else:
        ends[d, 0] = s
    ends[d, 1] = s


@numba.njit(nogil=True, cache=True)
def _evict(d, s, st):
    size, used, nmodels, slot_of, slot_model, links, holders, nholders, ends, free, holder_pos = (
        st[0], st[5], st[6], st[8], st[9], st[10], st[12], st[13], st[18], st[19], st[20])
    victim = slot_model[d, s]
    _unlink(d, s, links, ends)
    slot_model[d, s] = -1
    slot_of[victim, d] = -1
    used[d] -= size[victim]
    nmodels[d] -= 1
    free[d, free.shape[1] - nmodels[d] - 1] = s
    k, last = holder_pos[victim, d], nholders[victim] - 1  # the last holder takes d's place
    moved = holders[victim, last]
    holders[victim, k] = moved
    holder_pos[victim, moved] = k
    holders[victim, last] = -1
    holder_pos[victim, d] = -1
    nholders[victim] = last
    return victim


@numba.njit(nogil=True, cache=True)
def retire(d, st):
    """Device ``d`` holds nothing and is never chosen (capacity 0)."""
    slot_model, capacity, free_at, heap, heap_pos = st[9], st[4], st[7], st[14], st[15]
    for k in range(slot_model.shape[1]):
        if slot_model[d, k] >= 0:
            _evict(d, k, st)
    capacity[d] = 0
    set_free_at(d, np.inf, free_at, heap, heap_pos)  # last in the heap: least-loaded never finds it


@numba.njit(nogil=True, cache=True)
def place(m, d, now, params, st):
    """Make model ``m`` resident on device ``d`` for a request routed at ``now``. Returns
    (whether it was resident already, seconds and count of the reloads owed to models
    evicted for it that still had requests queued there). ``d`` must be large enough for
    ``m`` (``choose`` sees to that)."""
    max_models = params[0]
    (size, compute_s, cold_s, load_s, capacity, used, nmodels, free_at, slot_of, slot_model, links, slot_busy,
     holders, nholders, heap, heap_pos, rate, rate_at, ends, free, holder_pos) = st
    rate[m] = rate[m] * np.exp(-(now - rate_at[m]) / RATE_TAU_S) + 1.0 / RATE_TAU_S
    rate_at[m] = now
    s = slot_of[m, d]
    if s >= 0:
        _unlink(d, s, links, ends)
        _append(d, s, links, ends)
        return True, 0.0, 0
    owed, owed_n = 0.0, 0
    slots = slot_model.shape[1]
    while used[d] + size[m] > capacity[d] or (max_models > 0 and nmodels[d] >= max_models):
        victim_slot = ends[d, 0]  # the least recently routed idle one (nothing queued), else the least recent
        k = victim_slot
        while k >= 0:
            if slot_busy[d, k] <= now:
                victim_slot = k
                break
            k = links[d, k, 1]
        if victim_slot < 0:
            break
        idle = slot_busy[d, victim_slot] <= now
        victim = _evict(d, victim_slot, st)
        if not idle:
            owed += load_s[victim]
            owed_n += 1
    if nmodels[d] >= slots:
        return False, owed, owed_n  # unreachable while slots cover the most models a device can hold
    k = free[d, slots - nmodels[d] - 1]
    slot_model[d, k] = m
    slot_of[m, d] = k
    slot_busy[d, k] = now
    _append(d, k, links, ends)
    used[d] += size[m]
    nmodels[d] += 1
    holders[m, nholders[m]] = d
    holder_pos[m, d] = nholders[m]
    nholders[m] += 1
    return False, owed, owed_n
