"""One answer that every rank of the job takes alike, decided once on the job's store.

A rank that decides alone (to free the job's memory, to flush at a preemption) while another
decides otherwise leaves the job split. Here the first answer put on the store holds for
every rank (``compare_set``). Each rank says it came (so that a wait that runs out names the
ranks that did not), and counts itself among the readers once it has the answer: the rank
whose process serves the store (rank 0 under the deepspeed launcher and ``env://``; torchrun's
agent serves it otherwise) ends only once the others have read it, or :data:`READ_WAIT_S`
passed, since the store ends with that process.

Every call waits a bounded time, on a connection of its own
(:func:`ftmem._common.job_store.own_connection`): the training's calls on the default client
never hold it up, and a store that is gone fails it at once. The keys live under a prefix of
the caller's that is new for each decision of each run, so that a store that outlives an
attempt (torchrun's agent's) holds no answer of an earlier one.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ftmem._common.job_store import own_connection, served_here, until_counted

READ_WAIT_S = 2.0  # for the others to read the answer, where this process serves the store
_AGREED = "agreed"


class Decision:
    """One decision among ``world_size`` ranks, under ``prefix`` on the job's ``store``."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int, wait_s: float):
        """Each call on the store waits at most ``wait_s``."""
        self.rank, self.world_size = rank, world_size
        #: this process serves the store, which ends with it
        self.serves_the_store = served_here(store)
        self._store = own_connection(store, wait_s)
        self._key = prefix.rstrip("/") + "/"

    def arrive(self) -> int:
        """Say that this rank came; how many ranks have, this one included."""
        self._store.set(self._key + f"arrived/{self.rank}", b"")
        return self._store.add(self._key + "arrivals", 1)

    def arrivals(self) -> int:
        """How many ranks have come."""
        return self._store.add(self._key + "arrivals", 0)

    def answered(self) -> bool:
        return self._store.check([self._key + "answer"])

    def missing(self) -> list[int]:
        """The ranks that have not come."""
        return [r for r in range(self.world_size) if not self._store.check([self._key + f"arrived/{r}"])]

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
        return self._store.get(self._key + "answer").decode()

    def read(self, live: int) -> int:
        """Count this rank among those that read the answer; where this process serves the
        store, wait until ``live`` ranks have (at most READ_WAIT_S). How many had."""
        read = self._store.add(self._key + "read", 1)
        if self.serves_the_store and read < live:
            read = until_counted(self._store, self._key + "read", live, READ_WAIT_S)
        return read


def unanimous(store: Optional[dist.Store], prefix: str, rank: int, world_size: int, objection: Optional[str],
              wait_s: float) -> Optional[str]:
    """None if every rank comes within ``wait_s`` without an objection; else the objection
    that holds for every rank: the first one put (``rank R: <objection>``), or the ranks that
    did not come. A rank with an objection does not wait for the others: its answer is known.
    ``store`` None: one rank alone."""
    if store is None or world_size == 1:
        return None if objection is None else f"rank {rank}: {objection}"
    decision = Decision(store, prefix, rank, world_size, wait_s)
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
