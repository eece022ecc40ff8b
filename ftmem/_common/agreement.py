"""The one way ranks agree through the job's store: a :class:`Decision`.

A rank that decides alone (to free the job's memory, to flush at a preemption, to end on a
silent node, to go into a collective some ranks may never join) while another decides
otherwise leaves the job split. A decision is a few keys under a prefix of its own:

* each rank says it came (``arrive``), so that a wait that runs out names the ranks that did
  not (``missing``);
* the first answer put holds for every rank (``propose``: ``compare_set``), whenever a rank
  comes, so that a rank late to a decision taken without it follows it too;
* each rank counts itself among the readers once it has the answer (``read``), so that a rank
  whose end would end the store (its process serves it: rank 0 under the deepspeed launcher and
  ``env://``; torchrun's agent serves it otherwise) or the others' collectives can wait until
  they have read it (``until_read``), bounded, rather than leave them to find only that the store
  is gone.

Every wait is bounded by the caller, and names who did not come. The prefix must be new for
each decision: under a run's id (new at each start of the engine, the same on every rank) on a
connection of the caller's own (:func:`~ftmem._common.job_store.own_connection`: outside the
prefixes a launcher adds per attempt), or a counter's on the default store, whose prefix is the
attempt's. Stale keys of an earlier attempt are never read.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

from ftmem._common.job_store import served_here, until_counted

# How long a rank whose process serves the store waits for the others to read an answer
# before its process ends (and the store with it): they poll every beat or 50 ms.
READ_WAIT_S = 2.0
# A rank's requests in a decision it waits for: its arrival (2), the wait, the answer, its read.
# The rank that answers makes 4: its arrival, the answer, its read.
REQUESTS_PER_DECISION = 5
_AGREED = "agreed"


class Decision:
    """One decision of the ranks ``ranks`` (all ``world_size`` of the job by default) under
    ``prefix`` on ``store``; ``rank`` is this one."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int,
                 ranks: Optional[Sequence[int]] = None):
        self.rank, self.world_size = rank, world_size
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        self._store, self._key = store, prefix.rstrip("/") + "/"

    @functools.cached_property
    def serves_the_store(self) -> bool:
        """This process serves the store, which ends with it (read off /proc once, where asked)."""
        return served_here(self._store)

    def arrive(self) -> int:
        """Say that this rank came; how many ranks have, this one included."""
        self._store.set(self._key + f"arrived/{self.rank}", b"")
        return self._store.add(self._key + "arrivals", 1)

    def arrivals(self) -> int:
        """How many ranks have come."""
        return self._store.add(self._key + "arrivals", 0)

    def missing(self) -> list[int]:
        """The ranks that have not come (this one aside)."""
        return [r for r in self.ranks if r != self.rank and not self._store.check([self._key + f"arrived/{r}"])]

    def answered(self) -> bool:
        return self._store.check([self._key + "answer"])

    def answer(self) -> str:
        """The answer that holds (one must)."""
        return self._store.get(self._key + "answer").decode()

    def propose(self, answer: str) -> str:
        """The answer that holds: ``answer``, unless another was put first."""
        return self._store.compare_set(self._key + "answer", b"", answer.encode()).decode()

    def wait(self, wait_s: float) -> Optional[str]:
        """The answer, once one holds, within ``wait_s`` (None: none came by then)."""
        try:
            self._store.wait([self._key + "answer"], timedelta(seconds=wait_s))
        except RuntimeError:  # the wait ran out (DistStoreError); a store gone fails the check too
            if not self.answered():
                return None
        return self.answer()

    def read(self, live: Optional[int] = None) -> int:
        """Count this rank among those that read the answer; where this process serves the
        store and ``live`` ranks are to read it, wait until they have (at most READ_WAIT_S),
        since the store ends with this process. How many had read it."""
        read = self._store.add(self._key + "read", 1)
        if live is not None and self.serves_the_store and read < live:
            read = self.until_read(live, READ_WAIT_S)
        return read

    def until_read(self, live: int, wait_s: float) -> int:
        """Until ``live`` ranks have read the answer, at most ``wait_s``; how many had."""
        return until_counted(self._store, self._key + "read", live, wait_s)

    def forget(self) -> None:
        """Take the decision's keys off the store (every rank is done with it)."""
        for key in [f"arrived/{r}" for r in self.ranks] + ["arrivals", "answer", "read"]:
            self._store.delete_key(self._key + key)


def unanimous(connection: Optional[dist.Store], prefix: str, rank: int, world_size: int, objection: Optional[str],
              wait_s: float) -> Optional[str]:
    """None if every rank comes within ``wait_s`` without an objection; else the objection
    that holds for every rank: the first one put (``rank R: <objection>``), or the ranks that
    did not come. A rank with an objection does not wait for the others: its answer is known.
    On ``connection``, this rank's own to the job's store (None: one rank alone;
    :class:`~ftmem._common.job_store.StandingConnection`), under ``prefix`` (the run's)."""
    if connection is None or world_size == 1:
        return None if objection is None else f"rank {rank}: {objection}"
    decision = Decision(connection, prefix, rank, world_size)
    came = decision.arrive()
    if objection is not None:
        held = decision.propose(f"rank {rank}: {objection}")
    elif came == world_size:
        held = decision.propose(_AGREED)
    else:
        held = decision.wait(wait_s)
        if held is None:
            held = decision.propose(f"ranks {decision.missing()} did not come within {wait_s:g} s")
    decision.read(world_size)
    return None if held == _AGREED else held
