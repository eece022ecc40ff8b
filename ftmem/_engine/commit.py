"""The commit pipeline of one rank: a copy thread and a protection thread, both running
while training goes on, so that a save costs the training thread the copy at most, never
the protection (see docs/design/protocols.md).

Each save has a :class:`State`, which the threads advance, and :data:`NEXT` says what may
happen next to a save in each one:

================  ======================================================  ===============
state             what holds                                              moved on by
================  ======================================================  ===============
``queued``        started; the copy thread has not taken it up yet        the copy thread
``copying``       its bytes go into a data slot (what the slot held went  the copy thread
                  invisible first)
``copied``        its bytes are in the slot: the handle is *reusable*,    the copy thread
                  the optimizer step may write the tensors again
``committed``     checksummed, its commit marker written (atomic          the copy or the
                  rename): whole on this rank, a crash of processes       protection thread
                  restores it
``claimed``       every rank committed it, and a round makes its parity   the protection
                                                                          thread
``protected``     every rank protected it: it is the *anchor*, and the    (it leaves the
                  older anchor's slots are free                           pipeline)
================  ======================================================  ===============

and where a save ends without being protected: ``skipped`` (no data slot was free: two
slots, a protection running), ``failed`` (its copy failed), ``replaced`` (a later save's copy
took its slot before the job protected it), ``passed over`` (the job protected a newer save
first) and ``dropped`` (a timeline the job abandoned).

The copy thread takes the saves in the order the training makes them, into a data slot
that holds neither the anchor (which must survive until a newer version is protected) nor
the version a round is about: an empty slot, else the one with the oldest version. With
three slots one is always left; with two, a save that comes while a protection runs finds
none.

The protection thread protects the newest save behind them, one at a time, in rounds that
every rank takes alike (each step a collective over ftmem's groups): the job agrees on the
newest save every rank has made (the least of each rank's newest), each rank marks it as the
round's (the copy thread then leaves its slot alone) and lets its copy finish, and the job
votes that every rank committed it (else nothing is protected this round: the next save
starts the next); the column exchanges pieces and each member stores its parity in the
parity slot that does not hold the anchor's (:class:`ftmem._ec.protect.ColumnCoder`); the job
agrees that every rank protected it; it becomes the anchor, and the saves before it are
done. The persistent tier then gets its private copy, if due
(:class:`ftmem._engine.handover.FlushHandOver`).

At a preemption (:mod:`ftmem._engine.preemption`) every rank's protection thread opens its
next round as always; the round's first collective carries whether any rank was told to
stop, and then every rank, in step, writes the newest version every rank holds whole (else
the anchor) to the persistent tier instead, and protects nothing more.

A crash at any moment leaves the anchor intact on every rank; a crash of processes only
also leaves the newest version every rank committed, which a restore finds on its own.

Every wait here is bounded, and one that runs out names what did not come: a copy by
:func:`ftmem._state.copier.copy_bound_s` (a local copy, held up by nothing but a stuck device
or machine), a collective of the rounds by ``FTMEM_COLLECTIVE_TIMEOUT_S`` for the ranks to
come (:class:`ftmem._common.collective.Arrivals`, which names those that did not). A failed
round fails the engine: the job's groups are then in an unknown state.
"""
from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ftmem._common import testhooks, threads
from ftmem._common.collective import Arrivals, collective_timeout_s, posted_within
from ftmem._common.logs import job_info, rank_warning
from ftmem._disk.durable import Written
from ftmem._state.checksum import data_checksum_and_cpu
from ftmem._state.copier import SlotWindows, copy_bound_s, copy_into_slot
from ftmem.errors import FtmemError
from ftmem._engine.handle import SaveHandle
from ftmem._engine.handover import FinalFlush, FlushHandOver
from ftmem._ec.protect import ColumnCoder
from ftmem._shm.slot_memory import SlotMemory
from ftmem._shm.slots import DATA, PARITY, CommitRecord, RankStore

LAG_SUMMARY_S = 60.0  # the lag log's lines after its first two: at most one this often


class State(enum.Enum):
    """Where a save is in the pipeline (see the module's doc)."""

    QUEUED = "queued"
    COPYING = "copying"
    COPIED = "copied"
    COMMITTED = "committed"
    CLAIMED = "claimed"
    PROTECTED = "protected"
    SKIPPED = "skipped"
    FAILED = "failed"
    REPLACED = "replaced"
    PASSED_OVER = "passed over"
    DROPPED = "dropped"


# What may happen next to a save in each state; any other move is a bug of the pipeline's.
NEXT: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.COPYING, State.SKIPPED, State.FAILED, State.DROPPED}),
    State.COPYING: frozenset({State.COPIED, State.FAILED}),
    State.COPIED: frozenset({State.COMMITTED, State.FAILED}),
    State.COMMITTED: frozenset({State.CLAIMED, State.REPLACED, State.PASSED_OVER, State.DROPPED}),
    State.CLAIMED: frozenset({State.PROTECTED}),
    State.PROTECTED: frozenset(),
    State.SKIPPED: frozenset({State.PASSED_OVER, State.DROPPED}),
    State.FAILED: frozenset({State.PASSED_OVER, State.DROPPED}),
    State.REPLACED: frozenset({State.PASSED_OVER, State.DROPPED}),
    State.PASSED_OVER: frozenset(),
    State.DROPPED: frozenset(),
}
_COPY_RUNS = (State.QUEUED, State.COPYING, State.COPIED)  # the copy thread is not done with it


@dataclass
class _Save:
    """One save, from its start until the job is done with it."""

    handle: SaveHandle
    record: CommitRecord  # its slot and checksum set once the copy thread has them
    tensors: Optional[list]  # let go once copied
    cuda_ready: dict
    persist: bool
    files: Optional[Written]  # on disk for this version: synced before it commits
    state: State = State.QUEUED
    copy_started: Optional[float] = None  # monotonic seconds, once the copy thread took it up

    def advance(self, state: State) -> None:
        """Move it on (under the committer's lock)."""
        if state not in NEXT[self.state]:
            raise AssertionError(f"ftmem's commit pipeline moved version {self.record.version} from "
                                 f"{self.state.value} to {state.value}")
        self.state = state

    @property
    def copy_done(self) -> bool:
        """The copy thread is done with it (committed, skipped, failed or replaced since)."""
        return self.state not in _COPY_RUNS

    @property
    def whole(self) -> bool:
        """This rank holds it whole: committed, its slot its own."""
        return self.state in (State.COMMITTED, State.CLAIMED)

    def late(self, now: float) -> bool:
        """Its copy runs past :func:`copy_bound_s`."""
        return (not self.copy_done and self.copy_started is not None and
                now - self.copy_started > copy_bound_s(self.record.plan.nbytes))

    def late_error(self) -> FtmemError:
        return FtmemError(f"the copy of version {self.record.version} ({self.record.plan.nbytes / 2**20:.1f} MiB) into "
                          f"shared memory has not ended within {copy_bound_s(self.record.plan.nbytes):.0f} s "
                          f"(FTMEM_COPY_TIMEOUT_S, plus a second per 50 MB): a device or the machine is stuck. The "
                          f"training cannot go on safely; restart the job.")


class _LagLog:
    """What the log says about protection falling behind the saves: the first time it does
    and the first time it catches up, each in a line of its own; after that, at most one line
    every :data:`LAG_SUMMARY_S`, summing up what happened since (on a loaded machine the lag
    comes and goes every few saves, which a line per change would flood the log with)."""

    def __init__(self) -> None:
        self._behind = 0  # as the last round left it
        self._said_fell = self._said_caught_up = False
        self._said_at = -LAG_SUMMARY_S  # when the last line was logged (monotonic seconds)
        self._falls, self._worst = 0, 0  # since that line

    def seen(self, protected: int, behind: int, now: float) -> Optional[str]:
        """A round protected ``protected`` with the newest save ``behind`` versions ahead:
        the line to log, if any."""
        fell, caught_up = behind > 0 and self._behind == 0, behind == 0 and self._behind > 0
        self._behind = behind
        self._falls += fell
        self._worst = max(self._worst, behind)
        if fell and not self._said_fell:
            self._said_fell = True
            line = (f"protection is {behind} version(s) behind the saves: version {protected} protected, "
                    f"{protected + behind} saved (a protection takes longer than the saves are apart; a crash of "
                    f"processes restores the newest version every rank copied, a node loss the newest protected one)")
        elif caught_up and not self._said_caught_up:
            self._said_caught_up = True
            line = f"protection caught up: version {protected}, the newest saved, is protected"
        elif self._falls and now - self._said_at >= LAG_SUMMARY_S:
            now_behind = f"{behind} version(s) behind now" if behind else "caught up now"
            line = (f"protection fell behind the saves {self._falls} time(s) in the last {now - self._said_at:.0f} s, "
                    f"at most {self._worst} version(s); {now_behind}")
        else:
            return None
        self._said_at, self._falls, self._worst = now, 0, behind
        return line


@dataclass(frozen=True)
class Lag:
    """How far protection is behind the saves, on this rank: the newest save started and
    the newest version protected job-wide (None before the first), and how many saves were
    skipped, or replaced by a newer one before the job protected them."""

    newest_saved: Optional[int]
    newest_protected: Optional[int]
    unprotected: int

    @property
    def versions(self) -> Optional[int]:
        """Versions (iterations, where a version is one) between the two; None before a protection."""
        if self.newest_saved is None or self.newest_protected is None:
            return None
        return self.newest_saved - self.newest_protected


class Committer:
    """One rank's commit pipeline (see the module's doc)."""

    def __init__(self, store: RankStore, memory: SlotMemory, column: Optional[ColumnCoder],
                 gloo: Optional[dist.ProcessGroup], arrivals: Optional[Arrivals]):
        """``arrivals``: those of the job's rounds (None on one rank)."""
        self.store, self.memory = store, memory
        self._column, self._gloo, self._arrivals = column, gloo, arrivals
        self.handover: Optional[FlushHandOver] = None  # the persistent tier's, where the job has one
        # The saves to copy, in order, for a daemon thread of ftmem's: not a ThreadPoolExecutor,
        # whose workers the interpreter joins at its exit, so that a copy stuck on a device
        # would keep the process from ending.
        self._to_copy: "queue.SimpleQueue[Optional[_Save]]" = queue.SimpleQueue()
        self._copier = threads.start(self._copy_loop, "ftmem-copy")
        self._protector: Optional[threading.Thread] = None  # started by the first save
        self._side_streams: dict = {}  # CUDA device -> the stream device-to-host copies run on
        self._windows = SlotWindows()
        # Everything below is shared by the three threads, under _cv.
        self._cv = threading.Condition()
        self._saves: dict[int, _Save] = {}  # by version: saves the job is not done with
        self._seen: Optional[int] = None  # the newest save started
        self._tried: Optional[int] = None  # the newest save a round was about
        self._round_on: Optional[int] = None  # the version the round under way is about: its slot is kept
        self.anchor: Optional[int] = None  # the newest version protected job-wide (or resumed from)
        self.protected_saved: Optional[int] = None  # the newest version this engine saved and protected
        self._in_round = False
        self._unprotected = 0  # saves done with before the job protected them
        self._failure: Optional[BaseException] = None  # of the protection thread: raised at the next save
        self._failed_copy: Optional[BaseException] = None  # the error of the first failed copy: raised once
        self._stopping = False
        self._skipped_before = False
        self._lag_log = _LagLog()
        self._preempted_until: Optional[float] = None  # told to stop: the grace's end (monotonic)
        self._final: Optional[FinalFlush] = None  # the flush at the preemption, once done

    @property
    def rank(self) -> int:
        return self.store.rank

    # -- the training thread -------------------------------------------------------
    def start(self, handle: SaveHandle, record: CommitRecord, tensors: list, cuda_ready: dict,
              persist: bool, files: Optional[Written] = None) -> None:
        save = _Save(handle, record, tensors, cuda_ready, persist, files)
        with self._cv:
            if self._preempted_until is not None:  # no save after the signal: the process ends within the grace
                self._cv.wait_for(lambda: False, timeout=max(0.0, self._preempted_until - time.monotonic()) + 5)
                raise FtmemError("this rank was told to stop (a preemption) and its grace has ended: no more saves")
            self.raise_failure()
            self._saves[record.version] = save
            self._seen = record.version
            self._start_protecting()
            self._cv.notify_all()
        self._to_copy.put(save)

    def keep(self, version: Optional[int]) -> None:
        """``version`` is the job's newest version now (a restore agreed on it, every rank holds
        it): never overwritten before a newer one is protected (the protection thread is idle)."""
        with self._cv:
            self.anchor = version

    def forget_from(self, version: int) -> None:
        """Saves of ``version`` and newer were dropped (a timeline the job abandoned; idle)."""
        with self._cv:
            if self.anchor is not None and self.anchor >= version:
                self.anchor = None
            for v in [v for v in self._saves if v >= version]:
                dropped = self._saves.pop(v)
                dropped.advance(State.DROPPED)
                dropped.handle._set_done(protected=False)
            if self._seen is not None and self._seen >= version:
                self._seen = self._tried = None

    def flush_at_preemption(self, deadline: float) -> Optional[FinalFlush]:
        """Stop protecting, and write the newest version every rank holds whole to the
        persistent tier (on every rank, once the job agreed it is preempted; the training
        thread's next save waits for the process's end). The protection thread does it in
        the round it opens next, in step with the other ranks. None if it did not end by
        ``deadline`` (monotonic seconds)."""
        with self._cv:
            self._preempted_until = deadline
            self._start_protecting()
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._final is not None or self._failure is not None,
                              timeout=max(0.0, deadline - time.monotonic()))  # the grace bounds it
            if self._final is None and self._failure is not None:
                return FinalFlush(None, False, f"protection had stopped: {self._failure}")
            return self._final

    def lag(self) -> Lag:
        with self._cv:
            return Lag(self._seen, self.anchor, self._unprotected)

    def raise_failure(self) -> None:
        """The protection thread's error, if it stopped with one (the job's groups are then in
        an unknown state: the engine cannot go on)."""
        if self._failure is not None:
            raise self._failure

    def raise_failed_copy(self) -> None:
        """The error of the first save whose copy or commit failed since the last call, once: a
        commit marker fails after the handle is reusable, so the training's wait for the copy may
        have returned before it did, and nothing else would tell it (a full file system's saves
        were all lost, and the job ended without a word)."""
        with self._cv:
            failed, self._failed_copy = self._failed_copy, None
        if failed is not None:
            raise failed

    def drain(self) -> None:
        """Until every save so far is copied, and protected or passed over, and any flush it
        started handed over; raises the protection thread's error, or the copy that ran past
        its bound (the rounds' own waits are bounded: see the module's doc)."""
        with self._cv:
            while self._failure is None and not (not self._in_round and self._seen == self._tried and
                                                 all(s.copy_done for s in self._saves.values())):
                self._raise_late_copy(self._saves.values())
                self._cv.wait(timeout=1.0)
            self.raise_failure()

    def shutdown(self) -> None:
        """Let the copy and protection threads end, each within its bound; one that does not
        is named and left to end with the process (both are daemons)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            saves = list(self._saves.values())
        self._to_copy.put(None)  # the copy thread ends after the saves before it
        try:
            with self._cv:
                self._until_copied(saves)
        except FtmemError as e:
            rank_warning(self.rank, "%s", e)
        if self._protector is not None:
            self._protector.join(collective_timeout_s())
            if self._protector.is_alive():
                rank_warning(self.rank, "the protection thread has not ended within %.0f s of the engine's close (it "
                             "waits for ranks that did not come): it ends with the process", collective_timeout_s())
        self._windows.clear()

    def forget_groups(self) -> None:
        """The engine closed and destroyed its groups: hold none of them, the tier's included."""
        self._gloo = None
        if self.handover is not None:
            self.handover.flusher.close()

    def _start_protecting(self) -> None:
        """(under _cv) The protection thread, at the first save or preemption."""
        if self._protector is None:
            self._protector = threads.start(self._protect_loop, "ftmem-protect")

    def _until_copied(self, saves) -> None:
        """(under _cv) Until the copy thread is done with ``saves``; the first whose copy runs
        past its bound raises (FtmemError, naming it)."""
        saves = list(saves)
        while not all(s.copy_done for s in saves):
            self._raise_late_copy(saves)
            self._cv.wait(timeout=1.0)

    @staticmethod
    def _raise_late_copy(saves) -> None:
        late = next((s for s in saves if s.late(time.monotonic())), None)
        if late is not None:
            raise late.late_error()

    # -- the copy thread -----------------------------------------------------------
    def _copy_loop(self) -> None:
        while (save := self._to_copy.get()) is not None:
            self._copy(save)

    def _copy(self, save: _Save) -> None:
        slot = self._take_slot(save)
        if slot is None:
            save.tensors = None
            save.handle._skip()
            if not self._skipped_before:
                self._skipped_before = True
                job_info("version %d skipped: both slots hold versions being protected, as every save that comes "
                         "while a protection runs will be (\"slots\": 3 keeps the newest copy meanwhile)",
                         save.record.version)
            with self._cv:
                self._cv.notify_all()
            return
        try:
            self._copy_into(save, slot)
        except BaseException as e:
            # Files gone under the copy mean `ftmem clean`: say so, not a bare OSError.
            error = self.memory.removed_error() or e
            with self._cv:
                save.advance(State.FAILED)
                self._failed_copy = self._failed_copy or error
            save.handle._fail(error)
        finally:
            save.tensors = None
            with self._cv:
                self._cv.notify_all()

    def _take_slot(self, save: _Save) -> Optional[int]:
        """The data slot ``save`` goes into (the save is copying, and a committed save that
        held the slot replaced), or None where every slot is kept (the save is skipped)."""
        with self._cv:
            save.copy_started = time.monotonic()
            slot = self._slot_for_copy()
            if slot is None:
                save.advance(State.SKIPPED)
                self._unprotected += 1
                return None
            save.advance(State.COPYING)
            for other in self._saves.values():
                if other is not save and other.record.slot == slot and other.state is State.COMMITTED:
                    other.advance(State.REPLACED)
            save.record = dataclasses.replace(save.record, slot=slot)
            return slot

    def _copy_into(self, save: _Save, slot: int) -> None:
        """Copy ``save`` into ``slot``, then checksum what was written and commit it."""
        version = save.record.version
        began = time.thread_time()
        self.store.drop_slot(slot)  # what the slot held becomes invisible first
        slot_bytes = self.memory.bytes_of(slot)
        if any(t.is_cuda for t in save.tensors):
            self.memory.pin(slot_bytes)
        windows = self._windows.of(slot, slot_bytes, save.record.plan)
        copy_into_slot(windows, save.tensors, save.cuda_ready, self._side_streams,
                       halfway=lambda: testhooks.at("mid_copy", self.rank, version))
        save.tensors = None
        with self._cv:
            save.advance(State.COPIED)
        # Reusable before the checksum: the source tensors are not read again, so the
        # optimizer step waits for the copy only, never for the checksum.
        save.handle._set_reusable()
        # Taken from the slot before the marker exists: a version is never committed
        # without the checksum of exactly what was written (ftmem._shm.integrity).
        checksum, checksum_cpu = data_checksum_and_cpu(slot_bytes.numpy()[: save.record.plan.nbytes])
        record = dataclasses.replace(save.record, checksum=checksum)
        if save.files is not None:  # a committed version's files on disk survive a power loss
            save.files.sync()
        self.store.write_commit(record)
        save.handle.cpu_s = time.thread_time() - began + checksum_cpu
        # Before the protection thread may see the commit: nothing but the marker exists yet.
        testhooks.at("after_commit", self.rank, version)
        with self._cv:
            save.record = record
            save.advance(State.COMMITTED)

    def _slot_for_copy(self) -> Optional[int]:
        """A data slot for the next copy, or None if every one is kept (under _cv): not the
        anchor's, nor that of the version the round under way is about."""
        round_on = self._saves.get(self._round_on)
        keep = [round_on.record.slot] if round_on is not None else []
        held = self.store.committed()
        keep += [held[self.anchor]] if self.anchor in held else []
        return self.store.free_slot(DATA, keep=tuple(keep))

    # -- the protection thread -----------------------------------------------------
    def _protect_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._seen != self._tried
                                  or self._preempted_until is not None)
                if self._seen == self._tried and self._preempted_until is None:  # stopping, with every save tried
                    return
                self._in_round = True
            try:
                if self._round():
                    return  # the flush at the preemption: nothing more to protect
            except BaseException as e:
                with self._cv:
                    self._failure = self.memory.removed_error() or e
                    for save in self._saves.values():
                        save.handle._fail(self._failure)
                    self._cv.notify_all()
                return
            finally:
                with self._cv:
                    self._in_round = False
                    self._cv.notify_all()

    def _round(self) -> bool:
        """One round; True if it was the flush at a preemption, the last."""
        with self._cv:
            seen, preempted = self._seen, self._preempted_until is not None
        target, preempted = self._open_round(-1 if seen is None else seen, preempted)
        if preempted:
            final = self._flush_final()
            with self._cv:
                self._final = final
                self._cv.notify_all()
            return True
        with self._cv:
            save = self._saves.get(target)
            if save is not None and (save.whole or not save.copy_done):
                self._round_on = target  # the copy thread now leaves its slot alone
                self._until_copied([save])  # its copy, if it still runs, is this rank's own
            have = save is not None and save.whole
        if not self._all_min(int(have), f"the vote that every rank committed version {target}"):
            with self._cv:
                self._round_on, self._tried = None, target
            return False
        with self._cv:
            save.advance(State.CLAIMED)
        record = save.record
        testhooks.at("before_protect", self.rank, target)
        if self._column is not None:
            self._protect(record)
        if self._gloo is not None:
            self._confirm_same_version_everywhere(target)
        with self._cv:
            self.anchor = self.protected_saved = target
            self._round_on, self._tried = None, target
            done = [self._saves.pop(v) for v in sorted(v for v in self._saves if v <= target)]
            for passed in done:
                self._unprotected += passed is not save and passed.state is not State.SKIPPED  # skips counted already
                passed.advance(State.PROTECTED if passed is save else State.PASSED_OVER)
                passed.handle._set_done(protected=passed is save)
            behind = self._seen - target
            self._cv.notify_all()
        self._say_lag(target, behind)
        if self.handover is not None:
            self.handover.protected(record, self.memory.bytes_of(record.slot), any(s.persist for s in done),
                                    self._any_rank)
        return False

    def _open_round(self, seen: int, preempted: bool) -> tuple[int, bool]:
        """A round's first collective: the newest save every rank has started (the least of
        each rank's newest), and whether any rank was told to stop."""
        if self._gloo is None:
            return seen, preempted
        agreed = torch.tensor([seen, -int(preempted)], dtype=torch.int64)
        self._all_reduce(agreed, dist.ReduceOp.MIN, f"the agreement on the version to protect after {self._tried}")
        return int(agreed[0]), bool(agreed[1])

    def _all_reduce(self, values: torch.Tensor, op: dist.ReduceOp, what: str) -> None:
        """An all-reduce of the rounds on the job's group, waited for at most
        FTMEM_COLLECTIVE_TIMEOUT_S (CollectiveNotJoined names the ranks that did not come)."""
        bound_s = collective_timeout_s()
        with posted_within(self._gloo, bound_s) as posted:
            work = dist.all_reduce(values, op=op, group=self._gloo, async_op=True)
        self._arrivals.wait([work], f"rank {self.rank}'s protection, in {what}", bound_s, posted)

    def _all_min(self, value: int, what: str) -> int:
        """The least of every rank's ``value`` (this rank's alone on one rank); ``what`` names
        the collective where it waits too long."""
        if self._gloo is None:
            return value
        least = torch.tensor([value], dtype=torch.int64)
        self._all_reduce(least, dist.ReduceOp.MIN, what)
        return int(least)

    def _any_rank(self, yes: bool, what: str) -> bool:
        """Whether any rank says ``yes`` (a collective of the round)."""
        return not self._all_min(int(not yes), what)

    def _flush_final(self) -> FinalFlush:
        """Write the newest version every rank holds whole (else the anchor) to the persistent
        tier, in step with every rank (the flush at a preemption)."""
        with self._cv:  # this rank's copies end (no save starts any more)
            self._until_copied(self._saves.values())
            whole = {v: s.record for v, s in self._saves.items() if s.whole}
        version = self._all_min(max(whole, default=-1), "the agreement on the version to flush at the preemption")
        if version < 0 or not self._all_min(int(version in whole), f"the vote that every rank holds version {version}"):
            version = self.anchor  # every rank holds it
        with self._cv:  # a save this rank starts before it hears of the signal leaves its slot alone
            self._round_on = version
        if self.handover is None:
            return FinalFlush(version, False, "no persistent tier is configured" if version is not None else None)
        return self.handover.final(version, lambda v: whole[v] if v in whole else self.store.read_commit(v),
                                   self.memory.bytes_of)

    def _say_lag(self, protected: int, behind: int) -> None:
        """Rank 0's lines on the lag (:class:`_LagLog`), once a round is done."""
        line = self._lag_log.seen(protected, behind, time.monotonic())
        if line is not None:
            job_info("%s", line)

    def _protect(self, record: CommitRecord) -> None:
        lengths, records, piece = self._column.exchange_info(record)
        self.memory.reserve(record.plan.nbytes, self._column.parity_nbytes(piece))
        held = self.store.parity_held()
        slot = self.store.free_slot(PARITY, keep=(held[self.anchor],) if self.anchor in held else ())
        self.store.drop_slot(slot, PARITY)
        parity = self.memory.bytes_of(slot, PARITY).numpy()
        data = self.memory.bytes_of(record.slot).numpy()
        self.store.write_parity(self._column.protect(record, data, parity, slot, lengths, records, piece))

    def _confirm_same_version_everywhere(self, version: int) -> None:
        """Job-wide: every rank committed and protected v. Only then is v the anchor, and the
        older one's slot free on any rank."""
        if self._all_min(version, f"the check that every rank protected version {version}") != version:
            raise FtmemError(f"ranks protected different versions at once (this rank {version}): every rank must "
                             f"save the same versions.")
        if self._column is not None:
            self.store.write_protected(version)
