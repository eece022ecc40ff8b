"""What the commit pipeline hands the persistent tier (:mod:`ftmem._disk.persist`), decided
alike on every rank: every ``persist.interval``-th protected version and every one a save asked
for, as a private, whole copy (the DP-sharded state gathered back), so that a flush never holds
a slot a newer save needs; never a second while one still runs on any rank (flushes never
queue: the version is skipped, and the log says so); and, at the job's end or a preemption, the
newest version at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ftmem._common.logs import job_info
from ftmem._disk.persist import Flusher
from ftmem._shm.slots import CommitRecord

# Copies a whole version out of its slot into private CPU memory (collective over the DP group).
CopyOut = Callable[[CommitRecord, torch.Tensor], Any]


@dataclass(frozen=True)
class FinalFlush:
    """What the flush at a preemption did, the same on every rank."""

    version: Optional[int]  # the version it was about (None: this run's memory held none, or the protection
    # stopped before the job chose one)
    written: bool  # False: it was on disk already, or could not be written
    problem: Optional[str] = None  # why it was not written


class FlushHandOver:
    """The persistent tier as the protection rounds see it (one per engine with a tier)."""

    def __init__(self, flusher: Flusher, copy_out: CopyOut):
        self.flusher, self._copy_out = flusher, copy_out

    def protected(self, record: CommitRecord, slot_bytes: torch.Tensor, asked: bool,
                  any_rank: Callable[[bool, str], bool]) -> None:
        """``record``'s version was protected (``asked``: a save it covers asked to be flushed):
        hand the flusher a private copy of it if one is due and no flush runs on any rank
        (``any_rank(yes, what)``: whether any rank says yes, a collective of the round)."""
        if not self.flusher.due(asked=asked):
            return
        if any_rank(self.flusher.busy(), f"the check that no flush still runs, before version {record.version}'s"):
            job_info("version %d not flushed: the previous flush is still running (the disk is slower than "
                     "persist.interval saves)", record.version)
            return
        self.flusher.start(record.version, self._copy_out(record, slot_bytes))

    def now(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        """Write ``record``'s version and wait for it (collective; the pipeline is idle).
        Raises if it could not be written."""
        self.flusher.start(record.version, self._copy_out(record, slot_bytes))
        self.flusher.wait()
        self.flusher.raise_failure()

    def final(self, version: Optional[int], record_of: Callable[[int], CommitRecord],
              bytes_of: Callable[[int], torch.Tensor]) -> FinalFlush:
        """The flush at a preemption, of ``version`` (every rank holds it whole; None: this run
        holds none), in step with every rank, after any flush still running."""
        if version is None:
            return FinalFlush(None, False)
        try:
            self.flusher.wait()  # a flush still running ends first: the tier's group is its
            if self.flusher.flushed_version == version:
                return FinalFlush(version, False)
            record = record_of(version)
            self.now(record, bytes_of(record.slot))
        except Exception as e:
            return FinalFlush(version, False, str(e))
        return FinalFlush(version, True)
