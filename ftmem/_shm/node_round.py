"""A job-wide decision's round within one node (:class:`~ftmem._common.agreement.NodeRound`),
through the node's shared memory: the node's ranks come one by one, the one that finds them
all come speaks for the node on the job's store (:class:`~ftmem._common.agreement.Decision`),
and the others take the answer from a file here instead of asking the store. The store then
serves a few requests per node, not per rank: at 8 ranks a node, an eighth of the load of a
decision every rank makes on its own.

A round is a directory of the node's (``<node dir>/rounds/<name>``) holding a file per rank
that came (``came/<rank>``), one per rank that has the answer (``read/<rank>``), the claims of
the node's first rank to come and of its speaker (each made exclusively: one rank claims it,
whichever tried first; the speaker's, among those that found every rank come) and the answer
(written whole under the teller's name, then linked to its own: the first told stays). The
last rank to read it takes the directory away; a rank that never comes (dead, hung) leaves it
to the job's memory, which ``ftmem clean`` and the job's finish free with the rest. Waits are
bounded by the caller. A waiting rank sleeps on a socket of its own, which the rank that tells
the answer wakes (the node's ranks share a network namespace, as they share memory), and looks
at the file every :data:`LOOK_S` besides: no rank polls the store, nor anything else many times
a second.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable, Optional, Sequence

from ftmem._common.agreement import NodeRound
from ftmem._common.identity import RankIdentity
from ftmem._common.logs import log
from ftmem._shm.private import private_dir, read_private, write_first, write_new
from ftmem._shm.wakeups import Wakeups
from ftmem.errors import UnsafeSharedMemory

POLL_S = 0.05  # how often a waiting rank asks its ``meanwhile``, or looks where it cannot be woken
LOOK_S = 1.0  # how often a waiting rank looks for the answer, should a wake-up not reach it
_FIRST, _SPEAKER, _ANSWER = "first", "speaker", "answer"


class SharedMemoryRound(NodeRound):
    """The round ``name`` (a path's worth of characters; ``/`` allowed) of the node's ranks
    ``ranks`` in the node's directory ``node_dir``; ``rank`` is this one."""

    def __init__(self, node_dir: str, name: str, ranks: Sequence[int], rank: int):
        self.ranks, self.rank, self.first = list(ranks), rank, False
        rounds = os.path.join(node_dir, "rounds")
        self._dir = os.path.join(rounds, name.strip("/").replace("/", "-"))
        for directory in (rounds, self._dir, self._path("came"), self._path("read")):
            private_dir(directory)
        self._wakeups = Wakeups(self._dir, "round")

    @classmethod
    def of(cls, identity: RankIdentity, name: str) -> Optional["SharedMemoryRound"]:
        """The round ``name`` of ``identity``'s node, where decisions of the whole job are made
        node by node: None where a node has one rank (it speaks for itself)."""
        if identity.ranks_per_node == 1:
            return None
        try:
            return cls(identity.node_dir, name, identity.node_ranks, identity.rank)
        except (OSError, UnsafeSharedMemory) as e:
            # Safe alone: the node's round never completes without this rank, so no rank is
            # counted twice; the node's others wait on the store once their speaker is late.
            log.warning("rank %d: no round of its node for %s (%s): it decides on the job's store alone",
                        identity.rank, name, e)
            return None

    def _path(self, *parts: str) -> str:
        return os.path.join(self._dir, *parts)

    def _marked(self, what: str) -> list[int]:
        return sorted(int(name) for name in os.listdir(self._path(what)) if name.isdigit())

    def _mark(self, what: str) -> None:
        try:
            write_new(self._path(what, str(self.rank)), b"")
        except FileExistsError:  # (a second call: the mark is there)
            pass

    def arrive(self) -> bool:
        """Say that this rank came; True for the one rank that speaks for the node (one that
        found every rank of the node come, the first to claim it)."""
        self.first = self._claim(_FIRST)
        self._mark("came")
        return len(self._marked("came")) >= len(self.ranks) and self._claim(_SPEAKER)

    def _claim(self, what: str) -> bool:
        """Whether this rank is the first to claim ``what`` (the others find it claimed)."""
        try:
            write_new(self._path(what), str(self.rank).encode())
            return True
        except FileExistsError:
            return False

    def missing(self) -> list[int]:
        """The node's ranks that have not come (this one aside)."""
        came = set(self._marked("came"))
        return [r for r in self.ranks if r != self.rank and r not in came]

    def tell(self, answer: str) -> None:
        """Give the node's ranks the answer (the one that holds on the job's store; where two
        ranks tell it, the first told stays, as on the store): written whole under this rank's
        name, then linked to the answer's, so that a rank reads all of it or none; then each
        waiting rank is woken."""
        write_first(self._path(_ANSWER), answer.encode(), self._path(f"{_ANSWER}.{self.rank}"))
        self._wakeups.wake(r for r in self.ranks if r != self.rank)

    def answer(self) -> Optional[str]:
        if not os.access(self._path(_ANSWER), os.F_OK):  # (no exception raised: ranks look often)
            return None
        return read_private(self._path(_ANSWER)).decode()

    def wait(self, wait_s: float, meanwhile: Optional[Callable[[], Optional[str]]] = None) -> Optional[str]:
        """The answer, once the node's speaker (or a rank that knew it) told it, within
        ``wait_s`` (None: none came by then). ``meanwhile`` is asked every :data:`POLL_S`: an
        answer it gives (a death it found, put on the job's store) ends the wait, told to the
        node. A rank waits woken by the teller, looking at the file every :data:`LOOK_S`
        besides, should the wake-up not reach it."""
        end = time.monotonic() + wait_s
        with self._wakeups.waiting(self.rank, POLL_S) as woken:
            while True:
                answer = self.answer()
                if answer is None and meanwhile is not None and (answer := meanwhile()) is not None:
                    self.tell(answer)
                left = end - time.monotonic()
                if answer is not None or left <= 0:
                    return answer
                woken(min(left, LOOK_S if meanwhile is None else POLL_S))

    def done(self) -> None:
        """This rank has the answer; the node's last to say so takes the round's files away."""
        self._mark("read")
        try:
            every_rank_read = len(self._marked("read")) >= len(self.ranks)
        except FileNotFoundError:  # another last rank took them away meanwhile
            return
        if every_rank_read:
            shutil.rmtree(self._dir, ignore_errors=True)  # (two last ranks may both find them all)
