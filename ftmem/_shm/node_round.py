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

import contextlib
import hashlib
import os
import shutil
import socket
import time
from typing import Callable, Iterator, Optional, Sequence

from ftmem._common.agreement import NodeRound
from ftmem._common.identity import RankIdentity
from ftmem._common.logs import log
from ftmem._shm.private import private_dir, read_private, write_new
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
        # The wake-up sockets' names: the same on every rank of the node, however it names the directory.
        self._wake_prefix = f"\0ftmem-round-{hashlib.sha256(os.path.realpath(self._dir).encode()).hexdigest()[:32]}"

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
        mine = self._path(f"{_ANSWER}.{self.rank}")
        write_new(mine, answer.encode())
        try:
            os.link(mine, self._path(_ANSWER))
        except FileExistsError:
            pass
        finally:
            os.unlink(mine)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            waker.setblocking(False)  # (a rank whose wake-ups queue up is awake: it reads the answer)
            for rank in self.ranks:
                if rank != self.rank:
                    try:
                        waker.sendto(b"!", self._wake_address(rank))
                    except OSError:  # not waiting (not come yet, or done): it reads the file when it looks
                        pass

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
        with self._woken() as woken:
            while True:
                answer = self.answer()
                if answer is None and meanwhile is not None and (answer := meanwhile()) is not None:
                    self.tell(answer)
                left = end - time.monotonic()
                if answer is not None or left <= 0:
                    return answer
                woken(min(left, LOOK_S if meanwhile is None else POLL_S))

    @contextlib.contextmanager
    def _woken(self) -> Iterator[Callable[[float], None]]:
        """While a rank waits: a wait of at most some seconds, which a teller's wake-up ends,
        through a socket of the rank's own (in the abstract namespace: no file, and the name's
        length is not a directory's). Where its name is taken (another process's), a sleep."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
            try:
                wake.bind(self._wake_address(self.rank))
            except OSError as e:
                log.debug("rank %d: no wake-up socket for its node's round (%s): it looks every %g s", self.rank, e,
                          POLL_S)
                yield lambda seconds: time.sleep(min(seconds, POLL_S))
                return

            def woken(seconds: float) -> None:
                wake.settimeout(seconds)
                try:
                    wake.recv(16)
                except socket.timeout:
                    pass
            yield woken

    def _wake_address(self, rank: int) -> str:
        """The abstract socket a rank of this node waits on, named by the round's directory."""
        return f"{self._wake_prefix}-{rank}"

    def done(self) -> None:
        """This rank has the answer; the node's last to say so takes the round's files away."""
        self._mark("read")
        try:
            every_rank_read = len(self._marked("read")) >= len(self.ranks)
        except FileNotFoundError:  # another last rank took them away meanwhile
            return
        if every_rank_read:
            shutil.rmtree(self._dir, ignore_errors=True)  # (two last ranks may both find them all)
