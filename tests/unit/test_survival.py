import itertools
import json
import math
from fractions import Fraction

import pytest

from harness.common import run_cli
from ftmem.errors import ConfigError
from ftmem._ec.placement import ec_groups
from ftmem._ec.survival import (MAX_DRAWS, MAX_FAILURES, _ring_survivable, ec_overhead, ec_survival, loss_per_day,
                            mc_tolerance, monte_carlo, replication_groups, replication_survival)


def test_groups_never_put_two_members_on_one_node_and_absorb_leftovers():
    groups = ec_groups(11, 2, 1)
    assert [g.nodes for g in groups] == [(0, 1, 2, 9), (3, 4, 5, 10), (6, 7, 8)]
    assert all(len(set(g.nodes)) == g.n for g in groups)
    assert sorted(n for g in groups for n in g.nodes) == list(range(11))
    assert [(g.k, g.m) for g in groups] == [(3, 1), (3, 1), (2, 1)]


@pytest.mark.parametrize("n_nodes, k, m", [(3, 2, 1), (4, 2, 2), (6, 4, 2), (7, 3, 2)])
def test_parity_rotates_over_all_members(n_nodes, k, m):
    """Every member contributes each of its k pieces to one stripe, holds m parity
    pieces, and no stripe's parity sits on a member that contributes data to it."""
    for g in ec_groups(n_nodes, k, m):
        held = {pos: g.parity_held(pos) for pos in range(g.n)}
        assert all(len(h) == g.m for h in held.values())
        for stripe in range(g.n):
            assert not set(g.data_members(stripe)) & set(g.parity_members(stripe))
            assert all((stripe, q) in held[pos] for q, pos in enumerate(g.parity_members(stripe)))
        for pos in range(g.n):
            stripes = [g.stripe_of_piece(pos, p) for p in range(g.k)]
            assert sorted(stripes) == sorted(s for s in range(g.n) if pos in g.data_members(s))


@pytest.mark.parametrize("groups, k, m", [(1, 2, 1), (3, 2, 1), (2, 4, 2), (4, 3, 1), (5, 6, 3)])
def test_ec_matches_the_closed_form(groups, k, m):
    n = k + m
    nodes = groups * n
    assert ec_survival(nodes, k, m, m) == 1  # any m failures anywhere are survivable
    # m+1 failures are fatal exactly when all fall into one group.
    expected = 1 - groups * math.comb(n, m + 1) / math.comb(nodes, m + 1)
    assert abs(float(ec_survival(nodes, k, m, m + 1)) - expected) < 1e-9


@pytest.mark.parametrize("nodes, m", [(6, 1), (12, 2), (16, 3)])
def test_replication_matches_gemini_group_placement(nodes, m):
    # Gemini, Corollary 1 (N divisible by m+1): lost only when a whole group of m+1 fails.
    expected = 1 - (nodes // (m + 1)) / math.comb(nodes, m + 1)
    assert abs(float(replication_survival(nodes, m, m + 1)) - expected) < 1e-9
    assert replication_survival(nodes, m, m) == 1


def test_mixed_placement_ring_group():
    # 5 nodes, 2 copies: one pair plus a ring of 3; any 2 failures inside the ring are adjacent.
    lost_sets = 1 + 3  # the pair, or any 2 of the ring
    assert replication_survival(5, 1, 2) == 1 - Fraction(lost_sets, math.comb(5, 2))


@pytest.mark.parametrize("size, copies", [(3, 2), (5, 3), (7, 4), (9, 5)])
def test_ring_counts_match_enumerating_every_failure_set(size, copies):
    lost_never = [sum(1 for down in itertools.combinations(range(size), j)
                      if not any(all((i + d) % size in down for d in range(copies)) for i in range(size)))
                  for j in range(size + 1)]
    assert _ring_survivable(size, copies, size) == lost_never
    assert _ring_survivable(size, copies, 2) == lost_never[:3]  # only what is asked for


def test_loss_per_day_is_the_poisson_sum_over_every_failure_count():
    nodes, k, m, mtbf, window = 9, 2, 1, 50.0, 30.0
    lam, windows = nodes * window / 60 / mtbf, 24 * 60 / window
    for got, survive in zip(loss_per_day(nodes, k, m, mtbf, window),
                            (lambda f: ec_survival(nodes, k, m, f), lambda f: replication_survival(nodes, m, f))):
        lost = sum(math.exp(-lam) * lam**f / math.factorial(f) * float(1 - survive(f)) for f in range(nodes + 1))
        assert got == pytest.approx(1 - (1 - lost) ** windows, rel=1e-6)


def test_large_jobs_are_counted_fast_and_bounds_are_refused_with_the_reason():
    # 1 - P(survive) for F=2: the pairs inside one group among all pairs.
    assert ec_survival(999_999, 2, 1, 2) == 1 - Fraction(333_333 * 3, math.comb(999_999, 2))
    assert replication_groups(1_000_000, 1) == [(2, False)] * 500_000
    with pytest.raises(ConfigError, match=f"at most {MAX_FAILURES} simultaneous failures"):
        ec_survival(1000, 2, 1, MAX_FAILURES + 1)
    with pytest.raises(ConfigError, match="Lower --trials"):
        monte_carlo(1000, 2, 1, 10, MAX_DRAWS // 10 + 1)
    with pytest.raises(ConfigError, match="beyond what this planner counts exactly"):
        loss_per_day(100_000, 2, 1, 1.0, 60.0)  # 100,000 failures expected per window


@pytest.mark.parametrize("nodes, k, m, f", [(9, 2, 1, 2), (12, 4, 2, 3), (7, 2, 1, 3), (10, 3, 2, 4),
                                            (11, 2, 2, 8)])  # most nodes fail: the survivors are drawn
def test_monte_carlo_agrees_within_sampling_error(nodes, k, m, f):
    trials = 100_000
    mc_ec, mc_rep = monte_carlo(nodes, k, m, f, trials, seed=1)
    ec, rep = float(ec_survival(nodes, k, m, f)), float(replication_survival(nodes, m, f))
    assert abs(mc_ec - ec) <= mc_tolerance(ec, trials)
    assert abs(mc_rep - rep) <= mc_tolerance(rep, trials)


def test_overhead_is_m_over_k_or_less():
    assert ec_overhead(6, 2, 1) == 0.5
    assert ec_overhead(12, 4, 2) == 0.5
    assert ec_overhead(8, 4, 2) == 2 / 6  # one group of 8: the leftovers add data members
    assert ec_overhead(7, 2, 1) < 0.5


def test_impossible_requests_are_refused():
    with pytest.raises(ConfigError, match="needs groups of 5 nodes"):
        ec_survival(4, 3, 2, 1)
    with pytest.raises(ConfigError, match="between 0 and the node count"):
        ec_survival(4, 2, 1, 5)


def test_cli_json_and_table():
    out = run_cli("survival", "--nodes", "6", "--k", "2", "--m", "1", "--failures", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"nodes": 6, "k": 2, "m": 1, "failures": 2, "ec": 0.6, "replication": 0.8}
    table = run_cli("survival", "--nodes", "8", "--k", "2", "--m", "2", "--trials", "2000")
    assert table.returncode == 0 and "per day" in table.stdout and "overhead 1.000x" in table.stdout
    bad = run_cli("survival", "--nodes", "3", "--k", "2", "--m", "2", "--failures", "1")
    assert bad.returncode == 2 and "needs groups of 4 nodes" in bad.stderr
