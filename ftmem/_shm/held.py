"""A job's versions as this host's node directories hold them, read without the job's
processes and without a collective: by ``ftmem export``, and by a read of checkpoint files
on some ranks only (DeepSpeed's universal-checkpoint conversion on rank 0, say).

Every rank's node directory must be visible here (one host's virtual nodes, or node
directories gathered in one place); a lost node's ranks are rebuilt from parity by a
restarted job, not here. A version is read only once every rank has committed it, and what
was read is checked against the commit markers afterwards: a slot that the job overwrote
meanwhile is reported, never returned.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch

from ftmem._shm import integrity, jobs
from ftmem._shm.slots import CommitRecord, RankStore
from ftmem._state.reader import joined_stream, read_from_slot
from ftmem._state.serialize import join_state
from ftmem.errors import FtmemError


class NotAllHere(FtmemError):
    """Some rank of the job has no node directory on this host."""


class HeldJob:
    """A job's ranks as this host's node directories hold them."""

    def __init__(self, shm_dir: str, job: str):
        nodes = jobs.node_dirs(shm_dir, job)
        if not nodes:
            present = ", ".join(jobs.list_jobs(shm_dir)) or "none"
            raise FtmemError(f"no job {job!r} in {shm_dir} (jobs there: {present}). Name the job with --job, and "
                             f"the shared-memory directory it runs in with --shm-dir.")
        self.job = job
        self.stores = {rank: RankStore(path, rank) for _, path in nodes for rank in jobs.node_ranks(path)}
        if not self.stores:
            raise FtmemError(f"job {job}'s node directories in {shm_dir} name no ranks: no training process of it "
                             f"has started there. Nothing to read.")

    def choose(self, version: Optional[int]) -> tuple[int, CommitRecord]:
        """``version`` (else the newest every rank holds) and the lowest rank's record of it;
        NotAllHere where some rank of the job has no node directory here."""
        held = {rank: set(store.committed()) for rank, store in self.stores.items()}
        common = set.intersection(*held.values())
        if version is None and not common:
            raise FtmemError(f"job {self.job}: no version is held by every rank "
                             f"({self._describe(held)}); nothing complete to read.")
        version = max(common) if version is None else version
        if version not in common:
            raise FtmemError(f"job {self.job} does not hold version {version} on every rank ({self._describe(held)}); "
                             f"versions held by all: {sorted(common) or 'none'}.")
        record = self.stores[min(self.stores)].read_commit(version)
        world = sorted(rank for group in record.layout.dp_groups for rank in group)
        missing = sorted(set(world) - set(self.stores))
        if missing:
            raise NotAllHere(f"job {self.job}: ranks {missing} have no node directory here (their node's memory is "
                             f"gone or on another host). Reading a version without the job's processes reads every "
                             f"rank from this host's shared memory; restart the job to rebuild lost nodes from "
                             f"parity, or use its newest disk checkpoint.")
        return version, record

    def verified(self, version: int) -> dict[int, CommitRecord]:
        """Every rank's record of ``version``, its bytes checked against the checksum its
        writer took (CorruptShard where they do not match)."""
        return {rank: integrity.verify(store, version) for rank, store in self.stores.items()}

    def read_state(self, records: dict[int, CommitRecord], rank: int) -> Any:
        """Rank ``rank``'s whole state of the version ``records`` (from :meth:`verified`) are of,
        the DP-sharded replicated state joined back from its replicas' slices."""
        record = records[rank]
        version = record.version
        group = record.layout.dp_group_of(rank) if record.plan.shard is not None else (rank,)
        with contextlib.ExitStack() as mapped:
            slots = {}
            for r in group:
                mm = mapped.enter_context(self.stores[r].map_slot(records[r].slot, writable=True))  # only read;
                slots[r] = torch.frombuffer(mm, dtype=torch.uint8)  # writable spares a copy
            replicas = [(slots[r], records[r].plan) for r in group]
            tensors = read_from_slot(slots[rank], record.plan, torch.device("cpu"),
                                     functools.partial(joined_stream, replicas))
            del slots, replicas  # the maps close with no view left
        # A slot's commit marker goes before it is overwritten: if every marker is still
        # there, what was read is the version.
        overwritten = [r for r in group if self.stores[r].committed().get(version) != records[r].slot]
        if overwritten:
            raise FtmemError(f"job {self.job} overwrote version {version} of ranks {overwritten} while it was being "
                             f"read (the job keeps saving). Read a newer version, or stop the job first.")
        return join_state(record.skeleton, tensors)

    @staticmethod
    def _describe(held: dict[int, set]) -> str:
        return "; ".join(f"rank {r}: {sorted(v) or 'none'}" for r, v in sorted(held.items()))
