"""Choosing a version to give back, and checking what a rebuild gives: the steps the restore
of this job's version (:mod:`ftmem._engine.restore`, out of the ranks' own slots) and the
adoption of an older world's (:mod:`ftmem._engine.elastic`, out of the old ranks' slots)
take alike, each from its source.

A version is chosen by :func:`ftmem._ec.protect.plan_recovery` from what every rank holds,
then its bytes are checked against the checksums their writers took; a damaged copy counts
as lost, on every rank alike, and the version is chosen again, until one is intact or none
is left. A rank rebuilt from parity is taken only where the rebuilt bytes match the checksum
its writer took.
"""
from __future__ import annotations

from typing import Callable, Optional

from ftmem._ec.protect import Geometry, Topology, plan_recovery
from ftmem._shm.slots import CommitRecord
from ftmem._state.checksum import data_checksum

# Every rank's held versions, by rank, as plan_recovery weighs them: {version: its data's length},
# {version: its parity's geometry}.
Held = tuple[list[dict[int, int]], list[dict[int, Geometry]]]


def choose_intact(topology: Topology, held: Callable[[], Held], damaged: Callable[[int, list[int]], bool],
                  version: Optional[int] = None, needed: Optional[set[int]] = None) -> Optional[tuple[int, list[int]]]:
    """The version to give back (``version``, else the newest the ranks ``needed`` can have,
    every rank by default) and the ranks lost from it, once no rank finds its bytes damaged;
    None where no rank holds a version. ``held()`` gives every rank's held versions as they
    are now; ``damaged(chosen, lost)`` checks the bytes the version needs, drops those that fail
    (so that the next ``held()`` lacks them), and says whether any rank dropped some (the
    same on every rank)."""
    while True:
        data, parity = held()
        decision = plan_recovery(topology, data, parity, version, needed)
        if decision is None:
            return None
        chosen, lost = decision
        if not damaged(chosen, lost):
            return chosen, lost


def rebuilt_problem(record: CommitRecord, raw) -> Optional[str]:
    """Why ``raw``, a rank's data rebuilt from parity, is not ``record``'s version as its writer
    wrote it (None: it is)."""
    if len(raw) != record.plan.nbytes or data_checksum(raw) != record.checksum:
        return "does not match the checksum its writer took"
    return None
