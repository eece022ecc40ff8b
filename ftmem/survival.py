"""Survival planner: the probability that a snapshot version survives F simultaneous,
uniformly random node failures, for erasure coding in ftmem's groups and for m+1
full replicas in Gemini's group placement, exactly and by Monte Carlo.

Exact counting: a version survives iff every group loses few enough members. The
number of failure sets of size F that a placement survives is the coefficient of
x^F in the product, over groups, of sum_j c_j x^j, where c_j counts the survivable
ways to lose j members of that group; dividing by C(N, F) gives the probability.

* EC group of size s with m parity: c_j = C(s, j) for j <= m, else 0.
* Replication, Gemini's group placement (its Corollary 1 is the divisible case): groups
  of m+1 nodes hold each other's copies, a group is lost only when all m+1 fail. When
  N is not a multiple of m+1, the last group takes the remainder and uses ring
  placement: node i's copies live on i..i+m (mod s), lost when those m+1 all fail.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

from .config import ECConfig
from .errors import ConfigError
from .placement import ec_groups


def _poly_mul(a: list[int], b: list[int]) -> list[int]:
    out = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] += x * y
    return out


def _ring_survivable(size: int, copies: int) -> list[int]:
    """c_j for a ring of ``size`` nodes where each node's data lives on ``copies`` consecutive nodes."""
    counts = [0] * (size + 1)
    for j in range(size + 1):
        for failed in itertools.combinations(range(size), j):
            down = set(failed)
            if not any(all((i + d) % size in down for d in range(copies)) for i in range(size)):
                counts[j] += 1
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


def _probability(factors: list[list[int]], num_nodes: int, failures: int) -> Fraction:
    poly = [1]
    for f in factors:
        poly = _poly_mul(poly, f)
    good = poly[failures] if failures < len(poly) else 0
    return Fraction(good, math.comb(num_nodes, failures))


def _check(num_nodes: int, failures: int) -> None:
    if not 0 <= failures <= num_nodes:
        raise ConfigError(f"--failures must be between 0 and the node count {num_nodes}, got {failures}.")


def ec_survival(num_nodes: int, k: int, m: int, failures: int) -> Fraction:
    _check(num_nodes, failures)
    k, m = ECConfig(k=k, m=m).resolve(num_nodes)
    factors = [[math.comb(g.n, j) if j <= g.m else 0 for j in range(g.n + 1)] for g in ec_groups(num_nodes, k, m)]
    return _probability(factors, num_nodes, failures)


def replication_survival(num_nodes: int, m: int, failures: int) -> Fraction:
    _check(num_nodes, failures)
    factors = []
    for size, ring in replication_groups(num_nodes, m):
        factors.append(_ring_survivable(size, m + 1) if ring else [math.comb(size, j) for j in range(size)] + [0])
    return _probability(factors, num_nodes, failures)


def ec_overhead(num_nodes: int, k: int, m: int) -> float:
    """Parity bytes held per data byte, over the whole job (equal data per node)."""
    groups = ec_groups(num_nodes, k, m)
    return sum(g.m for g in groups) / sum(g.k for g in groups) if m else 0.0


def monte_carlo(num_nodes: int, k: int, m: int, failures: int, trials: int, seed: int = 0) -> tuple[float, float]:
    """(EC survival, replication survival) estimated from ``trials`` random failure sets."""
    rng = np.random.default_rng(seed)
    down = np.zeros((trials, num_nodes), dtype=bool)
    if failures:
        picks = np.argsort(rng.random((trials, num_nodes)), axis=1)[:, :failures]
        np.put_along_axis(down, picks, True, axis=1)
    ec_ok = np.ones(trials, dtype=bool)
    for g in ec_groups(num_nodes, k, m):
        ec_ok &= down[:, list(g.nodes)].sum(axis=1) <= g.m
    rep_ok = np.ones(trials, dtype=bool)
    start = 0
    for size, ring in replication_groups(num_nodes, m):
        block = down[:, start : start + size]
        if ring:
            for i in range(size):
                rep_ok &= ~block[:, [(i + d) % size for d in range(m + 1)]].all(axis=1)
        else:
            rep_ok &= ~block.all(axis=1)
        start += size
    return float(ec_ok.mean()), float(rep_ok.mean())


def mc_tolerance(p: float, trials: int, sigmas: float = 5.0) -> float:
    """How far a Monte Carlo estimate may sit from the exact p (sampling error), never below 1/trials."""
    return max(sigmas * math.sqrt(p * (1 - p) / trials), 1.0 / trials)


def loss_per_day(num_nodes: int, k: int, m: int, node_mtbf_hours: float, window_minutes: float) -> tuple[float, float]:
    """Probability per day of losing the in-memory version (EC, replication).

    Node failures are a Poisson process (rate 1/MTBF per node); failures that fall
    into one recovery window count as simultaneous.
    """
    lam = num_nodes * (window_minutes / 60.0) / node_mtbf_hours
    windows = 24 * 60 / window_minutes
    out = []
    for survive in (lambda f: ec_survival(num_nodes, k, m, f), lambda f: replication_survival(num_nodes, m, f)):
        lost = sum(math.exp(-lam) * lam**f / math.factorial(f) * float(1 - survive(f)) for f in range(num_nodes + 1))
        out.append(1 - (1 - lost) ** windows)
    return out[0], out[1]
