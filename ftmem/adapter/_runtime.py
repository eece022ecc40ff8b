"""What every framework adapter needs around the engine, written once.

An adapter translates its framework's state and parallel layout; :class:`AdapterRuntime`
does the rest, the same way for DeepSpeed and Megatron:

* the engine, with the DP groups it makes (one gloo group per DP group, which the
  adapters use too), and the persistent tier in the framework's format;
* RNG capture with every save and restore with every resume (the format's generators);
* the wait for the copy before the optimizer step (:meth:`wait_reusable`,
  :meth:`make_step_wait`);
* the restore policy, memory, then disk, then scratch (:meth:`restore`), where a
  layout mismatch means the same thing in both frameworks: a refusal naming what
  differs, unless ``allow_disk_fallback`` is set;
* ``wait_protected`` / ``wait_flushed``, which mean the same thing everywhere;
* the end of the job (:meth:`finish`, also run when the process exits): memory is freed
  only when every rank ended cleanly and the newest version is on disk; otherwise it
  stays for a restart, and the log says how to free it. A rank ends cleanly unless it ends
  with an uncaught exception or a non-zero ``sys.exit`` (:mod:`ftmem._common.exit_status`).
"""
from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import itertools
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ftmem._common import exit_status, testhooks
from ftmem.config import FtmemConfig
from ftmem._engine.commit import Lag
from ftmem._engine.elastic import Adopted, OtherWorlds, adopt, ancestors, free_jobs
from ftmem._engine.engine import SnapshotEngine
from ftmem.errors import FtmemError, LayoutMismatch, NotRecoverableFromMemory
from ftmem._disk.format import FrameworkFormat
from ftmem._engine.handle import SaveHandle
from ftmem._common.logs import announce, job_info, restored_from_disk, restored_from_memory
from ftmem._engine.ownership import other_worlds_refused, versions_of_other_jobs
from ftmem._common.parallel import ParallelLayout
from ftmem._common.identity import check_node_layout, world_in_words
from ftmem._disk.durable import Written
from ftmem._disk.persist import Flusher, check_writable
from ftmem._common.collective import first_problem, gather
from ftmem._engine.restore import Chosen, Restored, RestoreTimes
from ftmem._shm import jobs
from ftmem._shm.held import HeldJob, NotAllHere
from ftmem._shm.slots import VersionRef

class ResumeSource(enum.Enum):
    """Where a restart resumes from."""

    MEMORY = "memory"  # a version in shared memory, this job's or adopted from another world's job
    DISK = "disk"  # the newest checkpoint on disk (the framework's own, or the persistent tier's)
    SCRATCH = "scratch"  # nothing: a fresh start

    def __str__(self) -> str:
        return self.value


MEMORY, DISK, SCRATCH = ResumeSource.MEMORY, ResumeSource.DISK, ResumeSource.SCRATCH


@dataclass(frozen=True)
class DiskCheckpoint:
    """A checkpoint on disk that a restart may load instead of memory."""

    version: int
    directory: str


# The RNG states that AdapterRuntime.resumed puts back by default: the resumed version's own.
VERSION_RNG = "the version's own"


@dataclass(frozen=True)
class Resumption:
    """Where a restart resumes from, decided the same way on every rank, and all it needs:
    the whole resume decision, which the adapter carries from one phase of
    :meth:`AdapterRuntime.plan_resume` / :meth:`~AdapterRuntime.restore` /
    :meth:`~AdapterRuntime.resumed` to the next."""

    source: ResumeSource
    disk: Optional[DiskCheckpoint] = None  # this rank's newest checkpoint on disk: what a DISK resume loads
    reason: Optional[str] = None  # why memory did not serve, when it did not and something was there
    chosen: Optional[Chosen] = None  # this job's version, agreed on, until restore() copies it out
    restored: Optional[Restored] = None  # this rank's state of the version, once copied out
    adopted: Optional[Adopted] = None  # another world's job's version (every old rank's state, copied)
    named: bool = False  # the load named its version: newer versions stay held
    disk_views: tuple = ()  # every rank's newest version on disk, by rank

    @property
    def saved(self) -> Any:
        """This job's chosen version as it was saved, a TensorPlace for each tensor (its small
        values readable): for naming the tensors to restore into, and for checking the
        version, before :meth:`AdapterRuntime.restore` copies anything."""
        return self.chosen.saved if self.chosen is not None else None

    @property
    def version(self) -> Optional[int]:
        if self.adopted is not None:
            return self.adopted.version
        if self.chosen is not None:
            return self.chosen.version
        return self.disk.version if self.source == DISK else None


class AdapterRuntime:
    """One rank's ftmem, as an adapter drives it. Construction is collective."""

    def __init__(self, config: FtmemConfig, layout: ParallelLayout, format: FrameworkFormat, save_dir: str,
                 persist_dir: Optional[str] = None, persist_interval: int = 0, persist_keep: Optional[int] = None,
                 framework_on_disk: Optional[Callable[[], Optional[int]]] = None):
        """``save_dir``: where the framework saves this job's checkpoints; the job's origin, which a
        relaunch of the same job reproduces (see ftmem._common.identity). ``persist_dir``: the persistent
        tier's directory (flushes every ``persist_interval``-th protected version, and those saved
        with ``persist``). ``framework_on_disk``: the version of the framework's own newest disk
        checkpoint (None if none), asked at the end when the script did not say (an end at exit)."""
        self.config, self.format = config, format
        self._framework_on_disk = framework_on_disk
        self._engine = SnapshotEngine(config, layout=layout, format=format.name,
                                     origin=f"save dir {os.path.realpath(save_dir)}")
        self._handle: Optional[SaveHandle] = None
        if persist_dir:
            peers = self._engine.dp_peers
            self._engine.persist_with(Flusher(persist_dir, persist_interval, persist_keep, format, self.rank,
                                             first_replica=peers.ranks[0] == self.rank,
                                             world_size=self._engine.identity.world_size,
                                             interface=self._engine.network_interface, fsync=config.persist.fsync))
        elif config.preemption.signal is not None:
            job_info("no persistent tier: a preemption of the whole job (%s to every node, then its machines gone) "
                     "loses what memory holds; a persistent tier is flushed to at that signal (docs/operations.md, "
                     "\"Preemption\")", config.preemption.signal)
        self._finished = False
        self._pid = os.getpid()  # a forked child inherits the runtime, not its end
        self._kept_newer: list[int] = []  # versions held newer than the one loaded by name (plan_resume's named)
        self._adopted: Optional[Adopted] = None  # another world's version this job resumed from, until freed
        # The old jobs this job's line descends from, which a resume of its own version frees
        # once it holds a protected version of its own (ftmem._engine.elastic.ancestors).
        self._ancestors: dict[str, tuple[list[str], str]] = {}
        self.last_restore: Optional[RestoreTimes] = None  # where the last load from memory spent its time
        _close_at_exit(self)

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def identity(self):
        """This rank's job identity (:class:`ftmem._common.identity.RankIdentity`)."""
        return self._engine.identity

    @property
    def layout(self) -> ParallelLayout:
        return self._engine.layout

    @property
    def last_flush(self):
        """The persistent tier's last flush, for reports (None without one)."""
        return self._engine.last_flush

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self._engine.dp_peers.ranks

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        """A gloo group of this rank's DP replicas (None without replicas), the training
        thread's: ftmem's own threads never use it, so an adapter may make collectives on it at
        any save, in the same order on every replica."""
        return self._engine.dp_peers.group

    @property
    def last_save(self) -> Optional[SaveHandle]:
        """The handle of this run's last save (None before its first)."""
        return self._handle

    # -- save ---------------------------------------------------------------------------
    def save(self, state: dict, version: int, replicated: Optional[Callable[[torch.Tensor], bool]] = None,
             persist: bool = False, written_in_forward: Optional[Callable[[torch.Tensor], bool]] = None,
             files: Optional[Written] = None) -> SaveHandle:
        """Snapshot ``state`` with this rank's RNG (under ``"rng"``) as ``version``
        (:meth:`ftmem.SnapshotEngine.save` says what ``replicated``, ``written_in_forward`` and
        ``files`` name)."""
        self._handle = self._engine.save(dict(state, rng=self.format.capture_rng()), version, replicated=replicated,
                                        persist=persist, written_in_forward=written_in_forward, files=files)
        self._kept_newer = []  # the save dropped every version >= its own
        self._free_superseded_once_protected()  # once the protection thread protected a save of this job
        return self._handle

    def next_save(self, version: int) -> VersionRef:
        """The save that the next :meth:`save` of ``version`` makes (to name it before it starts)."""
        return self._engine.next_save(version)

    def wait_reusable(self) -> None:
        """The last snapshot's copy is done: the optimizer may write the state again."""
        if self._handle is not None:
            self._handle.wait_reusable()

    def make_step_wait(self, optimizer) -> None:
        """Make ``optimizer.step`` wait for the last snapshot's copy first (once per optimizer):
        every caller of the step is covered, with no hook in the training loop."""
        if optimizer is None or getattr(optimizer.step, "_ftmem_waits", False):
            return
        stock_step, wait = optimizer.step, self.wait_reusable

        @functools.wraps(stock_step)
        def step(*args, **kwargs):
            wait()
            return stock_step(*args, **kwargs)

        step._ftmem_waits = True
        optimizer.step = step

    def wait_protected(self) -> None:
        """Until every save so far is protected on every rank, or passed over for a newer one
        that is (never needed by training: protection runs behind the saves)."""
        self._engine.wait_protected()

    def lag(self) -> Lag:
        """How far protection is behind the saves (:class:`ftmem._engine.commit.Lag`)."""
        return self._engine.lag()

    def wait_flushed(self) -> None:
        """Until every save so far is protected and any flush it started is on disk."""
        self._engine.wait_flushed()

    # -- restore ------------------------------------------------------------------------
    # A resume runs in three phases, each collective, each called by the adapter: the
    # adapter's framework code (building what to restore into, loading the restored state)
    # runs between them, never inside one, and its problems are voted on at the next phase,
    # so that every rank takes the same way out.
    def plan_resume(self, disk: Optional[DiskCheckpoint] = None, other_worlds: Optional[OtherWorlds] = None,
                    named: Optional[int] = None, newest_saved: Optional[VersionRef] = None) -> Resumption:
        """Phase 1: decide where to resume. Memory's newest version that every rank can
        recover (agreed on, rebuilt where nodes were lost, not yet copied out), unless the
        newest disk checkpoint (``disk``: this rank's view) is newer; else the disk, which
        every rank must see alike; else scratch. With ``named``, that version and no other
        (newer versions stay held); without a ``disk`` to fall back to, the reason it cannot be
        given back is raised. A version of another layout or EC geometry, or of another
        world's job while this job holds none (unless ``other_worlds`` lets it adopt that:
        :func:`ftmem._engine.elastic.adopt`), is refused with the reason (memory left as it
        is), or skipped for the disk with ``allow_disk_fallback``. ``newest_saved``: the version
        that the framework's own pointer in the save dir names (DeepSpeed's ``latest``), where
        ftmem recorded which save it is: memory's versions of another timeline (an earlier
        run of the same command into the same save dir) are stale, neither restored nor
        adopted nor freed, and the log says so."""
        views = tuple(self.gather(None if disk is None else disk.version))
        plan = Resumption(SCRATCH, disk=disk, named=named is not None, disk_views=views)
        newest_on_disk = max((v for v in views if v is not None), default=None)
        timeline = newest_saved.timeline if newest_saved is not None else None
        if timeline is not None:
            self._report_stale(newest_saved)
        try:
            chosen = self._engine.choose(named, timeline)
            if named is not None and chosen is None:
                raise NotRecoverableFromMemory(f"memory holds no version of this job, so not version {named}")
            adopted = None if chosen is not None or named is not None else self._adopt(other_worlds, timeline)
        except (LayoutMismatch, NotRecoverableFromMemory) as e:  # EcGeometryMismatch is a LayoutMismatch
            if named is not None and disk is None:
                raise  # the load named this version, and there is nothing else it could load
            if isinstance(e, LayoutMismatch):
                return self._refuse_memory(plan, str(e))
            return _without_memory(plan, str(e))
        found = chosen or adopted
        if found is None:
            return _without_memory(plan, "memory holds no version of this job" if newest_on_disk is not None else None)
        if named is None and newest_on_disk is not None and found.version < newest_on_disk:
            return _without_memory(plan, f"memory's newest version {found.version} is older than iteration "
                                         f"{newest_on_disk} on disk")
        return dataclasses.replace(plan, source=MEMORY, chosen=chosen, adopted=adopted)

    def restore(self, plan: Resumption, into: Any = None, problem: Optional[str] = None) -> Resumption:
        """Phase 2, for a resume from memory: ``problem`` is this rank's objection to the
        version (the adapter read :attr:`Resumption.saved`: other args, say); any rank's
        refuses it (:meth:`_refuse_memory`). Else this job's version is copied out into the
        tensors ``into`` names (the adapter's answer to :attr:`Resumption.saved`, see
        :mod:`ftmem._state.destinations`), else into fresh memory."""
        if plan.source != MEMORY:
            return plan
        problem = self._first_problem(problem)
        if problem is not None:
            return self._refuse_memory(plan, problem)
        if plan.chosen is None:  # adopted: every old rank's state is copied already
            return plan
        restored = self._engine.read(plan.chosen, into=into, drop_newer=not plan.named)
        if plan.named:
            # Until the next save drops them, the job's end must not free memory for the loaded
            # version alone being on disk (one view on every rank: gathered).
            self._kept_newer = sorted({v for held in self.gather(self._engine.versions()) for v in held
                                       if v > restored.version})
        return dataclasses.replace(plan, chosen=None, restored=restored)

    def resumed(self, plan: Resumption, problem: Optional[str] = None, detail: str = "", rng: Any = VERSION_RNG,
                disk_found: str = "there is no disk checkpoint to load") -> Resumption:
        """Phase 3: the adapter loaded the resumed state into the framework (or, for a disk
        resume, is about to load it), having found ``problem`` with it or not. From memory
        (collective): any rank's problem refuses the version (:meth:`_refuse_memory`);
        else ``rng`` is put back (the version's own by default, which for another world's
        version is the state the adapter set as :attr:`Resumption.restored`; None leaves the
        RNG as it is) and the job says so. From disk: the format's RNG of that checkpoint is
        put back (where the framework does not restore its own) and the job says so. From
        scratch after memory could not serve (a ``reason``): refused, since a fresh start
        would silently throw the job's progress away (:meth:`_refuse_a_fresh_start`; ``disk_found``
        says what the framework found on disk).
        Returns the resumption as it ended."""
        if plan.source == MEMORY:
            problem = self._first_problem(problem)
            if problem is not None:
                return self._refuse_memory(plan, problem)
            self._resumed_from_memory(plan, detail, rng)
        elif plan.source == DISK:
            states = self.format.read_rng(plan.disk.directory, self.rank) if rng is not None else None
            if states is not None:
                self.format.restore_rng(states)
            announce(restored_from_disk(plan.disk.version, plan.disk.directory, self.rank, plan.reason))
        else:
            self._refuse_a_fresh_start(plan.reason, disk_found)
        return plan

    def _resumed_from_memory(self, plan: Resumption, detail: str, rng: Any) -> None:
        restored, adopted = plan.restored, plan.adopted
        if rng is VERSION_RNG:
            rng = restored.state["rng"] if restored is not None else None
        if rng is not None:
            self.format.restore_rng(rng)
        if adopted is not None:
            # Its memory is the version's only copy until this job protects one of its own
            # (:meth:`_free_superseded_once_protected`); the next versions carry on its line.
            self._adopted, self.last_restore = adopted, None
            self._engine.resumed_at(None, adopted.ref, adopted.timeline)
            announce(restored_from_memory(adopted.version, self.rank, ", ".join(filter(None, (detail, str(adopted))))))
            return
        # The job's newest version until it saves again: a job that ends without saving (a
        # relaunch at its last iteration) must keep it in memory or flush it, never free it.
        # Its next versions carry on the line it was adopted from (ftmem._engine.elastic).
        self._engine.resumed_at(restored.version, restored.lineage, restored.timeline)
        self.last_restore = restored.times
        announce(restored_from_memory(restored.version, self.rank, detail, restored.rebuilt))
        self._ancestors = ancestors(self._engine.identity, self._engine.job_group, restored.lineage, restored.version)

    def _report_stale(self, newest_saved: VersionRef) -> None:
        """Say which of this job's versions are of another timeline than ``newest_saved``
        (collective): they are not restored, and this job's saves replace them."""
        self._engine.wait_protected()
        stale = sorted(set().union(*self.gather(self._engine.versions_off(newest_saved.timeline))))
        if stale:
            job_info("not restoring this job's version(s) %s: they are of another run than the save dir's newest "
                     "checkpoint (job %s's version %d), stale memory of an earlier run of the same save dir; this "
                     "job's next saves replace them", stale, newest_saved.job, newest_saved.version)

    def _adopt(self, other_worlds: Optional[OtherWorlds], timeline: Optional[str]) -> Optional[Adopted]:
        """The version of another world's job from this job's origin (collective), adopted
        (:mod:`ftmem._engine.elastic`) where ``other_worlds`` says the adapter can load it; None
        if there is none; else LayoutMismatch saying why not. With ``timeline``, only a version of it."""
        identity = self._engine.identity
        others = self._first_problem(versions_of_other_jobs(identity))
        if others is None:
            return None
        if other_worlds is None:
            raise LayoutMismatch(other_worlds_refused(identity, others, "this framework's adapter restores from "
                                                      "memory only onto the layout a checkpoint was saved with"))
        self._engine.wait_protected()
        try:
            return adopt(identity, self._engine.job_group, self.format.name, other_worlds, timeline)
        except LayoutMismatch as e:
            raise LayoutMismatch(other_worlds_refused(identity, others, f"ftmem cannot resume from them: {e}")) from e

    def _free_superseded_once_protected(self) -> None:
        """Free the old jobs this job's resume superseded once this job holds a protected
        version it saved itself (its framework loaded the resumed state and trained on): the
        adopted one, whose memory is the only copy of the version this job resumed from, and
        those its own resumed version's line descends from."""
        if self._engine.protected_saved is None:
            return
        if self._adopted is not None:
            self._adopted.free(self._engine.identity.shm_dir)
            self._adopted = None
        free_jobs(self._engine.identity.shm_dir, self._ancestors)
        self._ancestors = {}

    def read_here(self, version: int, uid: Optional[str] = None, job: Optional[str] = None) -> Optional[list]:
        """Every rank's state of ``version``, by rank, read from this host's shared memory with
        no collective (:mod:`ftmem._shm.held`), for a read that some ranks make alone; with
        ``uid``, only that save of it (FtmemError for another run's). None where some rank's
        node memory is not on this host: only a collective can read it then. ``job``: another
        job's version (a checkpoint another world wrote, read by path), None also where that
        job holds no memory here; default this job's."""
        job = job or self.identity.job
        if job != self.identity.job and not jobs.node_dirs(self.identity.shm_dir, job):
            return None
        self._engine.wait_protected()  # every save so far is protected (or passed over) by every rank
        held = HeldJob(self.identity.shm_dir, job)
        try:
            version, record = held.choose(version)
        except NotAllHere:
            return None
        if uid is not None and record.uid != uid:
            raise FtmemError(f"memory's version {version} of job {job} is another run's save of it "
                             f"than the one asked for (stale memory of an earlier run of the same save dir).")
        records = held.verified(version)
        return [held.read_state(records, rank) for rank in sorted(records)]

    def read_version(self, version: int) -> Restored:
        """``version`` as memory holds it (collective), for reading its files; the job does not
        resume from it, and newer versions stay."""
        return self._engine.restore(version, drop_newer=False)

    def _first_problem(self, problem: Optional[str]) -> Optional[str]:
        """Every rank's verdict on its own part of a restore; the first problem any rank
        has. All ranks must take the same path (memory or disk) or the next collective hangs."""
        self._engine.wait_protected()
        return first_problem(problem, self._engine.job_group)

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, by rank (collective over the job's gloo group, once the protection thread is idle)."""
        self._engine.wait_protected()
        return gather(obj, self._engine.job_group)

    def refuse_other_job(self, described: str, job: str, world: Optional[tuple[int, int]],
                         adopted: Optional[Adopted] = None) -> None:
        """Refuse a checkpoint that job ``job`` wrote on ``world`` (world size, ranks per node;
        None if unknown), unless it is this job's or the ``adopted`` one's: this job's memory
        may hold a version of the same number, which is not that checkpoint. ``described``
        starts the error: what the checkpoint's file is ("<path> is a stub of")."""
        identity = self._engine.identity
        if job in (identity.job, adopted and adopted.job):
            return
        now = (identity.world_size, identity.ranks_per_node)
        then = world or now
        changed = (f" Job {job} saved it on {world_in_words(*then)}; this job runs on {world_in_words(*now)}."
                   if then != now else "")
        raise FtmemError(
            f"{described} job {job}'s in-memory checkpoint, but this job is {identity.job}.{changed} A job's id "
            f"derives from its save dir and its world layout (world size, ranks per node) unless FTMEM_JOB_ID or "
            f"\"job_id\" sets it, so a relaunch at another size is another job, and ftmem restores from memory "
            f"only onto the layout a checkpoint was saved with. Relaunch as it was saved, or write real files "
            f"first (`ftmem export --job {job} --out DIR`) and load those.")

    def _refuse_memory(self, plan: Resumption, problem: str) -> Resumption:
        """Memory holds a version this job cannot use (another layout, model or args):
        stop with the reason, unless ``allow_disk_fallback`` lets the job load from disk."""
        if not self.config.allow_disk_fallback:
            newest = max((v for v in plan.disk_views if v is not None), default=None)
            where = f"iteration {newest}" if newest is not None else "there is none yet"
            raise LayoutMismatch(f"{problem} To load the disk checkpoint instead ({where}), set "
                                 f"\"allow_disk_fallback\": true in the \"ftmem\" config (Megatron: "
                                 f"--ftmem-allow-disk-fallback).")
        job_info("memory holds no version this job can use (%s); loading from disk as allow_disk_fallback allows",
                 problem)
        return _without_memory(plan, problem)

    def _refuse_a_fresh_start(self, reason: Optional[str], disk: str = "there is no disk checkpoint to load") -> None:
        """The framework found nothing to resume from (``disk`` says what it found). Right for a
        fresh job (no ``reason``); but where memory held versions it could not give back
        (``reason``), a fresh start would silently throw the job's progress away: refused
        (the same on every rank: the reason is), memory left as it is."""
        if reason is None:
            return
        identity = self._engine.identity
        raise NotRecoverableFromMemory(
            f"memory could not serve ({reason}) and {disk}. ftmem does not start from scratch in place of what this "
            f"job saved. To start over on purpose, free it first: ftmem clean --job {identity.job} --shm-dir "
            f"{identity.shm_dir}")

    # -- end ----------------------------------------------------------------------------
    def close(self, job_finished: bool) -> None:
        """Close this rank's engine (collective). With ``job_finished`` on every rank the
        job's snapshots are freed; otherwise they stay for a restart. A closed runtime has
        ended: its end does not run again at exit, where it would find no group to agree on."""
        self._finished = True
        _unfinished.discard(self)
        self._handle = None
        self._engine.close(job_finished=job_finished)

    def finish(self, on_disk: Optional[int] = None) -> None:
        """This rank's part of the job ended (collective; also run at exit). If every rank
        ended cleanly, the persistent tier (if any) first writes the newest version, and
        the job's memory is freed once that version is on disk (or the framework's own save
        of iteration ``on_disk`` is at least as new); else the memory stays for a restart
        of the same job, and rank 0 says how to free it."""
        self._end(exit_status.failure(), on_disk)

    def _end(self, failure: Optional[str], on_disk: Optional[int] = None) -> None:
        """:meth:`finish`, where this rank ends with ``failure`` (None: cleanly)."""
        if self._finished or os.getpid() != self._pid:
            return
        self._finished = True
        _unfinished.discard(self)
        if on_disk is None and self._framework_on_disk is not None:
            on_disk = self._framework_on_disk()
        problem = f"it ended with {failure}" if failure is not None else None
        if problem is None:
            try:
                self._engine.wait_flushed()
                self._free_superseded_once_protected()
            except Exception as e:
                problem = str(e)
        # Every rank ended cleanly, or none does anything collective beyond this decision.
        verdict = self._engine.end_of_job(problem)
        if verdict is not None:
            return self._keep(verdict)
        if self._kept_newer:
            return self._keep(f"it also holds version(s) {self._kept_newer}, newer than the version it loaded by name")
        flusher, newest = self._engine.flusher, self._engine.anchor
        testhooks.at("finish", self.rank, -1 if newest is None else newest)
        if flusher is not None and (on_disk is None or newest is None or on_disk < newest):
            try:
                self._engine.flush_newest()  # the persistent tier writes it first
            except Exception as e:
                return self._keep(str(e))
        written = max((v for v in (on_disk, flusher and flusher.flushed_version) if v is not None), default=None)
        if newest is not None and (written is None or written < newest):
            return self._keep("no persistent tier is configured, so it is not on disk" if written is None else
                              f"it is not on disk: the newest checkpoint there is version {written}")
        self.close(job_finished=True)

    def _keep(self, reason: str) -> None:
        try:
            self.close(job_finished=False)
        except Exception as e:  # the failure that made it keep the memory, raised once more: the memory stays
            reason = reason if str(e) == reason else f"{reason}; then its close failed: {e}"
        # None: this run saved nothing and restored nothing (it failed first); what it held stays.
        _say_kept(self._engine.identity, max(self._kept_newer, default=self._engine.anchor), reason)


def _without_memory(plan: Resumption, reason: Optional[str]) -> Resumption:
    """Memory does not serve (``reason``): the disk, which every rank must see alike, else scratch."""
    alike = _seen_alike(list(plan.disk_views))
    return dataclasses.replace(plan, source=DISK if alike is not None else SCRATCH, reason=reason, chosen=None,
                               restored=None, adopted=None)


def _say_kept(identity, newest: Optional[int], reason: str) -> None:
    held = "what it holds" if newest is None else f"its newest version ({newest})"
    job_info("job %s keeps %s in shared memory (%s): a restart of the same job resumes from it. To free it: "
             "ftmem clean --job %s --shm-dir %s", identity.job, held, reason, identity.job, identity.shm_dir)


def _seen_alike(seen: list) -> Optional[int]:
    """The newest disk checkpoint, which every rank must see alike (``seen``: each rank's,
    by rank) to resume from disk; else the ranks would resume from different places."""
    if len(set(seen)) == 1:
        return seen[0]
    views = ", ".join(f"rank {r}: {'none' if v is None else v}" for r, v in enumerate(seen))
    raise FtmemError(f"the ranks see different newest checkpoints on disk ({views}), and memory cannot serve: "
                     f"they would resume from different iterations. Give every rank the same view of the "
                     f"checkpoint directory (a file system all nodes share, its caches current) and restart; "
                     f"nothing was loaded.")


def check_startup(config: FtmemConfig, rank: int, world_size: int) -> None:
    """For an adapter that starts its runtime after the job (DeepSpeed: at the first save
    or load): fail at the job's start, with the reason, if the config's nodes and EC
    groups cannot fit the world, the network interface it names is not on this host, or
    the persistent tier's directory takes no files."""
    check_node_layout(config, rank, world_size)
    config.network.resolve()
    if config.persist.dir:
        check_writable(config.persist.dir)


# Runtimes of this process not yet finished, for the end of torch.distributed (below).
_unfinished: "weakref.WeakSet[AdapterRuntime]" = weakref.WeakSet()
# The order this process made its runtimes in. Construction is collective, so it is the same
# on every rank; ends are collective too, and must run in it (a set's order is the process's own).
_made = itertools.count()


def _close_at_exit(runtime: AdapterRuntime) -> None:
    """Finish the job when the process exits, or when the script ends torch.distributed
    first, telling a crash (whose snapshots must stay for the restart) from an ordinary end."""
    exit_status.watch()
    atexit.register(runtime.finish)
    runtime._made = next(_made)
    _unfinished.add(runtime)
    _finish_before_the_process_group_ends()


def _finish_before_the_process_group_ends() -> None:
    """Scripts end with ``destroy_process_group()``, as PyTorch asks, before the process
    exits. That destroys ftmem's groups too, so the end of the job (the ranks' decision, the
    flush, the free) could no longer run at exit and the memory was kept with a warning.
    Destroying the default group now runs that end first. An exception in flight there (a
    ``finally:`` after a failure) counts as a crash, as it would at exit."""
    stock = dist.destroy_process_group
    if getattr(stock, "_ftmem", False):
        return

    @functools.wraps(stock)
    def destroy_process_group(group=None):
        try:
            if group is None or group is dist.GroupMember.WORLD:
                in_flight = sys.exc_info()[1]
                failure = exit_status.failure()
                if failure is None and in_flight is not None and not (isinstance(in_flight, SystemExit) and
                                                                      in_flight.code in (0, None)):
                    failure = f"an exception in flight ({type(in_flight).__name__}) as torch.distributed ended"
                for runtime in sorted(_unfinished, key=lambda r: r._made):
                    runtime._end(failure)
        finally:
            stock(group)

    destroy_process_group._ftmem = True
    dist.destroy_process_group = destroy_process_group
