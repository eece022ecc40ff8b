"""Survival planner: the probability that a snapshot version survives F simultaneous,
uniformly random node failures, for erasure coding in ftmem's groups and for m+1
full replicas in Gemini's group placement, exactly and by Monte Carlo.

Exact counting: a version survives iff every group loses few enough members. The
number of failure sets of size F that a placement survives is the coefficient of
x^F in the product, over groups, of sum_j c_j x^j, where c_j counts the survivable
ways to lose j members of that group; dividing by C(N, F) gives the probability.
Only the coefficients up to x^F are kept, and groups alike are multiplied in by
repeated squaring, so the count costs about F² log N operations, whatever N.

* EC group of size s with m parity: c_j = C(s, j) for j <= m, else 0.
* Replication, Gemini's group placement (its Corollary 1 is the divisible case): groups
  of m+1 nodes hold each other's copies, a group is lost only when all m+1 fail. When
  N is not a multiple of m+1, the last group takes the remainder and uses ring
  placement: node i's copies live on i..i+m (mod s), lost when those m+1 all fail.

The Monte Carlo draws F distinct failed nodes per trial and counts how many of them
fall into each group, so it costs about trials × F, not trials × N.

Bounds, so that every answer comes in seconds: at most MAX_NODES nodes, at most
MAX_FAILURES simultaneous failures, and at most MAX_DRAWS failed nodes drawn by one
Monte Carlo run (trials × F). Inputs beyond them are refused with the reason.
"""
from __future__ import annotations

import collections
import functools
import math
from fractions import Fraction

import numpy as np

from ftmem.config import ECConfig
from ftmem.errors import ConfigError
from ftmem._ec.placement import ECGroup, ec_groups

MAX_NODES = 1_000_000  # the groups are built node by node: about a second per million
MAX_FAILURES = 100  # the exact count multiplies polynomials of degree F
MAX_DRAWS = 20_000_000  # trials × F node ids in memory at once (160 MB)
LOSS_PRECISION = 1e-6  # relative error allowed in loss_per_day's truncated sum


def _poly_mul(a: list[int], b: list[int], up_to: int) -> list[int]:
    """The product of two polynomials (coefficient lists), without the terms above x^up_to."""
    out = [0] * min(len(a) + len(b) - 1, up_to + 1)
    for i, x in enumerate(a[: up_to + 1]):
        if x:
            for j, y in enumerate(b[: up_to + 1 - i]):
                out[i + j] += x * y
    return out


def _poly_pow(p: list[int], n: int, up_to: int) -> list[int]:
    result = [1]
    while n:
        if n & 1:
            result = _poly_mul(result, p, up_to)
        n >>= 1
        if n:
            p = _poly_mul(p, p, up_to)
    return result


def _survivable_sets(factors: collections.Counter, up_to: int) -> list[int]:
    """How many failure sets of each size 0..up_to the placement survives: the product
    of the groups' factors (c_j lists, counted by how many groups share one)."""
    poly = [1]
    for factor, count in factors.items():
        poly = _poly_mul(poly, _poly_pow(list(factor), count, up_to), up_to)
    return poly + [0] * (up_to + 1 - len(poly))


def _ring_survivable(size: int, copies: int, up_to: int) -> list[int]:
    """c_j, j = 0..up_to, for a ring of ``size`` nodes where each node's data lives on
    ``copies`` consecutive nodes: the sets of j failed nodes with no ``copies`` in a row,
    cyclically. Cut at its first live node, such a set is a leading run of a < copies
    failed nodes, the live node, then a line of size-a-1 nodes with no run of ``copies``
    whose trailing run b keeps a + b < copies."""
    # line[n][t][j]: lines of n nodes, j failed, no run of `copies`, ending in a run of t.
    line = [[[1]]]
    for n in range(1, size):
        grown = [[0] * min(n + 1, up_to + 1) for _ in range(min(n + 1, copies))]
        for t, by_failed in enumerate(line[-1]):
            for j, ways in enumerate(by_failed):
                grown[0][j] += ways  # the next node lives
                if t + 1 < copies and j + 1 <= up_to:
                    grown[t + 1][j + 1] += ways  # the next node fails
        line.append(grown)
    counts = [0] * (up_to + 1)
    for a in range(min(copies, up_to + 1)):
        for by_failed in line[size - a - 1][: copies - a]:
            for j, ways in enumerate(by_failed[: up_to + 1 - a]):
                counts[a + j] += ways
    return counts


def replication_groups(num_nodes: int, m: int) -> list[tuple[int, bool]]:
    """Gemini's mixed placement for m+1 copies: [(group size, uses ring placement)]."""
    copies = m + 1
    if copies > num_nodes:
        raise ConfigError(f"{copies} replicas need at least {copies} nodes, the job has {num_nodes}.")
    full, rest = divmod(num_nodes, copies)
    if rest == 0:
        return [(copies, False)] * full
    return [(copies, False)] * (full - 1) + [(copies + rest, True)]


def _check_nodes(num_nodes: int) -> None:
    if not 1 <= num_nodes <= MAX_NODES:
        raise ConfigError(f"the node count must be between 1 and {MAX_NODES:,}, got {num_nodes:,} (the planner builds "
                          f"the groups node by node; beyond that it would take minutes).")


def _check(num_nodes: int, failures: int) -> None:
    _check_nodes(num_nodes)
    if not 0 <= failures <= num_nodes:
        raise ConfigError(f"--failures must be between 0 and the node count {num_nodes}, got {failures}.")
    if failures > MAX_FAILURES:
        raise ConfigError(f"--failures {failures} is more than this planner counts exactly (at most {MAX_FAILURES} "
                          f"simultaneous failures: the count grows with their square).")


@functools.lru_cache(maxsize=4)
def _ec_groups(num_nodes: int, k: int, m: int) -> tuple[ECGroup, ...]:
    """ftmem's groups for the job (built once per command: a million nodes take seconds)."""
    _check_nodes(num_nodes)
    k, m = ECConfig(k=k, m=m).resolve(num_nodes)
    return tuple(ec_groups(num_nodes, k, m))


def _ec_counts(num_nodes: int, k: int, m: int, up_to: int) -> list[int]:
    shapes = collections.Counter((g.n, g.m) for g in _ec_groups(num_nodes, k, m))
    return _survivable_sets(collections.Counter({tuple(math.comb(n, j) if j <= gm else 0 for j in range(n + 1)): count
                                                 for (n, gm), count in shapes.items()}), up_to)


def _replication_counts(num_nodes: int, m: int, up_to: int) -> list[int]:
    factors = collections.Counter()
    for (size, ring), count in collections.Counter(replication_groups(num_nodes, m)).items():
        factor = _ring_survivable(size, m + 1, up_to) if ring else [math.comb(size, j) for j in range(size)] + [0]
        factors[tuple(factor)] += count
    return _survivable_sets(factors, up_to)


def ec_survival(num_nodes: int, k: int, m: int, failures: int) -> Fraction:
    _check(num_nodes, failures)
    return Fraction(_ec_counts(num_nodes, k, m, failures)[failures], math.comb(num_nodes, failures))


def replication_survival(num_nodes: int, m: int, failures: int) -> Fraction:
    _check(num_nodes, failures)
    return Fraction(_replication_counts(num_nodes, m, failures)[failures], math.comb(num_nodes, failures))


def ec_overhead(num_nodes: int, k: int, m: int) -> float:
    """Parity bytes held per data byte, over the whole job (equal data per node)."""
    groups = _ec_groups(num_nodes, k, m)
    return sum(g.m for g in groups) / sum(g.k for g in groups) if m else 0.0


def _distinct_draws(rng: np.random.Generator, population: int, count: int, trials: int) -> np.ndarray:
    """``trials`` sorted rows of ``count`` distinct values below ``population``, each row
    a uniformly random set: values drawn with replacement, and duplicates drawn again until
    none is left (with count <= population / 2, each redraw is new at least half the time)."""
    rows = rng.integers(0, population, (trials, count))
    while True:
        rows.sort(axis=1)
        repeated = np.zeros(rows.shape, dtype=bool)
        repeated[:, 1:] = rows[:, 1:] == rows[:, :-1]
        if not repeated.any():
            return rows
        rows[repeated] = rng.integers(0, population, int(repeated.sum()))


def _failed_nodes(rng: np.random.Generator, num_nodes: int, failures: int, trials: int) -> np.ndarray:
    """(trials, failures) distinct failed nodes per trial."""
    if 2 * failures <= num_nodes:
        return _distinct_draws(rng, num_nodes, failures, trials)
    # Most nodes fail: draw the survivors (here num_nodes < 2 * failures keeps this small).
    down = np.ones((trials, num_nodes), dtype=bool)
    np.put_along_axis(down, _distinct_draws(rng, num_nodes, num_nodes - failures, trials), False, axis=1)
    return np.nonzero(down)[1].reshape(trials, failures)


def _some_group_loses(group_of_failed: np.ndarray, more_than: int) -> np.ndarray:
    """Per trial, whether more than ``more_than`` failed nodes share a group (sorted ids:
    a run of more_than + 1 equal ids)."""
    ids = np.sort(group_of_failed, axis=1)
    run = more_than + 1
    if ids.shape[1] < run:
        return np.zeros(ids.shape[0], dtype=bool)
    return (ids[:, run - 1:] == ids[:, : ids.shape[1] - run + 1]).any(axis=1)


def monte_carlo(num_nodes: int, k: int, m: int, failures: int, trials: int, seed: int = 0) -> tuple[float, float]:
    """(EC survival, replication survival) estimated from ``trials`` random failure sets."""
    _check(num_nodes, failures)
    if not 1 <= trials * max(failures, 1) <= MAX_DRAWS:
        raise ConfigError(f"the Monte Carlo cross-check draws --trials x --failures failed nodes, at most "
                          f"{MAX_DRAWS:,} (and at least one trial); got {trials:,} x {failures}. Lower --trials.")
    rng = np.random.default_rng(seed)
    down = _failed_nodes(rng, num_nodes, failures, trials)

    groups = _ec_groups(num_nodes, k, m)
    ec_group_of = np.empty(num_nodes, dtype=np.int64)
    ec_group_of[np.fromiter((n for g in groups for n in g.nodes), np.int64, num_nodes)] = \
        np.repeat(np.arange(len(groups)), [g.n for g in groups])
    ec_lost = _some_group_loses(ec_group_of[down], groups[0].m)  # every group has the job's m

    copies, (ring_size, ring) = m + 1, replication_groups(num_nodes, m)[-1]
    ring_start = num_nodes - ring_size if ring else num_nodes
    # A plain group is lost when all its copies fail; ring nodes get ids of their own here.
    rep_group_of = np.concatenate([np.arange(ring_start) // copies, -1 - np.arange(num_nodes - ring_start)])
    rep_lost = _some_group_loses(rep_group_of[down], copies - 1)
    if ring:
        in_ring = np.zeros((trials, ring_size), dtype=bool)
        rows, cols = np.nonzero(down >= ring_start)
        in_ring[rows, down[rows, cols] - ring_start] = True
        for i in range(ring_size):
            rep_lost |= in_ring[:, [(i + d) % ring_size for d in range(copies)]].all(axis=1)
    return float(1 - ec_lost.mean()), float(1 - rep_lost.mean())


def mc_tolerance(p: float, trials: int, sigmas: float = 5.0) -> float:
    """How far a Monte Carlo estimate may sit from the exact p (sampling error), never below 1/trials."""
    return max(sigmas * math.sqrt(p * (1 - p) / trials), 1.0 / trials)


def _poisson(lam: float, f: int) -> float:
    return math.exp(-lam + f * math.log(lam) - math.lgamma(f + 1))


def _poisson_tail(lam: float, top: int) -> float:
    """An upper bound of P(X > top) for X ~ Poisson(lam) (a geometric bound of the terms)."""
    return _poisson(lam, top + 1) / (1 - lam / (top + 2)) if top + 2 > lam else 1.0


def loss_per_day(num_nodes: int, k: int, m: int, node_mtbf_hours: float, window_minutes: float) -> tuple[float, float]:
    """Probability per day of losing the in-memory version (EC, replication).

    Node failures are a Poisson process (rate 1/MTBF per node); failures that fall
    into one recovery window count as simultaneous. The sum over failure counts stops
    where the Poisson tail left out is below LOSS_PRECISION of the answer (losing is at
    most certain, so the tail bounds what is left out).
    """
    if not (0 < node_mtbf_hours < math.inf and 0 < window_minutes < math.inf):
        raise ConfigError(f"the node MTBF and the window must be positive numbers, got {node_mtbf_hours} h and "
                          f"{window_minutes} min.")
    _check_nodes(num_nodes)
    lam = num_nodes * (window_minutes / 60.0) / node_mtbf_hours
    windows = 24 * 60 / window_minutes
    top = min(num_nodes, MAX_FAILURES, 2 * (m + 1) + math.ceil(2 * lam) + 8)
    while True:
        lost = []
        for counts in (_ec_counts(num_nodes, k, m, top), _replication_counts(num_nodes, m, top)):
            lost.append(sum(_poisson(lam, f) * float(1 - Fraction(counts[f], math.comb(num_nodes, f)))
                            for f in range(top + 1)))
        if top == num_nodes or _poisson_tail(lam, top) <= LOSS_PRECISION * min(lost):
            break
        if top == MAX_FAILURES:
            raise ConfigError(
                f"{num_nodes:,} nodes with a node MTBF of {node_mtbf_hours:g} h expect {lam:.3g} failures per "
                f"{window_minutes:g} min window: the loss per day sums over more than {MAX_FAILURES} simultaneous "
                f"failures, beyond what this planner counts exactly. At that rate memory alone does not protect "
                f"the job; check the MTBF (--node-mtbf-hours) and the window (--window-minutes).")
        top = min(num_nodes, MAX_FAILURES, 2 * top)
    # 1 - (1 - p)^windows, kept accurate for the tiny p of a well-protected job.
    return tuple(-math.expm1(windows * math.log1p(-p)) if p < 1 else 1.0 for p in lost)
