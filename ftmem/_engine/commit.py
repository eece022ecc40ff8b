"""The commit protocol of one rank, run on its background thread while training goes on.

For each save, in order (see docs/design/protocols.md):

1. what the slot held becomes invisible (its marker goes first), then the bytes are
   copied in; the handle becomes *reusable*;
2. the bytes are checksummed and the commit marker, which holds the checksum, is
   written (atomic rename): the rank's part of v exists, and can be verified;
3. with erasure coding, the column exchanges pieces and each member stores its parity
   (:class:`ftmem._ec.protect.ColumnCoder`);
4. the job agrees that every rank committed (and protected) v; the handle becomes
   *committed*, and the next save may overwrite the older slot;
5. if the persistent tier is due, the flusher gets a private copy of v.

A crash at any step leaves the other slot's version intact.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ftmem._common import testhooks
from ftmem._state.checksum import data_checksum
from ftmem._state.copier import SlotWindows, copy_into_slot
from ftmem.errors import FtmemError
from ftmem._engine.handle import SaveHandle
from ftmem._common.logs import job_info
from ftmem._disk.persist import Flusher
from ftmem._ec.protect import ColumnCoder
from ftmem._shm.slot_memory import SlotMemory
from ftmem._shm.slots import PARITY, CommitRecord, RankStore

# Reads a whole version into private CPU memory (collective over the DP group).
ReadVersion = Callable[[CommitRecord, torch.Tensor], Any]


class Committer:
    def __init__(self, store: RankStore, memory: SlotMemory, column: Optional[ColumnCoder],
                 gloo: Optional[dist.ProcessGroup], read_version: ReadVersion):
        self.store, self.memory = store, memory
        self._column, self._gloo, self._read_version = column, gloo, read_version
        self.flusher: Optional[Flusher] = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftmem-copy")
        self._last: Optional[Future] = None  # the last save's task (it never raises: errors go to its handle)
        self._side_streams: dict = {}  # CUDA device -> the stream device-to-host copies run on
        self._windows = SlotWindows()

    @property
    def rank(self) -> int:
        return self.store.rank

    def start(self, handle: SaveHandle, record: CommitRecord, tensors: list, slot_bytes: torch.Tensor,
              cuda_ready: dict, persist: bool) -> None:
        self._last = self._thread.submit(self._run, handle, record, tensors, slot_bytes, cuda_ready, persist)

    def drain(self) -> None:
        """Until the last save's task has run to its end (flush hand-over included)."""
        if self._last is not None:
            self._last.result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        self._windows.clear()

    def forget_groups(self) -> None:
        """The engine closed and destroyed its groups: hold none of them, the tier's included."""
        self._gloo = None
        if self.flusher is not None:
            self.flusher.close()

    def _run(self, handle: SaveHandle, record: CommitRecord, tensors: list, slot_bytes: torch.Tensor,
             cuda_ready: dict, persist: bool) -> None:
        version = record.version
        try:
            self.store.drop_slot(record.slot)  # what the slot held becomes invisible first
            windows = self._windows.of(record.slot, slot_bytes, record.plan)
            copy_into_slot(windows, tensors, cuda_ready, self._side_streams,
                           halfway=lambda: testhooks.at("mid_copy", self.rank, version))
            # Reusable before the checksum: the source tensors are not read again, so the
            # optimizer step waits for the copy only, never for the checksum.
            handle._set_reusable()
            # Taken from the slot before the marker exists: a version is never committed
            # without the checksum of exactly what was written (ftmem._shm.integrity).
            record = dataclasses.replace(record, checksum=data_checksum(slot_bytes.numpy()[: record.plan.nbytes]))
            self.store.write_commit(record)
            testhooks.at("after_commit", self.rank, version)
            if self._column is not None:
                self._protect(record, slot_bytes)
            if self._gloo is not None:
                self._confirm_same_version_everywhere(version)
            handle._set_committed()
            if self.flusher is not None and self.flusher.due(asked=persist):
                self._hand_over_for_flush(record, slot_bytes)
        except BaseException as e:
            # Files gone under the copy mean `ftmem clean`: say so, not a bare OSError.
            handle._fail(self.memory.removed_error() or e)

    def _protect(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        lengths, records, piece = self._column.exchange_info(record)
        self.memory.reserve(record.plan.nbytes, self._column.parity_nbytes(piece))
        parity = self.memory.bytes_of(record.slot, PARITY).numpy()
        self.store.write_parity(self._column.protect(record, slot_bytes.numpy(), parity, lengths, records, piece))

    def _confirm_same_version_everywhere(self, version: int) -> None:
        """Job-wide: every rank committed (and protected) v. The next save waits for this
        before overwriting the older slot, so a rank one save ahead of a peer that crashed
        mid-copy still holds the version the peer has."""
        lowest = torch.tensor([version], dtype=torch.int64)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self._gloo)
        if int(lowest) != version:
            raise FtmemError(f"ranks saved different versions at once (this rank {version}, another {int(lowest)}): "
                             f"every rank must save the same version.")
        if self._column is not None:
            self.store.write_protected(version)

    def flush_now(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        """Write ``record``'s version to the persistent tier and wait for it (collective;
        the save thread is idle). Raises if it could not be written."""
        self.flusher.start(record.version, self._read_version(record, slot_bytes))
        self.flusher.wait()
        self.flusher.raise_failure()

    def _hand_over_for_flush(self, record: CommitRecord, slot_bytes: torch.Tensor) -> None:
        """A whole private copy of the version for the flusher, unless a flush is still
        running on any rank (then this version is skipped: flushes never queue)."""
        busy = torch.tensor([int(self.flusher.busy())], dtype=torch.int64)
        if self._gloo is not None:
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self._gloo)
        if busy.item():
            job_info("version %d not flushed: the previous flush is still running (the disk is slower than "
                     "persist.interval saves)", record.version)
            return
        self.flusher.start(record.version, self._read_version(record, slot_bytes))
