"""Failure detection: heartbeats between the job's ranks, so that a node that dies or hangs
ends the job at once and the launcher restarts it, instead of the survivors sitting in a
collective of the training until its timeout (NCCL's 10 minutes, gloo's 30). A hung node (a
stopped process, a GPU off the bus, a network partition) raises nothing by itself.

Each rank beats on the job's store (an ``add`` to a counter of its own) every
:func:`interval_s`, from a thread of its own: a slow step, a long flush, a main thread paused
in a debugger go on beating; a process stopped whole (SIGSTOP, gdb) or gone does not. Each
rank watches one other, the same local rank on the next node (:func:`watched_rank`), so that
every rank is watched from another host and the store serves a few operations per rank and
interval, whatever the job's size. A rank whose watched rank's counter has not moved for the
timeout puts its verdict on the store, a :class:`~ftmem._common.agreement.Decision` (the first
verdict holds), every rank reads it at its next beat, logs one line naming the node and ends its process with
:data:`EXIT_CODE`; the rank that put it there ends once the live ranks have read it (at most
two beats): its end may end the store (rank 0 serves it, where the launcher does not) and
break the others' collectives, and a rank that had not read the verdict would end on that,
not saying why. A store silent for the timeout that takes no new connection either (the host
that serves it is lost) ends the rank as well, and so does one where nothing listens any
more, at once (the process that served it ended: rank 0, under ``env://``; the job can make
no collective again). A failed beat is no verdict: the next one takes a new connection; and a
rank blames the rank it watches for the silence its own beats saw, so that a rank whose own
beats were held up blames nobody.

The beats go over a connection of the detector's own: a store client blocks every other use
of itself while one call waits (the framework's ``get`` of a key a slow rank has not set yet),
and that wait is no failure. A second thread judges, since a call to a stopped store blocks.

A rank says it left (its counter jumps by :data:`_LEFT`), and its silence after that is no
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
import os
import socket
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from ftmem._common import exit_status, threads
from ftmem._common.agreement import Decision
from ftmem._common.job_store import StoreGone, own_connection, store_name
from ftmem._common.logs import flush_logs, log, rank_error

# EX_TEMPFAIL: the job failed, and restarting it is the remedy (any code but 0 makes the
# launcher restart the job; this one tells a failure ftmem detected from a crash).
EXIT_CODE = 75
_LEFT = 1 << 40  # added to a rank's counter when it leaves: a count past it is no beat
REQUESTS_PER_BEAT = 3  # a beat's requests to the store: its own counter, the watched rank's, the verdict's key


def interval_s(timeout_s: float) -> float:
    """Seconds between two beats: a few beats per timeout, at most 5 s (a store's load)."""
    return min(5.0, max(0.2, timeout_s / 5))


def watched_rank(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank ``rank`` watches: its local rank's twin on the next node, else (one node) the next rank."""
    if world_size <= ranks_per_node:
        return (rank + 1) % world_size
    return (rank + ranks_per_node) % world_size


class FailureDetector:
    """This rank's heartbeat and its watch over another rank (see the module's doc)."""

    def __init__(self, connect: Callable[[], dist.Store], store_name: str, run: str, rank: int, world_size: int,
                 ranks_per_node: int, timeout_s: float):
        """``connect()`` makes a connection of the detector's own to the job's store."""
        self.rank, self.timeout_s, self.interval_s = rank, timeout_s, interval_s(timeout_s)
        self._world_size, self._ranks_per_node = world_size, ranks_per_node
        self._connect, self._store_name = connect, store_name
        self._store, self._key = connect(), f"ftmem/failure_detection/{run}/"
        self.watched = watched_rank(rank, world_size, ranks_per_node)
        self._pid = os.getpid()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        now = time.monotonic()
        self._publishing = False  # the judge puts a verdict on the store: it ends after the others read it
        # What the beats saw, read by the judge: guarded by _lock.
        self._answered = now  # the store's last answer
        self._moved = now  # when the watched rank's counter last moved (or the watch began)
        self._count: Optional[int] = None
        self._watched_host: Optional[str] = None
        self._gone: Optional[str] = None  # why the store is gone for good, once a beat found that
        self._store.set(self._key + f"host/{rank}", socket.gethostname())
        atexit.register(self._at_exit)
        for target, name in ((self._beat, "ftmem-heartbeat"), (self._judge, "ftmem-failure-judge")):
            threads.start(target, name)

    @classmethod
    def start(cls, timeout_s: Optional[float], run: str, rank: int, world_size: int,
              ranks_per_node: int) -> Optional["FailureDetector"]:
        """The detector of a rank of a job of ``world_size`` ranks (torch.distributed
        initialized); None where detection is off (``timeout_s`` None) or the job has one rank."""
        if timeout_s is None or world_size == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(lambda: own_connection(store, timeout_s), store_name(store), run, rank, world_size, ranks_per_node,
                   timeout_s)

    def stop(self) -> None:
        """This rank leaves: no more beats, and its silence is no failure (the job finished, or
        every rank was told to stop). A second call does nothing."""
        if self._stopped.is_set() or os.getpid() != self._pid:  # (a forked child exits with the parent's hooks)
            return
        self.fall_silent()
        try:
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
        own, watched = self._counter(self.rank), self._counter(self.watched)
        counted = False  # this rank among those that read the verdict (once, whatever fails after)
        while not self._stopped.is_set():
            try:
                self._store.add(own, 1)
                count = self._store.add(watched, 0)
                verdict = self._verdict_decision()
                if verdict.answered() and not counted:
                    said = verdict.answer()
                    counted = True
                    if self._publishing:
                        verdict.read()
                    else:
                        # Then at once, from this thread: the rank that put it there ends once it
                        # counted this read, and its end may fail this rank's collectives, whose
                        # error would end the process first, not saying why. (Where this process
                        # serves the store, the read waits, bounded, for the others' first.)
                        verdict.read(self._live())
                        return self._end(said)
                if self._watched_host is None and count > 0:  # it set its host before its first beat
                    self._watched_host = self._store.get(self._key + f"host/{self.watched}").decode()
            except Exception as e:  # a call that timed out, or a connection closed: the judge counts the silence
                log.debug("rank %d: a heartbeat failed (%s); the next one takes a new connection", self.rank, e)
                self._reconnect()
            else:
                now = time.monotonic()
                with self._lock:
                    self._answered = now
                    if count != self._count:
                        self._count, self._moved = count, now
            self._stopped.wait(self.interval_s)

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
        while not self._stopped.wait(self.interval_s / 2):
            now = time.monotonic()
            with self._lock:
                answered, moved, count = self._answered, self._moved, self._count
            if self._gone is not None:
                self._end(self._gone)
            if now - answered > self.timeout_s:
                if not self._store_answers():
                    self._end(f"{self._store_name} has not answered for {now - answered:.0f} s: the host that "
                              f"serves it is lost or hung")
                continue  # the beats go on over the new connection
            # The silence this rank's own beats saw: a rank whose beats were held up blames nobody.
            silent = answered - moved
            if (count is None or count < _LEFT) and silent > self.timeout_s:
                node = self.watched // self._ranks_per_node
                self._publishing = True
                verdict = self._publish(f"node {node} (host {self._watched_host or '?'}, rank {self.watched}) has not "
                                        f"answered for {silent:.0f} s (seen by rank {self.rank})")
                self._until_read()
                self._end(verdict)

    def _verdict_decision(self) -> Decision:
        """The job's verdict, on the beats' connection of the moment."""
        return Decision(self._store, self._key + "verdict", self.rank, self._world_size)

    def _publish(self, verdict: str) -> str:
        """Put ``verdict`` on the store for every rank; the verdict that holds there (an earlier
        one, another rank's, wins). Bounded: a store that does not take it leaves it this rank's."""
        held = [verdict]

        def put() -> None:
            held[0] = self._verdict_decision().propose(verdict)

        putter = threads.start(put, "ftmem-failure-verdict")
        putter.join(self.interval_s)
        return held[0]

    def _live(self) -> int:
        """The ranks that can read a verdict: all but the watched rank's node's."""
        return self._world_size - (1 if self._world_size <= self._ranks_per_node else self._ranks_per_node)

    def _until_read(self) -> None:
        """Until every live rank has read the verdict (at its next beat), at most two beats:
        all but the watched rank's node, where more are lost, the wait runs out and says so."""
        live, wait_s = self._live(), 2 * self.interval_s
        try:
            read = self._verdict_decision().until_read(live, wait_s)
        except Exception as e:  # the store went meanwhile: nobody else can read it now
            log.debug("rank %d: could not count the ranks that read the verdict (%s)", self.rank, e)
            return
        if read < live:
            rank_error(self.rank, "%d of the job's %d live ranks had not read the verdict after %.1f s (more ranks "
                       "lost, or stalled): they end on their own detector or on the failures this rank's end "
                       "causes", live - read, live, wait_s)

    def _end(self, verdict: str) -> None:
        if self._stopped.is_set():  # the rank left meanwhile (its engine closed)
            return
        rank_error(self.rank, "%s: ending this process (exit code %d) so that the launcher restarts the job at once "
                   "(\"ftmem.failure_detection\" sets the timeout of %.0f s, or turns this off)", verdict, EXIT_CODE,
                   self.timeout_s)
        flush_logs()
        os._exit(EXIT_CODE)
