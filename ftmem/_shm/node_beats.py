"""A node's heartbeats, in its shared memory: where a node holds several ranks, only one of
them (:attr:`NodeBeats.beater`, the node's lowest rank) beats on the job's store, for the
node, and the node's other ranks beat here, where the beater watches them and they watch it
(:mod:`ftmem._engine.failure_detector`). The store then serves a node's beats, not each
rank's: at 8 ranks a node, an eighth of the load.

Each rank's beat count is 8 bytes in a file of its own (``<node dir>/beats/<run>/<rank>``),
rewritten in place at each beat (no descriptor kept: a beat may run as the detector stops): a
read of a count being written sees the old count or the new, or at worst (a torn read) a
count that differs from the last, which only puts a silence off by a beat. A verdict that
ends the job is relayed to the node's ranks through a file (``verdict``: written whole under
the teller's name, then linked, so that the first told stays and a rank reads all of it or
none), and the ranks that sleep between their beats are woken to read it at once; each says
it read it (``read.<rank>``), and the beater counts them on the store. The files stay until
the job's memory is freed (``ftmem clean``, the job's finish), a few bytes a rank and run.
"""
from __future__ import annotations

import os
import struct
from typing import Callable, ContextManager, Optional, Sequence

from ftmem._common.identity import RankIdentity
from ftmem._shm.private import open_private, private_dir, read_private, write_first, write_new
from ftmem._shm.wakeups import Wakeups

_COUNT = struct.Struct("<Q")
_VERDICT, _READ = "verdict", "read"


class NodeBeats:
    """The beats of the node's ranks ``ranks`` under the run ``run`` (the detector's run id),
    in the node's directory ``node_dir``; ``rank`` is this one."""

    def __init__(self, node_dir: str, run: str, ranks: Sequence[int], rank: int):
        self.ranks, self.rank = list(ranks), rank
        self.beater = self.ranks[0]
        beats = os.path.join(node_dir, "beats")
        self._dir = os.path.join(beats, run)
        for directory in (beats, self._dir):
            private_dir(directory)
        self._wakeups = Wakeups(self._dir, "beats")

    @classmethod
    def of(cls, identity: RankIdentity, run: str) -> Optional["NodeBeats"]:
        """The beats of ``identity``'s node, where the node beats as one: None where it has one
        rank (it beats on the store for itself). An error (the node's directory unusable) is
        raised: a node's rank that beat on its own would be one its beater never saw beat."""
        if identity.ranks_per_node == 1:
            return None
        return cls(identity.node_dir, run, identity.node_ranks, identity.rank)

    def _path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    def beat(self, count: int) -> None:
        """Say this rank's count: its beats so far (a count that moves is a rank alive)."""
        fd = open_private(self._path(str(self.rank)), os.O_WRONLY | os.O_CREAT)
        try:
            os.pwrite(fd, _COUNT.pack(count), 0)
        finally:
            os.close(fd)

    def count(self, rank: int) -> Optional[int]:
        """``rank``'s count; None where it has not beaten yet."""
        try:
            fd = open_private(self._path(str(rank)), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, _COUNT.size, 0)
        finally:
            os.close(fd)
        return _COUNT.unpack(data)[0] if len(data) == _COUNT.size else None

    def tell(self, verdict: str) -> None:
        """Give the node's other ranks ``verdict`` (the first told stays), and wake them."""
        write_first(self._path(_VERDICT), verdict.encode(), self._path(f"{_VERDICT}.{self.rank}"))
        self._wakeups.wake(r for r in self.ranks if r != self.rank)

    def waiting(self) -> ContextManager[Callable[[float], None]]:
        """While this rank waits between its beats: a wait of at most some seconds, which a
        verdict told to the node ends (:class:`~ftmem._shm.wakeups.Wakeups`)."""
        return self._wakeups.waiting(self.rank)

    def read(self) -> None:
        """Say that this rank read the verdict (its beater counts it on the store)."""
        try:
            write_new(self._path(f"{_READ}.{self.rank}"), b"")
        except FileExistsError:  # (said already)
            pass

    def readers(self) -> int:
        """How many of the node's ranks said they read the verdict."""
        return sum(name.startswith(_READ + ".") for name in os.listdir(self._dir))

    def verdict(self) -> Optional[str]:
        """The verdict told to the node, if one was."""
        try:
            return read_private(self._path(_VERDICT)).decode()
        except FileNotFoundError:
            return None
