"""Failure detection: heartbeats between the job's ranks, so that a node that dies or hangs
ends the job at once and the launcher restarts it, instead of the survivors sitting in a
collective of the training until its timeout (NCCL's 10 minutes, gloo's 30). A hung node (a
stopped process, a GPU off the bus, a network partition) raises nothing by itself.

Each rank beats every :func:`interval_s`, from a thread of its own: a slow step, a long
flush, a main thread paused in a debugger go on beating; a process stopped whole (SIGSTOP,
gdb) or gone does not. A node of one rank beats on the job's store (an ``add`` to a counter
of its own), and its rank watches the next node's (:func:`watched_rank`), so that every rank
is watched from another host. A node of several ranks beats as one
(:class:`~ftmem._shm.node_beats.NodeBeats`): its lowest rank, the beater, beats on the store
and watches the next node's beater there; the node's other ranks beat in the node's shared
memory, where the beater watches them and each of them watches the beater. The store serves 3
requests per node and beat, whatever the job's size: a node's, not each rank's. A rank whose
watched rank has not beaten for the timeout puts its verdict on the store, a
:class:`~ftmem._common.agreement.Decision` (the first verdict holds); every beater reads it
at its next beat and tells its node, whose other ranks it wakes to read it, and counts those
that did among the verdict's readers (the store serves a node's reads too, not each rank's);
each logs one line naming the node and ends its process with :data:`EXIT_CODE`. The rank that
put it there ends once the live ranks have read it (at most three beats: the beaters' next,
and one more for a node's rank that was not woken and reads it at its own next beat): its end
may end the store (rank 0 serves it, where the launcher does not) and break the others'
collectives, and a rank that had not read the verdict would end on that, not saying why. A
store silent for the timeout that takes no new connection either (the host that serves it is
lost) ends the rank as well, and so does one where nothing listens any more, at once (the
process that served it ended: rank 0, under ``env://``; the job can make no collective
again). A failed beat is no verdict: the next one takes a new connection; and a rank blames
the rank it watches for the silence its own beats saw, so that a rank whose own beats were
held up blames nobody.

The beats go over a connection of the detector's own: a store client blocks every other use
of itself while one call waits (the framework's ``get`` of a key a slow rank has not set yet),
and that wait is no failure. A rank that beats on the store judges from a second thread, since
a call to a stopped store blocks, and that thread says the beater's beats to its node: a store
that stalls the beater's calls is the store's failure, which the beater names and tells its
node, not the beater's. A node's other ranks read files only, and judge in their beats' thread.

A rank says it left (its count jumps by :data:`_LEFT`), and its silence after that is no
failure, only where the job agreed that it finished (the engine's end of the job), at a
preemption of the whole job, or where its interpreter exits cleanly without having closed the
engine. A rank that ends because it failed (an uncaught exception, a non-zero ``sys.exit``:
:mod:`ftmem._common.exit_status`; a job that did not finish) falls silent instead: its watcher
reports it within the timeout, and the ranks that wait for it in a collective that never fails
by itself (NCCL's) end and restart. Keys carry the engine's run id, the same on every rank and
new at each start, so a store that outlives an attempt (torchrun's agent's) holds no verdict
of an earlier one.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from ftmem._common import exit_status, threads
from ftmem._common.agreement import Decision
from ftmem._common.identity import RankIdentity
from ftmem._common.job_store import StoreGone, own_connection, store_name
from ftmem._common.logs import flush_logs, log, rank_error
from ftmem._shm.node_beats import NodeBeats

# EX_TEMPFAIL: the job failed, and restarting it is the remedy (any code but 0 makes the
# launcher restart the job; this one tells a failure ftmem detected from a crash).
EXIT_CODE = 75
_LEFT = 1 << 40  # added to a rank's counter when it leaves: a count past it is no beat
_READERS_POLL_S = 0.01  # how often a beater counts its node's readers of the verdict, for a beat at most, once
REQUESTS_PER_BEAT = 3  # a beat's requests to the store: its own counter, the watched rank's, the verdict's key


def interval_s(timeout_s: float) -> float:
    """Seconds between two beats: a few beats per timeout, at most 5 s (a store's load)."""
    return min(5.0, max(0.2, timeout_s / 5))


def watched_rank(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank ``rank`` watches: its local rank's twin on the next node, else (one node) the next rank."""
    if world_size <= ranks_per_node:
        return (rank + 1) % world_size
    return (rank + ranks_per_node) % world_size


@dataclasses.dataclass
class _Watch:
    """What this rank's beats saw of a rank it watches (guarded by the detector's lock)."""
    count: Optional[int]  # its count, None before its first beat
    moved: float  # when its count last moved (or the watch began)
    seen: float  # when this rank last read its count: a rank whose own reads were held up blames nobody


class FailureDetector:
    """This rank's heartbeat and its watch over others (see the module's doc)."""

    def __init__(self, connect: Callable[[], dist.Store], store_name: str, run: str, rank: int, world_size: int,
                 ranks_per_node: int, timeout_s: float, node: Optional[NodeBeats] = None):
        """``connect()`` makes a connection of the detector's own to the job's store; ``node``,
        the node's beats where it beats as one."""
        self.rank, self.timeout_s, self.interval_s = rank, timeout_s, interval_s(timeout_s)
        self._world_size, self._ranks_per_node = world_size, ranks_per_node
        self._connect, self._store_name = connect, store_name
        self._store, self._key = connect(), f"ftmem/failure_detection/{run}/"
        self._node = node
        self.beats_on_the_store = node is None or rank == node.beater
        # Whom it watches: the rank whose counter on the store it reads (a node's beater reads the
        # next node's beater's), and the ranks of its own node whose beats it reads in the node's memory.
        self.watched: Optional[int] = None
        self._node_watched: list[int] = []
        if node is None:
            self.watched = watched_rank(rank, world_size, ranks_per_node)
        elif self.beats_on_the_store:
            self.watched = watched_rank(rank, world_size, ranks_per_node) if world_size > ranks_per_node else None
            self._node_watched = [r for r in node.ranks if r != rank]
        else:
            self._node_watched = [node.beater]
        self._pid = os.getpid()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        now = time.monotonic()
        self._publishing = False  # the judge puts a verdict on the store: it ends after the others read it
        # What the beats saw, read by the judge: guarded by _lock.
        self._answered = now  # the store's last answer
        self._watches = {r: _Watch(None, now, now) for r in self._node_watched + [self.watched] if r is not None}
        self._node_count = 0  # this rank's beats in the node's memory
        self._watched_host: Optional[str] = None
        self._gone: Optional[str] = None  # why the store is gone for good, once a beat found that
        atexit.register(self._at_exit)
        if self.beats_on_the_store:
            self._store.set(self._key + f"host/{rank}", socket.gethostname())  # (its watcher names it)
            for target, name in ((self._beat, "ftmem-heartbeat"), (self._judge, "ftmem-failure-judge")):
                threads.start(target, name)
        else:
            threads.start(self._beat_in_the_node, "ftmem-heartbeat")

    @classmethod
    def start(cls, timeout_s: Optional[float], run: str, identity: RankIdentity) -> Optional["FailureDetector"]:
        """The detector of ``identity``'s rank (torch.distributed initialized); None where
        detection is off (``timeout_s`` None) or the job has one rank."""
        if timeout_s is None or identity.world_size == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(lambda: own_connection(store, timeout_s), store_name(store), run, identity.rank,
                   identity.world_size, identity.ranks_per_node, timeout_s, NodeBeats.of(identity, run))

    def stop(self) -> None:
        """This rank leaves: no more beats, and its silence is no failure (the job finished, or
        every rank was told to stop). A second call does nothing."""
        if self._stopped.is_set() or os.getpid() != self._pid:  # (a forked child exits with the parent's hooks)
            return
        self.fall_silent()
        try:
            if self._node is not None:
                self._beat_in_the_node_s_memory(left=True)
            if self.beats_on_the_store:
                self._store.add(self._counter(self.rank), _LEFT)
        except Exception as e:  # the store is gone: the others' detectors end them anyway
            log.debug("rank %d: could not say it left (%s)", self.rank, e)

    def fall_silent(self) -> None:
        """This rank is ending as a failure: no more beats nor judging, and its silence is
        its watcher's to report."""
        self._stopped.set()
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        """The interpreter exits without the engine's end having said how: leaving if it exits
        cleanly, else a failure (:mod:`ftmem._common.exit_status`)."""
        if exit_status.failure() is None:
            self.stop()
        else:
            self.fall_silent()

    def _counter(self, rank: int) -> str:
        return self._key + f"alive/{rank}"

    def _beat(self) -> None:
        """The beats on the store: this rank's (its node's), its watch of the next node's
        beater, the verdict."""
        own = self._counter(self.rank)
        counted = False  # this rank among those that read the verdict (once, whatever fails after)
        while not self._stopped.is_set():
            try:
                self._store.add(own, 1)
                count = None if self.watched is None else self._store.add(self._counter(self.watched), 0)
                verdict = self._verdict_decision()
                if verdict.answered() and not counted:
                    said = verdict.answer()
                    counted = True
                    read = self._read_by_the_node(said)
                    if self._publishing:
                        verdict.read(count=read)
                    else:
                        # Then at once, from this thread: the rank that put it there ends once it
                        # counted this read, and its end may fail this rank's collectives, whose
                        # error would end the process first, not saying why. (Where this process
                        # serves the store, the read waits, bounded, for the others' first.)
                        verdict.read(self._live(), count=read)
                        return self._end(said)
                if self._watched_host is None and count:  # it set its host before its first beat
                    self._watched_host = self._store.get(self._key + f"host/{self.watched}").decode()
            except Exception as e:  # a call that timed out, or a connection closed: the judge counts the silence
                log.debug("rank %d: a heartbeat failed (%s); the next one takes a new connection", self.rank, e)
                self._reconnect()
            else:
                now = time.monotonic()
                with self._lock:
                    self._answered = now
                    if self.watched is not None:
                        self._saw(self.watched, count, now)
            self._stopped.wait(self.interval_s)

    def _beat_in_the_node(self) -> None:
        """The beats of a node's rank other than its beater: in the node's memory, where it
        watches its beater and reads the verdict its beater tells the node, woken to read it as
        it is told."""
        with self._node.waiting() as woken:
            while not self._stopped.is_set():
                self._beat_in_the_node_s_memory()
                try:
                    said = self._node.verdict()
                except OSError as e:  # (the node's directory gone: its silence is its beater's to see)
                    log.debug("rank %d: could not read its node's verdict (%s)", self.rank, e)
                    said = None
                if said is not None:
                    self._node.read()  # (its beater counts it on the store)
                    return self._end(said)
                self._look_at_the_node()
                self._judge_the_watched()
                woken(self.interval_s)

    def _read_by_the_node(self, verdict: str) -> int:
        """A beater tells its node the verdict and waits, a beat at most, for the node's other
        ranks to say they read it; how many of the node read it, this rank included (each
        counted on the store only once it has it: the verdict's watcher ends once they are)."""
        if self._node is None:
            return 1
        self._tell_the_node(verdict)
        with self._lock:  # those that can read it: not left, not silent (the verdict may be on one of them)
            others = sum(w.count is not None and w.count < _LEFT and w.seen - w.moved <= self.timeout_s
                         for r, w in self._watches.items() if r in self._node_watched)
        end = time.monotonic() + self.interval_s
        readers = 0
        while True:
            try:
                readers = self._node.readers()
            except OSError as e:
                log.debug("rank %d: could not count its node's readers of the verdict (%s)", self.rank, e)
            if readers >= others or time.monotonic() >= end:
                return 1 + readers
            time.sleep(_READERS_POLL_S)

    def _beat_in_the_node_s_memory(self, left: bool = False) -> None:
        """One beat in the node's memory, or (``left``) this rank's leaving. Under the lock: a
        beat written after the leaving would overwrite it, and the rank's silence then count."""
        with self._lock:
            try:
                if left:
                    self._node.beat(self._node_count + _LEFT)
                elif not self._stopped.is_set():
                    self._node_count += 1
                    self._node.beat(self._node_count)
            except OSError as e:  # a beat missed: its silence is its watchers' to judge
                log.debug("rank %d: a beat in its node's memory failed (%s)", self.rank, e)

    def _look_at_the_node(self) -> None:
        """Read the counts of the ranks of this node that this rank watches (none read where the
        node's memory fails: no silence is counted that this rank did not see)."""
        try:
            counts = [(r, self._node.count(r)) for r in self._node_watched]
        except OSError as e:
            log.debug("rank %d: could not read its node's beats (%s)", self.rank, e)
            return
        now = time.monotonic()
        with self._lock:
            for r, count in counts:
                self._saw(r, count, now)

    def _saw(self, rank: int, count: Optional[int], now: float) -> None:
        """``rank``'s count, read at ``now`` (under the lock)."""
        watch = self._watches[rank]
        if count != watch.count:
            watch.count, watch.moved = count, now
        watch.seen = now

    def _reconnect(self) -> bool:
        """A new connection for the beats; False (the old one kept) where the store takes none."""
        try:
            self._store = self._connect()
            return True
        except StoreGone as e:
            self._gone = str(e)
            return False
        except Exception as e:
            log.debug("rank %d: no new connection to %s (%s)", self.rank, self._store_name, e)
            return False

    def _store_answers(self) -> bool:
        """Whether the store takes a new connection within a beat (the beats then take it): the
        beats' own connection may be the one that is stuck (a call lost on the way), not the store."""
        took: list[bool] = []
        probe = threads.start(lambda: took.append(self._reconnect()), "ftmem-failure-probe")
        probe.join(self.interval_s)
        if not took or not took[0]:
            return False
        with self._lock:
            self._answered = time.monotonic()
        return True

    def _judge(self) -> None:
        """The judge of a rank that beats on the store: of the store, of the next node's beater,
        of the ranks of its own node (whose beats it reads here, saying its own to them: this
        thread never waits on the store for long)."""
        while not self._stopped.wait(self.interval_s / 2):
            if self._node is not None:
                self._beat_in_the_node_s_memory()
                self._look_at_the_node()
            now = time.monotonic()
            with self._lock:
                answered = self._answered
            if self._gone is not None:
                self._end(self._gone)
            if now - answered > self.timeout_s:
                if not self._store_answers():
                    self._end(f"{self._store_name} has not answered for {now - answered:.0f} s: the host that "
                              f"serves it is lost or hung")
                continue  # the beats go on over the new connection
            self._judge_the_watched()

    def _judge_the_watched(self) -> None:
        """Put the verdict on a watched rank silent for the timeout, and end."""
        with self._lock:
            silent = [(r, w.seen - w.moved) for r, w in self._watches.items()
                      if (w.count is None or w.count < _LEFT) and w.seen - w.moved > self.timeout_s]
        if not silent:
            return
        rank, silent_s = silent[0]
        host = self._watched_host if rank == self.watched else socket.gethostname()
        self._publishing = True
        verdict = self._publish(f"node {rank // self._ranks_per_node} (host {host or '?'}, rank {rank}) has not "
                                f"answered for {silent_s:.0f} s (seen by rank {self.rank})")
        self._until_read(rank)
        self._end(verdict)

    def _verdict_decision(self) -> Decision:
        """The job's verdict, on the beats' connection of the moment."""
        return Decision(self._store, self._key + "verdict", self.rank, self._world_size)

    def _publish(self, verdict: str) -> str:
        """Put ``verdict`` on the store for every rank; the verdict that holds there (an earlier
        one, another rank's, wins). Bounded: a store that does not take it leaves it this rank's."""
        held = [verdict]

        def put() -> None:
            try:
                held[0] = self._verdict_decision().propose(verdict)
            except Exception as e:  # the store went meanwhile
                log.debug("rank %d: could not put its verdict on the store (%s)", self.rank, e)

        threads.start(put, "ftmem-failure-verdict").join(self.interval_s)
        return held[0]

    def _live(self, silent: Optional[int] = None) -> int:
        """The ranks that can read a verdict (on ``silent``, where this rank puts it there): all
        but the silent rank's node's, which a lost node takes with it, and a node whose beater is
        silent puts its own verdict instead of reading one; where the silent rank is one of the
        ranks of its node that a beater watches, every rank but that one."""
        if self._node is not None and self.beats_on_the_store and silent in self._node.ranks:
            return self._world_size - 1
        if self._node is not None and silent == self._node.beater:
            return self._world_size - self._ranks_per_node
        return self._world_size - (1 if self._world_size <= self._ranks_per_node else self._ranks_per_node)

    def _until_read(self, silent: int) -> None:
        """Until every live rank has read the verdict on ``silent``, at most three beats (the
        beaters read it at their next beat, and count their nodes' readers within one more):
        where more are lost, the wait runs out and says so."""
        live, wait_s = self._live(silent), 3 * self.interval_s
        try:
            read = self._verdict_decision().until_read(live, wait_s)
        except Exception as e:  # the store went meanwhile: nobody else can read it now
            log.debug("rank %d: could not count the ranks that read the verdict (%s)", self.rank, e)
            return
        if read < live:
            rank_error(self.rank, "%d of the job's %d live ranks had not read the verdict after %.1f s (more ranks "
                       "lost, or stalled): they end on their own detector or on the failures this rank's end "
                       "causes", live - read, live, wait_s)

    def _tell_the_node(self, verdict: str) -> None:
        """A beater tells its node's other ranks the verdict, or why it ends: they end on it at
        their next beat. (Where the node's memory fails, they end on the beater's silence.)"""
        if self._node is None or not self.beats_on_the_store:
            return
        try:
            self._node.tell(verdict)
        except OSError as e:
            log.debug("rank %d: could not tell its node the verdict (%s)", self.rank, e)

    def _end(self, verdict: str) -> None:
        if self._stopped.is_set():  # the rank left meanwhile (its engine closed)
            return
        self._tell_the_node(verdict)
        rank_error(self.rank, "%s: ending this process (exit code %d) so that the launcher restarts the job at once "
                   "(\"ftmem.failure_detection\" sets the timeout of %.0f s, or turns this off)", verdict, EXIT_CODE,
                   self.timeout_s)
        flush_logs()
        os._exit(EXIT_CODE)
