"""A preemption: the job told to stop (a scheduler's SIGTERM, then SIGKILL once a grace
period ends, and the machines gone), which memory does not survive. ftmem turns the warning
into a flush of the newest version to the persistent tier, then ends the process as the
signal would have.

How a rank hears it. A Python signal handler runs in the main thread, between two
bytecodes; a main thread inside a collective of the training whose peers have stopped
never gets there. So ftmem's handler only marks the signal as ftmem's, and what acts is a
thread of ftmem's, woken by the byte the interpreter's C-level handler writes to the wakeup
fd (:func:`signal.set_wakeup_fd`), whatever the main thread is doing; the handler also wakes
it itself, where an event loop took the wakeup fd over since. A signal that already has a
handler when the engine starts (the script's, Megatron's ``--exit-signal-handler``) is left
to it; one the application sets later holds the signal while it is set, and ftmem watches
again once it is put back.

Whose signal. A child the process forks (a ``multiprocessing`` worker, a DataLoader's) would
inherit the handler and the wakeup socket, and a signal to the child would wake the
parent's watch. So the signal is blocked in the thread that forks while it forks, and the
child, before it unblocks it, takes back the handler the signal had before ftmem and lets go
of the wakeup fd: a signal to the child does to it what it does without ftmem. A child
started by ``exec`` (``subprocess``, the spawn and forkserver methods) inherits neither.

A preemption or a teardown. torchrun also sends SIGTERM to a node's ranks when one of them
failed, and every node's agent then stops its ranks to restart the job: memory still holds
the newest version, and a flush would only delay the restart. A rank tells the two apart by
whether *every* rank of the job got the signal: each counts itself on the job's store, the
last one counted decides that every rank was, and the others wait on that answer's key (the
store answers the wait when the key is put: no rank polls it). A rank that finds a rank of its
host dead (the failure a teardown follows) decides it is none, which ends the wait for every
rank: the first decision on the store holds for all. The rank whose process serves the store
(rank 0 under the deepspeed launcher) waits for the others to read it, since the store ends
with that process. Every rank counted within
:func:`arrival_s`: a preemption.
Otherwise a teardown, or a part of the job stopping (its nodes' loss is what erasure coding is
for): nothing is flushed, and the process ends once the wait ends.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from ftmem._common import threads
from ftmem._common.agreement import NODE_WAIT_S, READ_WAIT_S, Decision, NodeRound, on_the_store
from ftmem._common.job_store import StandingConnection, no_answer, own_connection
from ftmem._common.identity import RankIdentity
from ftmem._common.logs import flush_logs, job_info, log, rank_info, rank_warning
from ftmem.config import PreemptionConfig
from ftmem._engine.commit import Committer
from ftmem._engine.failure_detector import FailureDetector
from ftmem._shm.jobs import node_dirs
from ftmem._shm.node_round import SharedMemoryRound
from ftmem._shm.smp import rank_owner

_GO = "go"  # the decision's answer where every rank was told to stop (else why this is no preemption)
POLL_S = 0.05


class Preemption:
    """One rank's side of a preemption, from the signal to the process's end: the watch of
    the signal (:class:`PreemptionWatch`), the job's decision whether it is a preemption of the
    whole job (:func:`whole_job_told`), and then the flush, which the commit pipeline's
    protection thread makes in step with the other ranks
    (:meth:`ftmem._engine.commit.Committer.flush_at_preemption`), each said in the log."""

    def __init__(self, config: PreemptionConfig, identity: RankIdentity, job_store: Optional[dist.Store], run: str,
                 committer: Committer, detector: Optional[FailureDetector]):
        self.config, self.identity = config, identity
        self._key = f"ftmem/preemption/{run}"
        self._committer, self._detector = committer, detector
        self._watch = PreemptionWatch.install(config, identity.rank, self._on_signal)
        # The decision's connection, made now: at the signal every rank would make one at once.
        self._connection = None
        if self._watch is not None and job_store is not None and identity.world_size > 1:
            self._connection = StandingConnection(job_store, arrival_s(config.grace_s))

    def uninstall(self) -> None:
        """The signal does what it did before the engine started."""
        if self._watch is not None:
            self._watch.uninstall()

    def _on_signal(self, signum: int, deadline: float) -> None:
        """The job may have been told to stop (``signum``; the process ends after this):
        if every rank was, the newest version goes to the persistent tier by ``deadline``."""
        name, rank = signal.Signals(signum).name, self.identity.rank
        handover = self._committer.handover
        if handover is None:
            job_info("%s: no persistent tier (\"ftmem.persist\") to flush to: what memory holds (%s) is lost if the "
                     "job's machines go", name, self._held())
            return
        try:
            wait_s = arrival_s(self.config.grace_s)
            why_not = whole_job_told(rank, self.identity.world_size, self._dead_here, wait_s,
                                     self._connection, self._key,
                                     SharedMemoryRound.of(self.identity, self._key))
        except Exception as e:  # the job's store went first (the rank that served it died)
            why_not = no_answer(e)
        if why_not is not None:  # training went on meanwhile: what memory holds now is what the restart finds
            rank_info(rank, "%s, not as a preemption of the whole job (%s): nothing is flushed; the process ends now, "
                      "and memory keeps %s for the restart", name, why_not, self._held())
            return
        if self._detector is not None:
            self._detector.stop()  # every rank ends within the grace, one after the other: no failure
        root = handover.flusher.root
        job_info("%s to every rank: the newest version goes to %s before the processes end (%d s of grace)", name,
                 root, self.config.grace_s)
        final = self._committer.flush_at_preemption(deadline)
        if final is None:
            return say_grace_ended(rank, self.config.grace_s)
        if final.written:
            job_info("flushed version %d to %s at %s: a relaunch resumes from it", final.version, root, name)
        elif final.problem is not None:  # no version if the protection stopped before the job chose one
            job_info("%s was not flushed at %s (%s)", "the newest version" if final.version is None else
                     f"version {final.version}", name, final.problem)
        else:
            job_info("at %s, version %s was on disk already", name, final.version)

    def _held(self) -> str:
        lag = self._committer.lag()
        return f"version {lag.newest_protected} protected, {lag.newest_saved} saved"

    def _dead_here(self) -> list[int]:
        """The job's ranks on this host whose processes died (a failure's teardown follows)."""
        rpn, dead = self.identity.ranks_per_node, []
        for node, directory in node_dirs(self.identity.shm_dir, self.identity.job):
            for rank in range(node * rpn, (node + 1) * rpn):
                owner = rank_owner(directory, rank)
                if rank != self.identity.rank and owner is not None and not owner[1]:
                    dead.append(rank)
        return dead


def arrival_s(grace_s: float) -> float:
    """How long a rank waits for every rank to be told to stop: a scheduler signals a job's
    ranks within a second or two; a teardown costs at most this."""
    return min(10.0, grace_s / 3)


def _noted(signum, frame) -> None:
    """ftmem's handler, in the main thread: its watch thread acts on the signal (woken here
    too, where the wakeup fd is no longer ftmem's). Without an active watch (its engine
    closed), the signal does what it does without ftmem."""
    watching = [w for w in _active if w.signum == signum]
    for watch in watching:
        watch.wake()
    if not watching:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_active: list["PreemptionWatch"] = []
_masks = threading.local()  # the forking thread's signal mask, while it forks


def _before_fork() -> None:
    signals = {w.signum for w in _active}
    if signals:
        _masks.before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def _after_fork_in_parent() -> None:
    before = getattr(_masks, "before", None)
    if before is not None:
        _masks.before = None
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _after_fork_in_child() -> None:
    """The child takes back what the signals did before ftmem; a signal it got meanwhile,
    blocked until now, then does that."""
    for watch in _active:
        watch.let_go()
    _active.clear()
    _after_fork_in_parent()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class PreemptionWatch:
    """Acts on one signal in a thread of its own: ``on_signal(signum, deadline)`` (monotonic
    seconds) runs within the grace, then the process ends by the signal's default action."""

    def __init__(self, signum: int, grace_s: float, rank: int, on_signal: Callable[[int, float], None],
                 reader: socket.socket, writer: socket.socket, previous):
        self.signum, self.grace_s, self.rank, self._previous = signum, grace_s, rank, previous
        self._on_signal, self._reader, self._writer = on_signal, reader, writer
        self._thread = threads.start(self._watch, "ftmem-preemption")

    @classmethod
    def install(cls, config: PreemptionConfig, rank: int,
                on_signal: Callable[[int, float], None]) -> Optional["PreemptionWatch"]:
        """The watch of ``config.signal`` (None where it is off, the signal has a handler
        already, or this is not the main thread, which alone may set handlers)."""
        if config.signal is None:
            return None
        signum = getattr(signal, config.signal)
        if threading.current_thread() is not threading.main_thread():
            rank_warning(rank, "ftmem started outside the main thread, where no signal handler can be set: a %s "
                         "ends the process without a flush", config.signal)
            return None
        current = signal.getsignal(signum)
        if current is _noted:  # another engine of this process watches it
            return None
        if current not in (signal.SIG_DFL, signal.default_int_handler):
            rank_info(rank, "%s has a handler of its own (%r): ftmem leaves the signal to it and does not flush on "
                      "it (\"ftmem.preemption.signal\" names another)", config.signal, current)
            return None
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # an event loop's (asyncio's): it keeps it, and wakes the main thread itself
            signal.set_wakeup_fd(previous)
            rank_info(rank, "the process's signal wakeup fd is an event loop's: ftmem hears %s when the main thread "
                      "runs Python, as the loop's own handlers do", config.signal)
        signal.signal(signum, _noted)
        watch = cls(signum, config.grace_s, rank, on_signal, reader, writer, current)
        _active.append(watch)
        return watch

    def uninstall(self) -> None:
        """The signal does what it did before the engine started (from the main thread; from
        another, :func:`_noted` does that when the signal comes)."""
        if self in _active:
            _active.remove(self)
        if threading.current_thread() is threading.main_thread():
            self.let_go()
        self._writer.close()  # the watch thread reads the end of the stream and returns

    def let_go(self) -> None:
        """Give the signal its handler from before ftmem, and the wakeup fd up (main thread)."""
        if signal.getsignal(self.signum) is _noted:
            signal.signal(self.signum, self._previous)
        with_ours = signal.set_wakeup_fd(-1)
        if with_ours not in (-1, self._writer.fileno()):
            signal.set_wakeup_fd(with_ours)

    def wake(self) -> None:
        """Wake the watch thread for the signal (ftmem's handler, in the main thread)."""
        try:
            self._writer.send(bytes([self.signum]))
        except OSError:  # its buffer is full (woken already), or the watch ended
            pass

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            # A handler the application set since holds the signal: the watch goes on, for the
            # time it puts ftmem's back.
            if self.signum in data and self in _active and signal.getsignal(self.signum) is _noted:
                return self._act()

    def _act(self) -> None:
        deadline = time.monotonic() + self.grace_s
        worker = threads.start(self._on_signal, "ftmem-preemption-flush", (self.signum, deadline))
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            say_grace_ended(self.rank, self.grace_s)
        end_process(self.signum)


def say_grace_ended(rank: int, grace_s: float) -> None:
    rank_warning(rank, "the %d s of grace (\"ftmem.preemption.grace_s\") ended before the flush did: the newest "
                 "checkpoint on disk stays what it was; ending the process", grace_s)


def end_process(signum: int) -> None:
    """End this process by ``signum``'s default action, from any thread (``signal.signal`` is
    the main thread's alone), so that the launcher sees the exit it would see without ftmem."""
    flush_logs()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal is pending for some thread; should none take it, exit as it would
    os._exit(128 + signum)


def whole_job_told(rank: int, world_size: int, dead_here: Callable[[], list[int]], wait_s: float,
                   connection: Optional[StandingConnection], key: str,
                   node: Optional[NodeRound] = None) -> Optional[str]:
    """None if every rank of the job was told to stop within ``wait_s`` (a preemption); else
    why this is none: ranks of this host dead (a teardown after a failure), or ranks that
    were not told. Decided once, on ``connection`` (this rank's own to the job's store, each
    call bounded by ``wait_s``; None with one rank) under ``key`` (the engine's run's: a store
    that outlives an attempt holds no decision of an earlier one;
    :mod:`ftmem._common.agreement`): every rank follows the first answer, so that no rank
    flushes while another has gone.

    The last rank told puts the answer; the others wait on its key, one request each, which
    the store answers when it is put: no rank polls the store, whose load is then a few
    requests per rank whatever the job's size and however far apart the signals come. Through
    ``node`` (this rank's node's round), the node's last rank told speaks for the node, and the
    others hear the answer from it, asking the store nothing (where it has not come within
    :data:`~ftmem._common.agreement.NODE_WAIT_S`, they wait on the store themselves). A rank of
    this host that dies meanwhile is watched for locally, and its watch puts the answer."""
    if world_size == 1:
        return None
    decision = on_the_store(connection, wait_s, key, rank, world_size)
    end = time.monotonic() + wait_s
    speaks, told = node is None or node.arrive(), None  # told: the answer the node's files gave this rank
    dead: list[int] = []
    try:
        if speaks:
            decided, dead = _decided(decision(), node, dead_here, end, wait_s)
        else:
            def teardown() -> Optional[str]:  # (asked while this rank waits for its node's speaker)
                dead[:] = dead_here()
                return decision().propose(_teardown(dead)) if dead else None

            # One rank of the node watches for its deaths meanwhile: the first to come.
            decided = told = node.wait(min(wait_s, NODE_WAIT_S), teardown if node.first else None)
            if decided is None:  # the node's speaker has not come: the answer may come from the store
                decided, dead = _awaited(decision(), dead_here, end, wait_s)
    except Exception as e:  # the job's store failed: the node's ranks hear it as this one does
        if node is not None:
            node.tell(no_answer(e))
        raise
    if node is not None and told is None:
        node.tell(decided)
    live = world_size - len(dead)
    if speaks:  # a node's speaker counts the node's ranks among the readers: the others read no store
        read = decision().read(live, 1 if node is None else len(node.ranks))
    else:
        read = decision().until_read(live, READ_WAIT_S) if connection.serves_the_store else live
    if node is not None:
        node.done()
    if connection.serves_the_store and read < live:
        rank_info(rank, "%d of the job's %d live ranks had not read the decision after %.0f s (not told to stop, "
                  "or dead on another host): the job's store, served by this process, ends with it all the "
                  "same", live - read, live, READ_WAIT_S)
    return None if decided == _GO else decided


def _decided(decision: Decision, node: Optional[NodeRound], dead_here: Callable[[], list[int]], end: float,
             wait_s: float) -> tuple[str, list[int]]:
    """The decision that holds, where this rank speaks for itself or its node (``node``); the
    ranks of this host found dead meanwhile."""
    if decision.arrive(None if node is None else node.ranks) >= decision.world_size:  # the last told: every rank was
        return decision.propose(_GO), []
    return _awaited(decision, dead_here, end, wait_s)


def _awaited(decision: Decision, dead_here: Callable[[], list[int]], end: float,
             wait_s: float) -> tuple[str, list[int]]:
    """The decision that holds once the others are told (by ``end``), or a rank of this host
    is found dead; the ranks found dead."""
    if dead := dead_here():
        return decision.propose(_teardown(dead)), dead
    # (The watch's answer goes over a connection of its own: this one waits.)
    watch = _DeathWatch(dead_here, lambda why: decision.over(own_connection(decision.store, wait_s)).propose(why))
    try:
        decided = decision.wait(max(0.0, end - time.monotonic()))
    finally:
        dead = watch.stop()
    return (decided if decided is not None else _not_told(decision, wait_s)), dead


def _not_told(decision: Decision, wait_s: float) -> str:
    return decision.propose(f"only {decision.arrivals()} of the job's {decision.world_size} ranks were told to stop "
                            f"within {wait_s:.1f} s")


def _teardown(dead: list[int]) -> str:
    return f"rank(s) {dead} of this host had died first, as in a teardown after a failure"


class _DeathWatch:
    """While a rank waits for the others to be told, a thread that looks every POLL_S for a
    rank of this host that died (:class:`Preemption`'s ``dead_here``: shared memory, not the
    store) and, finding one, puts the teardown's answer (``propose``), which ends every
    rank's wait."""

    def __init__(self, dead_here: Callable[[], list[int]], propose: Callable[[str], str]):
        self._dead_here, self._propose = dead_here, propose
        self._stopped = threading.Event()
        self.dead: list[int] = []
        self._thread = threads.start(self._watch, "ftmem-preemption-deaths")

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            dead = self._dead_here()
            if dead:
                self.dead = dead
                try:
                    self._propose(_teardown(dead))
                except Exception as e:  # the store is gone: the waits end on their own bound
                    log.debug("could not put the teardown's answer (%s)", e)
                return

    def stop(self) -> list[int]:
        """The ranks of this host found dead (none where the answer came first)."""
        self._stopped.set()
        self._thread.join()
        return self.dead
