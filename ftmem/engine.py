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
"""
from __future__ import annotations

import logging
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import testhooks
from .config import FtmemConfig
from .copier import CudaPinning, capture_cuda_order, copy_into_slot, read_from_slot, shard_bytes
from .errors import CorruptShard, FtmemError, LayoutMismatch
from .handle import SaveHandle
from .identity import RankIdentity
from .layout import SnapshotPlan
from .parallel import ParallelLayout, make_dp_groups
from .persist import Flusher, FlushTarget
from .placement import ec_groups
from .protect import ColumnCoder, Topology, make_column_groups, piece_size, plan_recovery, with_slot
from .serialize import join_state, split_state
from .slots import DATA, PARITY, CommitRecord, RankStore
from .smp_client import SmpClient

log = logging.getLogger("ftmem")


@dataclass
class Restored:
    version: int
    state: Any
    rebuilt: bool = False  # this rank's data was rebuilt from its EC group's parity


def _gather(obj: Any, group) -> list:
    """Every rank's ``obj``, indexed by rank (just ours without a group)."""
    if group is None:
        return [obj]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


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
    training groups, for agreeing on versions and moving parity).
    """

    def __init__(
        self,
        config: Union[FtmemConfig, Mapping[str, Any], None] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        layout: Optional[ParallelLayout] = None,
    ):
        self.config = config if isinstance(config, FtmemConfig) else FtmemConfig.from_dict(config)
        rank, world_size = _rank_and_world(rank, world_size)
        self.identity = RankIdentity.resolve(self.config, rank, world_size)
        self.layout = layout or ParallelLayout.data_parallel(world_size)
        self.layout.validate(world_size)
        self._dp_group = self.layout.dp_group_of(rank)
        shard = self.config.dp_shard == "on" or (self.config.dp_shard == "auto" and len(self._dp_group) > 1)
        self._dp_shard = shard and len(self._dp_group) > 1
        k, m = self.config.ec.resolve(self.identity.num_nodes)
        self.topology = Topology(world_size, self.identity.ranks_per_node,
                                 tuple(ec_groups(self.identity.num_nodes, k, m)))
        self._gloo = self._dp_pg = None
        self._column: Optional[ColumnCoder] = None
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise FtmemError(
                    f"ftmem with {world_size} ranks needs torch.distributed initialized before the engine "
                    f"is created (call dist.init_process_group first)."
                )
            self._gloo = dist.new_group(backend="gloo")
            if self._dp_shard:
                self._dp_pg = make_dp_groups(self.layout, rank)
            if m > 0:
                self._column = ColumnCoder(self.topology, rank)
                self._column.pg = make_column_groups(self.topology, rank)
        node_ranks = list(range(self.identity.node * self.identity.ranks_per_node,
                                (self.identity.node + 1) * self.identity.ranks_per_node))
        self._smp = SmpClient(self.identity.node_dir, node_ranks)
        self._smp.request("hello", rank)
        self.store = RankStore(self.identity.node_dir, rank)
        self._maps: dict[tuple[str, int], tuple[mmap.mmap, torch.Tensor]] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftmem-copy")
        self._closed = False
        self._flusher: Optional[Flusher] = None
        self._inflight: Optional[SaveHandle] = None
        self._last_copy: Optional[Future] = None  # the copy thread's last task (it never raises)
        self._pinning = CudaPinning() if torch.cuda.is_available() else None
        self._side_streams: dict = {}

    @property
    def rank(self) -> int:
        return self.identity.rank

    # -- memory ---------------------------------------------------------------
    def _parity_estimate(self, nbytes: int) -> int:
        """Parity bytes for ``nbytes`` of data, assuming the column's members are alike."""
        return self._column.parity_nbytes(piece_size([nbytes], self._column.group.k)) if self._column else 0

    def reserve(self, nbytes: int, parity_nbytes: Optional[int] = None) -> None:
        """Have the SMP allocate the slots for ``nbytes`` of data now (checks the shm budget)."""
        parity_nbytes = self._parity_estimate(nbytes) if parity_nbytes is None else parity_nbytes
        grow = [kind for kind, want in ((DATA, nbytes), (PARITY, parity_nbytes)) if self.store.capacity(kind) < want]
        if grow:
            self._unmap(grow)
            self._smp.request("alloc", self.rank, max(nbytes, self.store.capacity(DATA)),
                              max(parity_nbytes, self.store.capacity(PARITY)))

    def _slot_bytes(self, slot: int, kind: str = DATA) -> torch.Tensor:
        if (kind, slot) not in self._maps:
            mm = self.store.map_slot(slot, writable=True, kind=kind)
            self._maps[(kind, slot)] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return self._maps[(kind, slot)][1]

    def _unmap(self, kinds=(DATA, PARITY)) -> None:
        for key in [key for key in self._maps if key[0] in kinds]:
            mm, view = self._maps.pop(key)
            if self._pinning is not None:
                self._pinning.release(view)
            del view
            mm.close()

    # -- save -----------------------------------------------------------------
    def save(self, state: Any, version: int, replicated: Optional[Callable[[torch.Tensor], bool]] = None,
             persist: bool = False) -> SaveHandle:
        """Start snapshotting ``state`` as ``version``; returns without waiting for the copy.

        ``replicated(t)`` says whether tensor ``t`` is identical on every replica of
        this rank's DP group (e.g. module weights under ZeRO 0-2); with DP sharding
        on, each replica keeps only its 1/D slice of those, and restore gathers them
        back. Every replica must then hand in the same replicated tensors, in order.

        Until the returned handle's ``wait_reusable()`` returns, the tensors in
        ``state`` must not be modified (call it before the optimizer step). The
        previous save must be committed (and protected) by every rank; this call
        waits for that, which in a training loop has happened during the
        forward/backward. Versions increase; saving a version <= one already held
        drops the held ones from there on (a timeline the job has abandoned).

        With ``persist`` (the same on every rank) the version is also flushed to disk
        once protected, whatever the interval of :meth:`persist_with`.
        """
        if persist and self._flusher is None:
            raise FtmemError("save(persist=True) needs a persistent tier: call persist_with first.")
        self.wait()
        skeleton, tensors = split_state(state)
        flags = [bool(replicated(t)) for t in tensors] if (self._dp_shard and replicated) else None
        replica = (self._dp_group.index(self.rank), len(self._dp_group))
        plan = SnapshotPlan.for_tensors(tensors, flags, replica)
        self.reserve(plan.nbytes)
        self.store.drop_from(version)
        slot = self.store.free_slot()
        slot_bytes = self._slot_bytes(slot)
        if self._pinning is not None and any(t.is_cuda for t in tensors):
            self._pinning.ensure(slot_bytes)
        cuda_ready = capture_cuda_order(tensors)
        handle = SaveHandle(version)
        record = CommitRecord(version=version, rank=self.rank, slot=slot, plan=plan, skeleton=skeleton,
                              layout=self.layout)
        self._last_copy = self._copier.submit(self._copy_and_commit, handle, record, tensors, slot_bytes, cuda_ready,
                                              persist)
        self._inflight = handle
        return handle

    def _copy_and_commit(self, handle: SaveHandle, record: CommitRecord, tensors, slot_bytes, cuda_ready,
                         persist: bool) -> None:
        version = record.version
        try:
            self.store.drop_slot(record.slot)  # what the slot held becomes invisible first
            copy_into_slot(slot_bytes, tensors, record.plan, cuda_ready, self._side_streams,
                           halfway=lambda: testhooks.at("mid_copy", self.rank, version))
            self.store.write_commit(record)
            testhooks.at("after_commit", self.rank, version)
            handle._set_reusable()
            try:
                self._smp.request("committed", self.rank, version)
            except Exception as e:  # the SMP seals it on its next rescan (restart or sync)
                log.warning("ftmem: rank %d could not notify its SMP of version %d: %s", self.rank, version, e)
            if self._column is not None:
                self._protect(record, slot_bytes)
            if self._gloo is not None:
                # Job-wide: every rank committed (and protected) v. The next save waits
                # for this before overwriting the older slot, so a rank one save ahead
                # of a peer that crashed mid-copy still holds the version the peer has.
                lowest = torch.tensor([version], dtype=torch.int64)
                dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self._gloo)
                if int(lowest) != version:
                    raise FtmemError(f"ranks saved different versions at once (this rank {version}, "
                                     f"another {int(lowest)}): every rank must save the same version.")
                if self._column is not None:
                    self.store.write_protected(version)
            handle._set_committed()
            if self._flusher is not None and self._flusher.due(asked=persist):
                self._hand_over_for_flush(record, slot_bytes)
        except BaseException as e:
            handle._fail(e)

    def persist_with(self, target: FlushTarget, root: str, interval: int = 0, keep: Optional[int] = None) -> None:
        """Flush protected versions to ``root`` through ``target`` (see :mod:`ftmem.persist`):
        those saved with ``persist=True`` and, with ``interval`` > 0, every interval-th
        one. ``keep``: how many flushed checkpoints to retain (None: all). Collective:
        every rank, once."""
        self._flusher = Flusher(root, interval, keep, target, self.rank, self.identity.world_size)

    def wait_flushed(self) -> None:
        """Until every save so far is protected and any flush it started is on disk (or
        failed, logged)."""
        if self._flusher is not None:
            if self._last_copy is not None:
                self._last_copy.result()  # the copy thread has handed over what was due
            self._flusher.wait()

    @property
    def last_flush(self) -> Optional[tuple[int, float]]:
        """(bytes this rank wrote, seconds) of the last completed flush; None if none."""
        return self._flusher.last_flush if self._flusher is not None else None

    def _hand_over_for_flush(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        """A whole private copy of the version for the flusher, unless a flush is still
        running on any rank (then this version is skipped: flushes never queue)."""
        busy = torch.tensor([int(self._flusher.busy())], dtype=torch.int64)
        if self._gloo is not None:
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self._gloo)
        if busy.item():
            print(f"ftmem: version {record.version} not flushed: the previous flush is still running "
                  f"(the disk is slower than persist.interval saves)", flush=True)
            return
        self._flusher.start(record.version, self._read_version(record, slot_bytes, torch.device("cpu")))

    def _protect(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        lengths, records, piece = self._column.exchange_info(record)
        self.reserve(record.plan.nbytes, self._column.parity_nbytes(piece))
        parity = self._slot_bytes(record.slot, PARITY).numpy()
        self.store.write_parity(self._column.protect(record, slot_bytes.numpy(), parity, lengths, records, piece))

    def wait(self) -> None:
        """Wait until the save in flight is committed by every rank (re-raises its error)."""
        if self._inflight is not None:
            handle, self._inflight = self._inflight, None
            handle.wait_committed()

    def wait_sealed(self) -> None:
        """Wait until the node's SMP has checksummed every committed version."""
        self.wait()
        self._smp.request("sync")

    # -- what is held ---------------------------------------------------------
    def versions(self) -> list[int]:
        """Versions this rank holds committed in shared memory, oldest first."""
        return sorted(self.store.committed())

    def _intact(self) -> tuple[dict[int, CommitRecord], dict]:
        """Held versions whose checksums match: data records, and parity (record, bytes)."""
        data, parity = {}, {}
        for v in self.versions():
            try:
                data[v] = self.store.verify(v)
            except CorruptShard as e:
                log.warning("ftmem: %s Treating it as lost.", e)
                self.store.drop(v)
        for v, slot in self.store.parity_held().items():
            try:
                parity[v] = (self.store.verify_parity(v), self._slot_bytes(slot, PARITY).numpy())
            except CorruptShard as e:
                log.warning("ftmem: %s Treating it as lost.", e)
                self.store.drop_parity(v)
        return data, parity

    # -- restore --------------------------------------------------------------
    def restore(self, version: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> Optional[Restored]:
        """Restore the newest version every rank can recover (collective over all ranks).

        Each rank verifies its held data and parity against their checksums; a
        mismatch is logged and treated as a lost shard, never returned. A rank that
        lacks the version (its node was lost, or its copy is corrupt) gets its data
        rebuilt from its EC group's parity. Returns None if no rank holds any version
        (a fresh job); raises :class:`~ftmem.protect.NotRecoverableFromMemory`, naming
        the groups and nodes, if versions are held but none is recoverable for every
        rank. Held versions newer than the restored one are dropped.
        """
        self.wait_sealed()  # whatever was committed but not sealed yet gets its checksum now
        data, parity = self._intact()
        held = _gather((sorted(data), sorted(parity)), self._gloo)
        decision = plan_recovery(self.topology, [set(d) for d, _ in held], [set(p) for _, p in held], version)
        if decision is None:
            log.info("ftmem: rank %d: no version held by any rank: a fresh start", self.rank)
            return None
        chosen, to_rebuild = decision
        if self._column is not None and any(r in to_rebuild for r in self._column_ranks()):
            self._rebuild(chosen, held, data, parity)
            data = {chosen: self.store.verify(chosen)} if self.rank in to_rebuild else data
        record = data[chosen]
        mismatch = record.layout and self.layout.mismatch(record.layout)
        if mismatch:
            raise LayoutMismatch(f"version {chosen} was saved under another parallel layout ({mismatch}). "
                                 f"Restart with the layout it was saved with, or restore from a disk checkpoint.")
        state = self._read_version(record, self._slot_bytes(record.slot), torch.device(device))
        self.store.drop_from(chosen + 1)
        return Restored(version=chosen, state=state, rebuilt=self.rank in to_rebuild)

    def _read_version(self, record: CommitRecord, slot_bytes: torch.Tensor, device: torch.device) -> Any:
        """The whole state of a version, in private memory on ``device``; a DP-sharded one
        is gathered back from the replicas (collective over the DP group)."""
        stream = self._gather_replicated(record.plan, slot_bytes) if record.plan.shard else None
        return join_state(record.skeleton, read_from_slot(slot_bytes, record.plan, device, stream))

    def _gather_replicated(self, plan: SnapshotPlan, slot_bytes: torch.Tensor) -> torch.Tensor:
        """The whole replicated stream, from every DP replica's slice (collective over the DP group)."""
        shard = plan.shard
        if self._dp_pg is None or shard.count != len(self._dp_group):
            raise LayoutMismatch(f"this version is DP-sharded over {shard.count} replicas, but the job now has "
                                 f"DP sharding {'on' if self._dp_shard else 'off'} over {len(self._dp_group)}.")
        sizes = _gather(shard.stream_nbytes, self._dp_pg)
        if len(set(sizes)) != 1:
            raise FtmemError(f"the replicas {list(self._dp_group)} saved different replicated state "
                             f"(stream sizes {sizes}): every replica must mark the same tensors replicated.")
        # Each replica broadcasts its slice straight into place: on gloo, D broadcasts
        # move the bytes about twice as fast as one all_gather, and need no staging.
        stream = torch.empty(shard.stream_nbytes, dtype=torch.uint8)
        for d, src in enumerate(self._dp_group):
            start, end = shard.stream_nbytes * d // shard.count, shard.stream_nbytes * (d + 1) // shard.count
            if d == shard.index:
                stream[start:end] = shard_bytes(slot_bytes, plan)
            dist.broadcast(stream[start:end], src=src, group=self._dp_pg)
        return stream

    def _column_ranks(self) -> list[int]:
        t = self.topology
        return t.column_ranks(t.group_index(self.rank), self.identity.local_rank)

    def _rebuild(self, version: int, held, data: dict, parity: dict) -> None:
        ranks = self._column_ranks()
        has_data = {pos for pos, r in enumerate(ranks) if version in held[r][0]}
        has_parity = {pos for pos, r in enumerate(ranks) if version in held[r][1]}
        mine = self._slot_bytes(data[version].slot).numpy() if version in data else None
        rebuilt = self._column.rebuild(has_data, has_parity, mine, parity.get(version))
        if rebuilt is None:
            return
        record, raw = rebuilt
        self.reserve(record.plan.nbytes)
        self.store.drop(version)
        slot = self.store.free_slot()
        self.store.drop_slot(slot)
        self._slot_bytes(slot).numpy()[: len(raw)] = raw
        self.store.write_commit(with_slot(record, slot))
        self._smp.request("committed", self.rank, version)
        self._smp.request("sync")
        log.info("ftmem: rank %d rebuilt version %d (%d bytes) from its EC group's parity", self.rank, version, len(raw))

    # -- end --------------------------------------------------------------------
    def close(self, job_finished: bool = False) -> None:
        """Finish the save in flight and let go of the slots.

        With ``job_finished`` the rank tells its SMP the job ended cleanly; when all
        ranks of the node have, the SMP frees the node's shared memory and exits.
        Without it the snapshots stay for a restarted job (or ``ftmem clean``).
        A second call does nothing (an exit hook may come after an explicit close).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            self.wait_flushed()
        finally:
            self._copier.shutdown(wait=True)
            self._unmap()
            if job_finished:
                self._smp.finish(self.rank)
            self._smp.close()
