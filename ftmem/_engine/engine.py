"""The public engine: snapshot a rank's state into its node's shared memory, protect
it with erasure coding across nodes, and restore it after a crash.

Typical loop (the copy overlaps the next forward/backward)::

    engine = SnapshotEngine(FtmemConfig.from_dict(cfg))
    restored = engine.restore()                  # None on a fresh start
    for it in range(start, iters):
        loss = model(batch).backward()           # reads the parameters only
        if handle: handle.wait_reusable()        # the step may now overwrite the state
        optimizer.step()
        handle = engine.save(state_dict(), it)   # returns at once; copies in the background
    engine.close(job_finished=True)              # frees the node's memory once all ranks finish

The engine is a facade over parts with one job each: :class:`~ftmem._shm.slot_memory.SlotMemory`
(mapped slots), :class:`~ftmem._engine.commit.Committer` (the commit protocol, on a background
thread), :class:`~ftmem._engine.restore.Restorer` (version agreement, rebuild, DP gather) and
:mod:`ftmem._shm.integrity` (checksums).
"""
from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ftmem._engine.commit import Committer, Lag
from ftmem.config import FtmemConfig, seconds_from_env
from ftmem._state.copier import capture_cuda_order, copy_bound_s, taken_now
from ftmem._state.destinations import RestoreTargets
from ftmem.errors import FtmemError
from ftmem._engine.handle import SaveHandle
from ftmem._common.identity import RankIdentity
from ftmem._common import compat, exit_status, open_files
from ftmem._common.deprecation import Renamed
from ftmem._common.agreement import unanimous
from ftmem._common.collective import NOTE_AFTER_S, Arrivals, collective_timeout_s, gather, new_group
from ftmem._common.job_store import StandingConnection, no_answer
from ftmem._common.logs import job_info, rank_warning
from ftmem._engine.failure_detector import FailureDetector
from ftmem._engine.handover import FlushHandOver
from ftmem._engine.preemption import Preemption
from ftmem._engine.ownership import refuse_another_node_layout, refuse_foreign_versions
from ftmem._common.parallel import ParallelLayout, destroy_groups, make_dp_groups
from ftmem._disk.durable import Written
from ftmem._disk.persist import Flusher, FlushTimes
from ftmem._ec.placement import ec_groups
from ftmem._state.plan import Planner
from ftmem._ec.protect import ColumnCoder, Topology, make_column_groups, piece_size
from ftmem._engine.restore import Chosen, DataParallelPeers, Restored, Restorer, off_timeline
from ftmem._state.serialize import split_state
from ftmem._state.torch_function import modes_off
from ftmem._shm.node_round import SharedMemoryRound
from ftmem._shm.slot_memory import SlotMemory
from ftmem._shm.slots import CommitRecord, RankStore, VersionRef
from ftmem._shm.smp_client import SmpClient

__all__ = ["SnapshotEngine", "Restored"]

# How long a rank that finished waits for the others to say whether they did.
FINISH_TIMEOUT_S = 60.0
FINISH_TIMEOUT_ENV = "FTMEM_FINISH_TIMEOUT_S"


def finish_timeout_s() -> float:
    return seconds_from_env(FINISH_TIMEOUT_ENV, FINISH_TIMEOUT_S, minimum=1,
                            what="how long a rank that finished waits for the others to say whether they did")


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class SnapshotEngine:
    """One rank's in-memory snapshot engine.

    ``config`` is an :class:`FtmemConfig`, or the user's ``"ftmem"`` dict. Rank and
    world size default to torch.distributed's, else RANK / WORLD_SIZE. With more
    than one rank, torch.distributed must be initialized: construction is then
    collective (it creates the engine's own gloo groups, kept apart from the
    training groups, for agreeing on versions, moving parity and joining DP shards;
    their bytes take the network interface ``"network": {"interface": ...}`` names, else
    FTMEM_SOCKET_IFNAME's, and the training's groups keep theirs).
    ``format`` names the :class:`~ftmem._disk.format.FrameworkFormat` that writes this job's
    versions to disk; ``origin`` says where the job comes from (its save directory). Both
    are recorded in every version; with an origin, versions of another origin under this
    job's id are refused (:mod:`ftmem._engine.ownership`). The job id derives from the origin (by
    default the working directory and script) unless FTMEM_JOB_ID or ``job_id`` sets it.
    """

    def __init__(
        self,
        config: Union[FtmemConfig, Mapping[str, Any], None] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        layout: Optional[ParallelLayout] = None,
        format: Optional[str] = None,
        origin: Optional[str] = None,
    ):
        compat.check("torch")
        self.config = config if isinstance(config, FtmemConfig) else FtmemConfig.from_dict(config)
        # The waits the environment may set, read now: a bad value stops the job at its start, not where it waits.
        finish_timeout_s(), collective_timeout_s(), self.config.failure_detection.resolve()
        #: the network interface ftmem's gloo groups take (None: gloo's own choice); an interface
        #: this host lacks is refused here, before any group is made
        self.network_interface = self.config.network.resolve()
        rank, world_size = _rank_and_world(rank, world_size)
        self.identity = RankIdentity.resolve(self.config, rank, world_size, origin)
        self.layout = layout or ParallelLayout.data_parallel(world_size)
        self.layout.validate(world_size)
        self.format = format
        k, m = self.config.ec.resolve(self.identity.num_nodes)
        self.topology = Topology(world_size, self.identity.ranks_per_node,
                                 tuple(ec_groups(self.identity.num_nodes, k, m)))
        self._make_groups(parity=m > 0)
        refuse_another_node_layout(self.identity, self.job_group)
        self._attach_to_the_node()
        # This run's id, the same on every rank: with a count of its saves, it names each save
        # (CommitRecord.uid); a run that starts from scratch or from disk starts a timeline of that name.
        self._run = gather(secrets.token_hex(8), self.job_group)[0]
        self._saves = 0
        self.timeline: Optional[str] = None  # of the versions this run saves: set at its resume or first save
        self.lineage: Optional[VersionRef] = None  # recorded in each version (CommitRecord.lineage)
        self._start_the_pipeline()
        self._closed = self._ended = False
        self._verdict: Optional[str] = None  # the job's verdict on its end (end_of_job), once self._ended
        self._pid = os.getpid()  # a forked child's copy of the engine acts for nobody
        self._watch_the_process()

    def _make_groups(self, parity: bool) -> None:
        """ftmem's own gloo groups (collective, the same on every rank): the job's, the DP
        replicas', and the EC column's where the job keeps ``parity``; none on one rank."""
        rank, world_size = self.rank, self.identity.world_size
        dp_ranks = self.layout.dp_group_of(rank)
        gloo = dp_group = column = None
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise FtmemError(
                    f"ftmem with {world_size} ranks needs torch.distributed initialized before the engine "
                    f"is created (call dist.init_process_group first)."
                )
            interface = self.network_interface
            sizes = [world_size, len(dp_ranks)] + ([len(self.topology.column_ranks(*self.topology.column_of(rank)))]
                                                   if parity else [])
            open_files.make_room(open_files.needed(sizes, open_files.ENGINE),
                                 "ftmem's process groups and connections")
            if interface is not None:
                job_info("ftmem's process groups take the network interface %s", interface)
            gloo = new_group(interface=interface)
            dp_group = make_dp_groups(self.layout, rank, interface)
            if parity:
                column = ColumnCoder(self.topology, rank)
                column.pg = make_column_groups(self.topology, rank, interface)
        self._dp_shard = len(dp_ranks) > 1 and self.config.dp_shard in ("on", "auto")
        #: this rank's DP replicas and their gloo group, the training thread's (adapters use it too:
        #: one group per DP group)
        self.dp_peers = DataParallelPeers(ranks=dp_ranks, group=dp_group if len(dp_ranks) > 1 else None,
                                          sharded=self._dp_shard)
        self._flush_peers = self.dp_peers  # the flush's gather's (a group of its own: persist_with)
        #: a gloo group of the whole job, apart from the training groups (None on one rank)
        self.job_group = gloo
        self._column = column
        # Held from the start: the job's end decides on it, also after the script destroyed
        # torch.distributed's groups (and, on the rank whose process serves it, keeps it served).
        self._job_store = dist.distributed_c10d._get_default_store() if world_size > 1 else None
        # The end vote's connection, made now: at the job's end every rank would make one at once.
        self._end_connection = StandingConnection(self._job_store, finish_timeout_s()) if world_size > 1 else None

    def _attach_to_the_node(self) -> None:
        """This rank's SMP (started if the node has none) and its slots in the node's shared
        memory, once no other job's versions are found there under this job's id."""
        identity = self.identity
        self._smp = SmpClient(identity.node_dir, identity.node_ranks)
        self._smp.request("hello", self.rank, os.getpid())
        self.store = RankStore(identity.node_dir, self.rank, self.config.slots)
        refuse_foreign_versions(self.store, identity, self.job_group)
        self.memory = SlotMemory(self.store, self._smp, self.config.shm_budget)

    def _start_the_pipeline(self) -> None:
        """The restore's side and the commit pipeline's, whose collectives wait bounded and
        name the ranks that did not come (their arrivals keyed by this run)."""
        gloo, column, world_size = self.job_group, self._column, self.identity.world_size
        self._restorer = Restorer(self.store, self.memory, self.topology, column, gloo, self.dp_peers, self.layout)
        arrivals = None
        if gloo is not None:
            # Both kinds note over one connection, one wait at a time (each wait joins its note).
            notes = StandingConnection(self._job_store, NOTE_AFTER_S)
            arrivals = Arrivals(notes, f"ftmem/arrivals/{self._run}/rounds", self.rank, range(world_size))
            if column is not None:
                column.arrivals = Arrivals(notes, f"ftmem/arrivals/{self._run}/column", self.rank,
                                           [dist.get_global_rank(column.pg, i) for i in range(column.group.n)])
        self._committer = Committer(self.store, self.memory, column, gloo, arrivals)
        self._planner = Planner()

    def _watch_the_process(self) -> None:
        """What watches from outside the training's calls: how the process ends
        (:mod:`ftmem._common.exit_status`), the failure detector's threads, the preemption's
        signal handler."""
        exit_status.watch()
        self._detector = FailureDetector.start(self.config.failure_detection.resolve(), self._run, self.identity)
        self._preemption = Preemption(self.config.preemption, self.identity, self._job_store, self._run,
                                      self._committer, self._detector)

    @property
    def rank(self) -> int:
        return self.identity.rank

    # -- save -----------------------------------------------------------------
    def save(self, state: Any, version: int, replicated: Optional[Callable[[torch.Tensor], bool]] = None,
             persist: bool = False, written_in_forward: Optional[Callable[[torch.Tensor], bool]] = None,
             files: Optional[Written] = None) -> SaveHandle:
        """Start snapshotting ``state`` as ``version``; returns without waiting for the copy,
        and never for the protection of this or an earlier save (:mod:`ftmem._engine.commit`).
        Raises the protection thread's error, and, once, that of an earlier save whose copy or
        commit failed (a full file system refusing its marker, say), which its handle holds too.

        ``replicated(t)`` says whether tensor ``t`` is identical on every replica of
        this rank's DP group (e.g. module weights under ZeRO 0-2); with DP sharding
        on, each replica keeps only its 1/D slice of those, and restore gathers them
        back. Every replica must then hand in the same replicated tensors, in order.

        Until the returned handle's ``wait_reusable()`` returns, the tensors in
        ``state`` must not be modified (call it before the optimizer step), but for those
        ``written_in_forward(t)`` names: tensors the next forward may write in place before
        the optimizer step (a module's buffers, as BatchNorm's running statistics; a
        client's counters), which are copied before this returns, so that nothing in the
        version is newer than the save (they are small; the rest is copied in the background). Every rank
        saves the same versions, in increasing order; saving a version <= one already held
        first waits for the saves in flight, then drops the held ones from there on (a
        timeline the job has abandoned).

        With ``persist`` (the same on every rank) the version is also flushed to disk
        once protected (or the newer version protected in its place), whatever the
        interval of :meth:`persist_with`.

        ``files``: what the caller wrote to disk for this version (DeepSpeed's stubs), left
        unsynced: the copy thread syncs them and the directories that name them before the
        version commits, so that a committed version's files survive a power loss while the
        training thread never waits for the disk. A failed sync fails the save.
        """
        if persist and self.flusher is None:
            raise FtmemError("save(persist=True) needs a persistent tier: call persist_with first.")
        self._committer.raise_failure()
        self._committer.raise_failed_copy()
        exit_status.carried_on()
        with modes_off():  # a mode the training has on would make each look at each tensor a Python call
            return self._save(state, version, replicated, persist, written_in_forward, files)

    def _save(self, state: Any, version: int, replicated: Optional[Callable[[torch.Tensor], bool]], persist: bool,
              written_in_forward: Optional[Callable[[torch.Tensor], bool]], files: Optional[Written]) -> SaveHandle:
        split = split_state(state)
        tensors = split.tensors
        flags = [bool(replicated(t)) for t in tensors] if (self._dp_shard and replicated) else None
        replica = (self.dp_peers.ranks.index(self.rank), len(self.dp_peers.ranks))
        plan = self._planner.plan(tensors, split.elements, flags, replica)
        if self._saved_at_or_after(version):
            self.wait_protected()
            self.store.drop_from(version)
            self._committer.forget_from(version)
        self.memory.reserve(plan.nbytes, self._parity_estimate(plan.nbytes))
        ref = self.next_save(version)
        self._saves, self.timeline = self._saves + 1, ref.timeline
        # The slot is the copy thread's choice, made when the copy starts.
        record = CommitRecord(version=version, rank=self.rank, slot=-1, plan=plan, skeleton=split.skeleton,
                              layout=self.layout, format=self.format, origin=self.identity.origin,
                              lineage=self.lineage, uid=ref.uid, timeline=ref.timeline)
        handle = SaveHandle(version, ref, copy_bound_s(plan.nbytes), len(tensors))
        sources = taken_now(tensors, written_in_forward)
        self._committer.start(handle, record, sources, capture_cuda_order(sources), persist, files)
        return handle

    def _saved_at_or_after(self, version: int) -> bool:
        """Whether this job saved ``version`` or a newer one before: in this engine, else (its
        first save) in memory, where a run before it left them."""
        newest = self._committer.lag().newest_saved
        if newest is not None:
            return newest >= version
        return any(v >= version for v in set(self.store.committed()) | set(self.store.parity_held()))

    def next_save(self, version: int) -> VersionRef:
        """The save that the next :meth:`save` of ``version`` makes: for what must name it before
        it starts (DeepSpeed's stubs, which must exist whenever memory holds the version)."""
        return VersionRef(self.identity.job, version, f"{self._run}.{self._saves + 1}", self.timeline or self._run)

    def _parity_estimate(self, nbytes: int) -> int:
        """Parity bytes for ``nbytes`` of data, assuming the column's members are alike."""
        return self._column.parity_nbytes(piece_size([nbytes], self._column.group.k)) if self._column else 0

    def persist_with(self, flusher: Flusher) -> None:
        """Flush protected versions through ``flusher`` (see :mod:`ftmem._disk.persist`): those
        saved with ``persist=True`` and every ``flusher.interval``-th one. Collective where the
        job keeps DP-sharded state (the flush's DP group)."""
        # The protection thread gathers a DP-sharded version back for its flush, on a DP group of
        # its own: the training thread's collectives on dp_peers.group (an adapter's at each save)
        # would otherwise meet that gather in another order on each rank, a hang.
        peers = self.dp_peers
        if peers.group is not None and peers.sharded:
            open_files.make_room(open_files.needed([len(peers.ranks)], 0), "the persistent tier's DP group")
            peers = dataclasses.replace(peers, group=make_dp_groups(self.layout, self.rank, self.network_interface))
        self._flush_peers = peers
        self._committer.handover = FlushHandOver(
            flusher, lambda record, slot_bytes: self._restorer.copy_out(record, slot_bytes, torch.device("cpu"),
                                                                        peers=self._flush_peers))

    def wait_protected(self) -> None:
        """Until every save so far is protected by every rank, or passed over for a newer one
        that is (re-raises the error of a save that failed), and the copy and protection
        threads are idle, any flush handed over. Training never needs this: an end of the job,
        a restore, a flush do; and so does any other use of ftmem's groups, which the
        protection thread's collectives would otherwise reach in another order on each rank
        (one rank's all_reduce met another's all_gather: a hang, or numbers taken from the
        wrong call)."""
        self._committer.drain()

    # 0.1.0's wait for the save in flight; waiting for its protection waits for that too.
    wait = Renamed("wait_protected", since="0.2.0", removed_in="0.3.0")

    @property
    def anchor(self) -> Optional[int]:
        """The version a crash of this job leaves at least: the newest saved and protected
        job-wide, or, until one is, the version this run resumed from."""
        return self._committer.anchor

    @property
    def protected_saved(self) -> Optional[int]:
        """The newest version this engine saved and protected."""
        return self._committer.protected_saved

    def lag(self) -> Lag:
        """How far protection is behind the saves (:class:`ftmem._engine.commit.Lag`)."""
        return self._committer.lag()

    def wait_flushed(self) -> None:
        """Until every save so far is protected and any flush it started is on disk.
        Without a persistent tier: until every save is protected. Raises if the last flush
        failed (the training itself went on: memory still protects the version)."""
        self.wait_protected()
        if self.flusher is not None:
            self.flusher.wait()
            self.flusher.raise_failure()

    @property
    def flusher(self) -> Optional[Flusher]:
        """The persistent tier's (None without one)."""
        return self._committer.handover.flusher if self._committer.handover is not None else None

    @property
    def last_flush(self) -> Optional[FlushTimes]:
        """This rank's part of the last completed flush (bytes, seconds, of them syncing); None if none."""
        return self.flusher.last_flush if self.flusher is not None else None

    def flush_newest(self) -> None:
        """Write the newest protected version to the persistent tier now, unless it is
        there already (collective: every rank; at the end of a job). Raises if it fails."""
        flusher = self.flusher
        self.wait_flushed()
        if flusher is None or self.anchor is None or flusher.flushed_version == self.anchor:
            return
        record = self.store.read_commit(self.anchor)
        self._committer.handover.now(record, self.memory.bytes_of(record.slot))

    # -- restore --------------------------------------------------------------
    def versions(self) -> list[int]:
        """Versions this rank holds committed in shared memory, oldest first."""
        return sorted(self.store.committed())

    def restore(self, version: Optional[int] = None, device: Union[str, torch.device] = "cpu",
                drop_newer: bool = True, into: Optional[RestoreTargets] = None) -> Optional[Restored]:
        """Restore the newest version every rank can recover (collective over all ranks).

        Each rank verifies its held data and parity against their checksums; a mismatch is
        logged and treated as a lost shard, never returned. A rank that lacks the version (its
        node was lost, or its copy is corrupt) gets its data rebuilt from its EC group's parity.
        Returns None if no rank holds any version (a fresh job); raises NotRecoverableFromMemory,
        naming the groups and nodes, if versions are held (even if all prove damaged) but none
        is recoverable for every rank, and LayoutMismatch if it was saved under another layout.
        Newer versions are dropped unless ``drop_newer`` is False (tools' reads). ``into`` names
        the application's tensors to restore into (:mod:`ftmem._state.destinations`).

        The restore runs in two phases, :meth:`choose` and :meth:`read`, which an adapter calls
        apart, to build what it restores into between them without a collective in flight."""
        chosen = self.choose(version)
        if chosen is None:
            return None
        return self.read(chosen, device, into(chosen.saved) if into is not None else None, drop_newer)

    def choose(self, version: Optional[int] = None, timeline: Optional[str] = None) -> Optional[Chosen]:
        """The restore's first phase (collective): the version agreed on, checked and rebuilt,
        nothing copied yet (:meth:`ftmem._engine.restore.Restorer.choose`); None for a fresh job.
        With ``timeline``, versions of any other are not candidates."""
        self.wait_protected()  # the saves in flight are done with, and the protection thread leaves the groups to this one
        return self._restorer.choose(version, timeline)

    def versions_off(self, timeline: str) -> list[int]:
        """The versions this rank holds (data or parity) of a timeline other than ``timeline``."""
        return sorted(off_timeline(*self._restorer.held(), timeline))

    def read(self, chosen: Chosen, device: Union[str, torch.device] = "cpu", into: Any = None,
             drop_newer: bool = True) -> Restored:
        """The restore's second phase (collective): ``chosen`` copied out into the tensors
        ``into`` names for :attr:`Chosen.saved`, else fresh memory. Every rank holds the
        version now: it stays until the job protects a newer one."""
        with modes_off():  # as the save's: each look at each tensor would be a Python call under a mode
            restored = self._restorer.read(chosen, torch.device(device), into, drop_newer)
        self._committer.keep(restored.version)
        return restored

    # -- end --------------------------------------------------------------------
    def close(self, job_finished: bool = False) -> None:
        """Finish the save in flight, let go of the slots and of ftmem's gloo groups
        (collective: every rank closes). With ``job_finished`` on every rank, the job says it
        is done: each rank tells its SMP, which frees the node's shared memory once all its
        ranks have. If any rank closes without it, fails to, or its last flush failed, the
        snapshots stay for a restarted job (or ``ftmem clean``). A second call does nothing,
        as does a call in a forked child (the engine is its parent's)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self._preemption.uninstall()
        keep = None if job_finished else "it keeps the job's memory"
        try:
            self.wait_flushed()
        except BaseException as e:
            keep = f"its last save or flush failed ({e})"  # what did not reach the disk must stay in memory
            raise
        finally:
            self._committer.shutdown()
            self.memory.unmap()
            # Every rank frees, or none: a rank that dies after the job agreed it finished (in
            # its last flush, say) keeps every node's memory, not only its own. (A job that did
            # not finish frees nothing, as every rank knows.)
            if self.end_of_job(keep) is None and self._agree("free", keep) is None:
                self._smp.finish(self.rank)
            self._smp.close()
            self._end_groups()

    def resumed_at(self, version: Optional[int], lineage: Optional[VersionRef], timeline: str) -> None:
        """The job resumed ``version`` (of its own, or adopted: ``lineage``) of ``timeline``: until
        it saves again that is its newest version, which a job ending without a save must keep in
        memory or flush, never free; and its next versions carry on ``lineage``
        (:mod:`ftmem._engine.elastic`) and the timeline."""
        self._committer.keep(version)
        self.lineage, self.timeline = lineage, timeline

    def end_of_job(self, problem: Optional[str]) -> Optional[str]:
        """The job's verdict on its end, the same on every rank: None if every rank finished,
        else why not (collective; ``problem``: why this rank did not). Decided once: a second
        call (the close after the adapter's end) gives the same verdict.

        Only a job-wide finish is leaving: then the failure detector stops, and the ranks end
        one after the other. Otherwise it falls silent, and the ranks still running (stuck in
        a collective of the training, which may never fail by itself) hear from their own
        detectors, within its timeout, that this rank is gone."""
        if not self._ended:
            self._verdict, self._ended = self._agree("end", problem), True
        if self._detector is not None:
            self._detector.stop() if self._verdict is None else self._detector.fall_silent()
        return self._verdict

    def _agree(self, what: str, objection: Optional[str]) -> Optional[str]:
        """None if every rank comes to the decision ``what`` of the job's end without an
        objection (:func:`ftmem._common.agreement.unanimous`, on the job's store): a rank with
        one does not wait for the others, one without waits at most :func:`finish_timeout_s`.
        Else why not, the same on every rank; a store that does not answer is a no."""
        try:
            wait_s = finish_timeout_s()
            prefix = f"ftmem/{what}/{self._run}"
            verdict = unanimous(self._end_connection, prefix, self.rank, self.identity.world_size,
                                objection, wait_s, SharedMemoryRound.of(self.identity, prefix))
        except Exception as e:  # the store is gone (the process that served it ended) or hung
            verdict = no_answer(e)
        if verdict is not None and objection is None:
            rank_warning(self.rank, "could not agree with the other ranks that the job finished (%s); the job's "
                         "memory stays for a restart", verdict)
        return verdict

    def _end_groups(self) -> None:
        """Destroy the engine's gloo groups (and the persistent tier's) and let go of every
        reference to them, so that each group's destructor runs now and joins its gloo threads.
        Left for interpreter shutdown, those threads end, or drop a collective's tensor (pytorch/
        pytorch#190489), while Python is finalizing, which now and then aborted a rank at its
        clean exit ("terminate called without an active exception")."""
        destroy_groups(self.job_group, self.dp_peers.group, getattr(self._column, "pg", None),
                       self._flush_peers.group if self._flush_peers is not self.dp_peers else None)
        self.job_group = None
        self.dp_peers = self._flush_peers = dataclasses.replace(self.dp_peers, group=None)
        self._restorer.forget_groups(self.dp_peers)
        self._committer.forget_groups()
        if self._column is not None:
            self._column.pg = None
