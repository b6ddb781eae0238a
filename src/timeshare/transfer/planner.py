"""Grouping layers for pipelined transmission. Pure logic (numpy only); runs wherever
plans are made.

# NOTE [Pipeline cost model]
Layers 1..n in execution order; layer i takes t_i to transfer and c_i to compute.
A grouping cuts the sequence into consecutive groups G_1..G_m. The host queues all the
groups on the copy engine before the forward starts (NOTE [Pipelined forward]), taking
q seconds for each: group k is queued at k*q, and the forward starts at m*q. Copies
are serial, each paying a fixed overhead alpha, and none starts before it is queued:
    T_k = max(T_{k-1}, k*q) + alpha + sum_{i in G_k} t_i,
whose solution is the longest of the chains that start at a group j's queueing,
T_k = max_j [ j*q + (k-j+1)*alpha + sum of t over G_j..G_k ]. That depends on every
earlier cut, so the model bounds the bytes of G_j..G_k by all bytes so far, which
leaves a term linear in j, largest at j = 1 or j = k:
    T_k = max(q + k*alpha, k*q + alpha) + sum_{i <= last layer of G_k} t_i.
This is exact when q <= alpha: the host keeps ahead of the copies, and the chain from
the first group, which carries all the bytes, is the longest. When the host is the
slower, a large group's copy overlaps the queueing of the next groups, which the model
does not credit: it overestimates T_k by at most (k-1)*(q - alpha). (The CPU backend
queues a load as one item, after its per-group set-up, so its copies start at m*q,
up to (m-1)*q later than modelled; there q is a few microseconds.) Group k computes
once it has arrived and group k-1 has finished, paying beta:
    E_0 = m*q,   E_k = max(E_{k-1}, T_k + L) + beta + sum_{i in G_k} c_i.
We minimise E_m. The tail (tensors no traced module read) is queued too, one more q
for every plan alike, and left out.
L is the delivery latency of an arrival to a compute that is blocked on it: zero on
CUDA (the wait is on the device), a thread wake-up on the CPU backend. The model treats
each arrival as visible L after it lands, so L costs nothing when the compute reaches
the group later than that; L = q = 0 is PipeSwitch's model.

# NOTE [Exact grouping by dynamic programming]
With k groups and the last group ending at layer j, T_k = max(q + k*alpha, k*q + alpha)
+ prefix_t(j) does not depend on where the earlier cuts are, and E_k is non-decreasing
in E_{k-1}. So, starting from E_0 = 0, the best E over groupings of the first j layers
into k groups, F[k][j], satisfies
F[k][j] = min_i max(F[k-1][i], T_k(j) + L) + beta + prefix_c(j) - prefix_c(i).
The forward's later start is a constant per group count: unrolled, E_m is the largest
of E_0 + m*beta + prefix_c(n) and terms that do not involve E_0, so with E_0 = m*q it is
max(m*(q + beta) + prefix_c(n), E_m from E_0 = 0), and the optimum is
min_m max(F[m][n], m*(q + beta) + prefix_c(n)): O(n^3) time, vectorised over (i, j) per
k. PipeSwitch searched the 2^(n-1) groupings with pruning; the tests check this
against brute force.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from timeshare.errors import ConfigError

STRATEGIES = ("optimal", "per_layer", "whole", "fixed")


@dataclass(frozen=True)
class CostModel:
    """Per-layer transfer and compute seconds, the per-group overheads, the delivery
    latency and the host's time to queue a group (seconds); see NOTE [Pipeline cost model]."""

    transfer: tuple[float, ...]
    compute: tuple[float, ...]
    alpha: float = 0.0
    beta: float = 0.0
    latency: float = 0.0
    queue: float = 0.0

    def __post_init__(self) -> None:
        if len(self.transfer) != len(self.compute):
            raise ConfigError(
                f"cost model has {len(self.transfer)} transfer times but {len(self.compute)} compute times"
            )
        if len(self.transfer) == 0:
            raise ConfigError("cost model needs at least one layer")
        if min(self.transfer) < 0 or min(self.compute) < 0 or min(self.alpha, self.beta, self.latency, self.queue) < 0:
            raise ConfigError("cost model times must be non-negative")

    @property
    def n(self) -> int:
        return len(self.transfer)

    def copy_overheads(self, k: int) -> float:
        """The fixed part of T_k, the arrival of group k (1-based): see NOTE [Pipeline cost model]."""
        return max(self.queue + k * self.alpha, k * self.queue + self.alpha)


@dataclass(frozen=True)
class Plan:
    """A grouping: ``ends[k]`` is the index one past the last layer of group k."""

    strategy: str
    ends: tuple[int, ...]
    predicted_s: float = field(default=float("nan"), compare=False)

    @property
    def groups(self) -> list[tuple[int, int]]:
        starts = (0,) + self.ends[:-1]
        return list(zip(starts, self.ends))

    def __len__(self) -> int:
        return len(self.ends)


def first_inference_time(cost: CostModel, ends: Sequence[int]) -> float:
    """E_m of the grouping ``ends`` under ``cost`` (see NOTE [Pipeline cost model])."""
    _check_ends(ends, cost.n)
    bytes_s = 0.0  # transfer seconds of the layers up to the current group's end
    e_done = len(ends) * cost.queue  # the forward starts once every group is queued
    start = 0
    for k, end in enumerate(ends, 1):
        bytes_s += sum(cost.transfer[start:end])
        t_done = cost.copy_overheads(k) + bytes_s
        e_done = max(e_done, t_done + cost.latency) + cost.beta + sum(cost.compute[start:end])
        start = end
    return e_done


def optimal(cost: CostModel) -> Plan:
    """The grouping of least E_m, exactly (see NOTE [Exact grouping by dynamic programming])."""
    n = cost.n
    pt = np.concatenate([[0.0], np.cumsum(cost.transfer)])
    pc = np.concatenate([[0.0], np.cumsum(cost.compute)])
    inf = np.inf
    f_prev = np.full(n + 1, inf)
    f_prev[0] = 0.0
    back = np.zeros((n + 1, n + 1), dtype=np.int64)  # back[k][j] = start of the last group
    best_e, best_k = inf, 0
    # With k groups, only i >= k-1 (earlier groups need a layer each) and j >= k can be
    # finite: the candidates for k form the block [k-1:n] x [k:n+1], a third of n^3 overall.
    r = np.arange(n)
    below = r[:, None] > r[None, :]  # block row r is i = k-1+r, column c is j = k+c; i >= j iff r > c
    for k in range(1, n + 1):
        m = n - k + 1
        arrive = cost.copy_overheads(k) + pt[k:] + cost.latency  # T_k + L when group k ends at j = k..n
        prev = f_prev[k - 1 : n]
        cand = np.maximum(prev[:, None], arrive[None, :]) + cost.beta + (pc[None, k:] - pc[k - 1 : n, None])
        cand[below[:m, :m]] = inf
        arg = np.argmin(cand, axis=0)
        f_cur = np.full(n + 1, inf)
        f_cur[k:] = cand[arg, np.arange(m)]
        back[k, k:] = arg + (k - 1)
        # k groups in all: the forward starts at k*q (NOTE [Exact grouping by dynamic programming])
        e_k = max(float(f_cur[n]), k * (cost.queue + cost.beta) + float(pc[n]))
        if e_k < best_e:
            best_e, best_k = e_k, k
        f_prev = f_cur
    ends: list[int] = []
    j = n
    for k in range(best_k, 0, -1):
        ends.append(j)
        j = int(back[k][j])
    ends.reverse()
    return Plan("optimal", tuple(ends), first_inference_time(cost, ends))


def brute_force(cost: CostModel) -> Plan:
    """The optimum by trying all 2^(n-1) groupings; for tests on small n."""
    n = cost.n
    if n > 16:
        raise ConfigError(f"brute force over {n} layers would try {2 ** (n - 1):,} groupings")
    best: tuple[float, tuple[int, ...]] | None = None
    for mask in itertools.product((False, True), repeat=n - 1):
        ends = tuple(i + 1 for i, cut in enumerate(mask) if cut) + (n,)
        e = first_inference_time(cost, ends)
        if best is None or e < best[0]:
            best = (e, ends)
    assert best is not None
    return Plan("brute_force", best[1], best[0])


def per_layer(cost: CostModel) -> Plan:
    ends = tuple(range(1, cost.n + 1))
    return Plan("per_layer", ends, first_inference_time(cost, ends))


def whole(cost: CostModel) -> Plan:
    return Plan("whole", (cost.n,), first_inference_time(cost, (cost.n,)))


def fixed(cost: CostModel, layer_bytes: Sequence[int], group_bytes: int) -> Plan:
    """Consecutive layers packed greedily into groups of about ``group_bytes`` each
    (Torpor's fixed-size groups); a layer larger than that is a group of its own."""
    if group_bytes <= 0:
        raise ConfigError(f"fixed group size must be positive, got {group_bytes}")
    if len(layer_bytes) != cost.n:
        raise ConfigError(f"{len(layer_bytes)} layer sizes for {cost.n} layers")
    ends: list[int] = []
    acc = 0
    for i, b in enumerate(layer_bytes):
        if acc and acc + b > group_bytes:
            ends.append(i)
            acc = 0
        acc += b
    ends.append(cost.n)
    return Plan("fixed", tuple(ends), first_inference_time(cost, ends))


def make_plan(strategy: str, cost: CostModel, layer_bytes: Sequence[int], group_bytes: int = 2 << 20) -> Plan:
    """Create a plan by strategy name; unknown names are rejected with the known ones."""
    if strategy == "optimal":
        return optimal(cost)
    if strategy == "per_layer":
        return per_layer(cost)
    if strategy == "whole":
        return whole(cost)
    if strategy == "fixed":
        return fixed(cost, layer_bytes, group_bytes)
    raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")


def _check_ends(ends: Sequence[int], n: int) -> None:
    if not ends or ends[-1] != n or any(b <= a for a, b in zip((0,) + tuple(ends), ends)):
        raise ConfigError(f"group ends {tuple(ends)} do not cut {n} layers into non-empty groups")
