"""The public engine: snapshot a rank's state into its node's shared memory and
restore it after a crash.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import testhooks
from .agree import choose_version, gather_held
from .config import FtmemConfig
from .copier import CudaPinning, capture_cuda_order, copy_into_slot, read_from_slot
from .errors import CorruptShard, FtmemError
from .handle import SaveHandle
from .identity import RankIdentity
from .layout import SnapshotPlan
from .placement import ec_groups, group_of
from .serialize import join_state, split_state
from .slots import NUM_SLOTS, CommitRecord, RankStore
from .smp_client import SmpClient

log = logging.getLogger("ftmem")


@dataclass
class Restored:
    version: int
    state: Any


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
    collective (it creates the engine's own gloo group, kept apart from the
    training groups, for agreeing on versions).
    """

    def __init__(
        self,
        config: Union[FtmemConfig, Mapping[str, Any], None] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        self.config = config if isinstance(config, FtmemConfig) else FtmemConfig.from_dict(config)
        rank, world_size = _rank_and_world(rank, world_size)
        self.identity = RankIdentity.resolve(self.config, rank, world_size)
        self._gloo = None
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise FtmemError(
                    f"ftmem with {world_size} ranks needs torch.distributed initialized before the engine "
                    f"is created (call dist.init_process_group first)."
                )
            self._gloo = dist.new_group(backend="gloo")
        node_ranks = list(range(self.identity.node * self.identity.ranks_per_node,
                                (self.identity.node + 1) * self.identity.ranks_per_node))
        k, m = self.config.ec.resolve(self.identity.num_nodes)
        self.ec_group = group_of(ec_groups(self.identity.num_nodes, k, m), self.identity.node)
        parity_fraction = self.ec_group.m / self.ec_group.k
        self._smp = SmpClient(self.identity.node_dir, node_ranks, parity_fraction)
        self._smp.request("hello", rank)
        self.store = RankStore(self.identity.node_dir, rank)
        self._slots: list[Optional[tuple[mmap.mmap, torch.Tensor]]] = [None] * NUM_SLOTS
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftmem-copy")
        self._inflight: Optional[SaveHandle] = None
        self._pinning = CudaPinning() if torch.cuda.is_available() else None
        self._side_streams: dict = {}

    @property
    def rank(self) -> int:
        return self.identity.rank

    # -- memory ---------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Have the SMP allocate both slots for ``nbytes`` now (checks the shm budget)."""
        if self.store.capacity() < nbytes:
            self._unmap_slots()
            self._smp.request("alloc", self.rank, nbytes)

    def _slot_bytes(self, slot: int) -> torch.Tensor:
        if self._slots[slot] is None:
            mm = self.store.map_slot(slot, writable=True)
            self._slots[slot] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return self._slots[slot][1]

    def _unmap_slots(self) -> None:
        for slot, mapped in enumerate(self._slots):
            if mapped is not None:
                mm, view = mapped
                if self._pinning is not None:
                    self._pinning.release(view)
                self._slots[slot] = None
                del view, mapped
                mm.close()

    # -- save -----------------------------------------------------------------
    def save(self, state: Any, version: int) -> SaveHandle:
        """Start snapshotting ``state`` as ``version``; returns without waiting for the copy.

        Until the returned handle's ``wait_reusable()`` returns, the tensors in
        ``state`` must not be modified (call it before the optimizer step). The
        previous save must be committed by every rank; this call waits for that,
        which in a training loop has happened during the forward/backward.
        Versions increase; saving a version <= one already held drops the held ones
        from there on (they belong to a timeline the job has abandoned).
        """
        self.wait()
        skeleton, tensors = split_state(state)
        plan = SnapshotPlan.for_tensors(tensors)
        self.reserve(plan.nbytes)
        self.store.drop_from(version)
        slot = self.store.free_slot()
        slot_bytes = self._slot_bytes(slot)
        if self._pinning is not None and any(t.is_cuda for t in tensors):
            self._pinning.ensure(slot_bytes)
        cuda_ready = capture_cuda_order(tensors)
        handle = SaveHandle(version)
        record = CommitRecord(version=version, rank=self.rank, slot=slot, plan=plan, skeleton=skeleton)
        self._copier.submit(self._copy_and_commit, handle, record, tensors, slot_bytes, cuda_ready)
        self._inflight = handle
        return handle

    def _copy_and_commit(self, handle: SaveHandle, record, tensors, slot_bytes, cuda_ready) -> None:
        version = record.version
        try:
            self.store.drop_slot(record.slot)  # the slot's old version becomes invisible first
            copy_into_slot(slot_bytes, tensors, record.plan, cuda_ready, self._side_streams,
                           halfway=lambda: testhooks.at("mid_copy", self.rank, version))
            self.store.write_commit(record)
            testhooks.at("after_commit", self.rank, version)
            handle._set_reusable()
            try:
                self._smp.request("committed", self.rank, version)
            except Exception as e:  # the SMP seals it on its next rescan (restart or sync)
                log.warning("ftmem: rank %d could not notify its SMP of version %d: %s", self.rank, version, e)
            if self._gloo is not None:
                # Job-wide commit, off the training thread. The next save waits for it
                # before overwriting the older slot: a rank one save ahead of a peer
                # that crashed mid-copy still holds the version that peer has.
                lowest = torch.tensor([version], dtype=torch.int64)
                dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self._gloo)
                if int(lowest) != version:
                    raise FtmemError(f"ranks saved different versions at once (this rank {version}, "
                                     f"another {int(lowest)}): every rank must save the same version.")
            handle._set_committed()
        except BaseException as e:
            handle._fail(e)

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

    # -- restore --------------------------------------------------------------
    def restore(self, version: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> Optional[Restored]:
        """Restore the newest version every rank holds intact (collective over all ranks).

        Each rank verifies its held versions against their checksums; a mismatch is
        logged and the version treated as lost on that rank, never returned. Returns
        None if no version is common to all ranks (e.g. a fresh job). Held versions
        newer than the restored one are dropped.
        """
        self.wait_sealed()  # whatever was committed but not sealed yet gets its checksum now
        intact = {}
        for v in self.versions():
            try:
                intact[v] = self.store.verify(v)
            except CorruptShard as e:
                log.warning("ftmem: %s Treating it as lost.", e)
                self.store.drop(v)
        everyone = gather_held(intact, self._gloo)
        chosen = choose_version(everyone, version)
        if chosen is None:
            log.info("ftmem: rank %d: no version held by every rank (held per rank: %s)", self.rank, everyone)
            return None
        record = intact[chosen]
        tensors = read_from_slot(self._slot_bytes(record.slot), record.plan, torch.device(device))
        self.store.drop_from(chosen + 1)
        return Restored(version=chosen, state=join_state(record.skeleton, tensors))

    # -- end --------------------------------------------------------------------
    def close(self, job_finished: bool = False) -> None:
        """Finish the save in flight and let go of the slots.

        With ``job_finished`` the rank tells its SMP the job ended cleanly; when all
        ranks of the node have, the SMP frees the node's shared memory and exits.
        Without it the snapshots stay for a restarted job (or ``ftmem clean``).
        """
        try:
            self.wait()
        finally:
            self._copier.shutdown(wait=True)
            self._unmap_slots()
            if job_finished:
                self._smp.finish(self.rank)
            self._smp.close()
