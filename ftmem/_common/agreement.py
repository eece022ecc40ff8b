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

A decision every rank of a large job makes at once (the job's end, a preemption's) may go node by
node (:class:`NodeRound`): the ranks of a node come in a round of the node's own, the one that
finds them all come speaks for them on the store (it arrives and reads for all of them), and the
others hear the answer from it. The store's load is then a few requests per node, not per rank.

Every wait is bounded by the caller, and names who did not come. The prefix must be new for
each decision: under a run's id (new at each start of the engine, the same on every rank) on a
connection of the caller's own (:func:`~ftmem._common.job_store.own_connection`: outside the
prefixes a launcher adds per attempt), or a counter's on the default store, whose prefix is the
attempt's. Stale keys of an earlier attempt are never read.
"""
from __future__ import annotations

import abc
import functools
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from ftmem._common.job_store import StandingConnection, no_answer, served_here, until_counted

# How long a rank whose process serves the store waits for the others to read an answer
# before its process ends (and the store with it): they poll every beat or 50 ms.
READ_WAIT_S = 2.0
# A rank's requests in a decision it waits for: its arrival (2), the wait, the answer, its read.
# The rank that answers makes 4: its arrival, the answer, its read.
REQUESTS_PER_DECISION = 5
# How long a rank waits for its node's speaker before it waits on the store itself: a node's
# ranks come within a second or two of each other (its agent signals them together; they end the
# same step), so a node still short of a rank by then has a dead or hung one, or a slow stage,
# and the answer may come from elsewhere (another rank's objection, a wait run out).
NODE_WAIT_S = 5.0
_AGREED = "agreed"


class Decision:
    """One decision of the ranks ``ranks`` (all ``world_size`` of the job by default) under
    ``prefix`` on ``store``; ``rank`` is this one."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int,
                 ranks: Optional[Sequence[int]] = None):
        self.rank, self.world_size = rank, world_size
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        self.store, self._key = store, prefix.rstrip("/") + "/"

    def over(self, store: dist.Store) -> "Decision":
        """This decision, on another connection to the job's store (a thread's own)."""
        return Decision(store, self._key, self.rank, self.world_size, self.ranks)

    @functools.cached_property
    def serves_the_store(self) -> bool:
        """This process serves the store, which ends with it (read off /proc once, where asked)."""
        return served_here(self.store)

    def arrive(self, ranks: Optional[Sequence[int]] = None) -> int:
        """Say that this rank came, or the ranks ``ranks`` (a node's, its speaker saying it for
        them); how many ranks have, these included."""
        ranks = [self.rank] if ranks is None else list(ranks)
        self.store.multi_set([self._key + f"arrived/{r}" for r in ranks], [b""] * len(ranks))
        return self.store.add(self._key + "arrivals", len(ranks))

    def arrivals(self) -> int:
        """How many ranks have come."""
        return self.store.add(self._key + "arrivals", 0)

    def missing(self) -> list[int]:
        """The ranks that have not come (this one aside)."""
        return [r for r in self.ranks if r != self.rank and not self.store.check([self._key + f"arrived/{r}"])]

    def answered(self) -> bool:
        return self.store.check([self._key + "answer"])

    def answer(self) -> str:
        """The answer that holds (one must)."""
        return self.store.get(self._key + "answer").decode()

    def propose(self, answer: str) -> str:
        """The answer that holds: ``answer``, unless another was put first."""
        return self.store.compare_set(self._key + "answer", b"", answer.encode()).decode()

    def wait(self, wait_s: float) -> Optional[str]:
        """The answer, once one holds, within ``wait_s`` (None: none came by then)."""
        try:
            self.store.wait([self._key + "answer"], timedelta(seconds=wait_s))
        except RuntimeError:  # the wait ran out (DistStoreError); a store gone fails the check too
            if not self.answered():
                return None
        return self.answer()

    def read(self, live: Optional[int] = None, count: int = 1) -> int:
        """Count this rank among those that read the answer (``count`` ranks: a node's, its
        speaker counting those it tells); where this process serves the store and ``live``
        ranks are to read it, wait until they have (at most READ_WAIT_S), since the store ends
        with this process. How many had read it."""
        read = self.store.add(self._key + "read", count)
        if live is not None and self.serves_the_store and read < live:
            read = self.until_read(live, READ_WAIT_S)
        return read

    def until_read(self, live: int, wait_s: float) -> int:
        """Until ``live`` ranks have read the answer, at most ``wait_s``; how many had."""
        return until_counted(self.store, self._key + "read", live, wait_s)

    def forget(self) -> None:
        """Take the decision's keys off the store (every rank is done with it)."""
        for key in [f"arrived/{r}" for r in self.ranks] + ["arrivals", "answer", "read"]:
            self.store.delete_key(self._key + key)


class NodeRound(abc.ABC):
    """A decision's round among the ranks of one node (:mod:`ftmem._shm.node_round`): the
    node's ranks come, one of them speaks for all of them on the job's store, and tells them
    the answer without the store, which then serves a few requests per node, not per rank."""

    ranks: list[int]  # the node's
    first: bool  # this rank was the first of its node to come: the one that watches meanwhile (for deaths)

    @abc.abstractmethod
    def arrive(self) -> bool:
        """Say that this rank came; True for the one rank that speaks for the node."""

    @abc.abstractmethod
    def missing(self) -> list[int]:
        """The node's ranks that have not come (this one aside)."""

    @abc.abstractmethod
    def tell(self, answer: str) -> None:
        """Give the node's ranks the answer."""

    @abc.abstractmethod
    def wait(self, wait_s: float, meanwhile: Optional[Callable[[], Optional[str]]] = None) -> Optional[str]:
        """The answer told, within ``wait_s`` (None: none was); an answer ``meanwhile`` gives
        (asked while waiting) ends the wait, and is told."""

    @abc.abstractmethod
    def done(self) -> None:
        """This rank has the answer."""


def unanimous(connection: Optional[StandingConnection], prefix: str, rank: int, world_size: int,
              objection: Optional[str], wait_s: float, node: Optional[NodeRound] = None) -> Optional[str]:
    """None if every rank comes within ``wait_s`` without an objection; else the objection
    that holds for every rank: the first one put (``rank R: <objection>``), or the ranks that
    did not come. A rank with an objection does not wait for the others: its answer is known.
    On ``connection``, this rank's own to the job's store (None: one rank alone), under
    ``prefix`` (the run's); through ``node``, this rank's node's round, where the ranks of a
    node decide together and only its speaker asks the store (where it has not come within
    :data:`NODE_WAIT_S`, the others wait on the store themselves)."""
    if connection is None or world_size == 1:
        return None if objection is None else f"rank {rank}: {objection}"
    decision, end = on_the_store(connection, wait_s, prefix, rank, world_size), time.monotonic() + wait_s
    if node is None:
        came = decision().arrive()
        held = decision().propose(f"rank {rank}: {objection}") if objection is not None else \
            _all_came(decision(), came, wait_s, decision().missing)
        decision().read(world_size)
        return None if held == _AGREED else held
    speaks, told = node.arrive(), None  # told: the answer the node's files gave this rank
    try:
        if objection is not None:
            held = decision().propose(f"rank {rank}: {objection}")
        elif speaks:
            held = _all_came(decision(), decision().arrive(node.ranks), wait_s, decision().missing)
        else:
            held = told = node.wait(min(wait_s, NODE_WAIT_S))
            if held is None:  # the node's speaker has not come: the answer may come from the store
                held = decision().wait(max(0.0, end - time.monotonic()))
            if held is None:
                held = _not_all_came(decision(), lambda: node.missing() or decision().missing(), wait_s)
    except Exception as e:  # the job's store failed: the node's ranks hear it as this one does
        node.tell(no_answer(e))
        raise
    if told is None:
        node.tell(held)
    # The speaker counts its node's ranks among the readers: the others read no store.
    if speaks:
        decision().read(world_size, len(node.ranks))
    elif connection.serves_the_store:
        decision().until_read(world_size, READ_WAIT_S)
    node.done()
    return None if held == _AGREED else held


def on_the_store(connection: StandingConnection, wait_s: float, prefix: str, rank: int,
                 world_size: int) -> Callable[[], Decision]:
    """The decision under ``prefix`` on ``connection``, taken (checked: one request) where it is
    first asked for: a rank that hears the answer from its node's speaker asks nothing of the
    store."""
    return functools.cache(lambda: Decision(connection.take(wait_s), prefix, rank, world_size))


def _all_came(decision: Decision, came: int, wait_s: float, missing: Callable[[], list[int]]) -> str:
    """The answer that holds once ``came`` ranks came: agreed where that is all of them, else
    the answer put within ``wait_s``, else the ranks that did not come (``missing()``)."""
    if came == decision.world_size:
        return decision.propose(_AGREED)
    held = decision.wait(wait_s)
    return held if held is not None else _not_all_came(decision, missing, wait_s)


def _not_all_came(decision: Decision, missing: Callable[[], list[int]], wait_s: float) -> str:
    return decision.propose(f"ranks {missing()} did not come within {wait_s:g} s")
