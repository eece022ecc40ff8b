"""A rank's mapped slots: each slot file is mapped once and reused by every later save,
registered as pinned memory for device-to-host copies where CUDA is present, and grown
through the node's SMP (which owns allocation) when the state outgrows it.

A mapping is never unmapped while another thread may still use it. ``torch.frombuffer``
keeps the mmap object alive but takes no buffer export from it, so ``mmap.close()`` would
succeed under a live tensor view and leave the copy thread writing or reading unmapped
memory (SIGSEGV). A replaced mapping is therefore only forgotten, and goes with its last
view; :meth:`SlotMemory.unmap` closes them at the end, once no other thread runs.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Optional, Union

import torch

from ftmem.config import budget_bytes
from ftmem._common.logs import rank_warning
from ftmem._common.units import fmt_bytes
from ftmem._state.pinning import CudaPinning
from ftmem.errors import SharedMemoryRemoved
from ftmem._shm.slots import DATA, PARITY, RankStore
from ftmem._shm.smp_client import SmpClient


class SlotMemory:
    def __init__(self, store: RankStore, smp: SmpClient, budget: Union[str, int, None] = None):
        self.store, self._smp = store, smp
        self._budget = budget  # what the job's slots may take of the node's shared memory ("shm_budget")
        self._maps: dict[tuple[str, int], tuple[mmap.mmap, torch.Tensor]] = {}
        # The training thread, the copy thread and the protection thread all map and grow
        # slots; the SMP's connection takes one request at a time.
        self._lock = threading.RLock()
        self._pinning: Optional[CudaPinning] = CudaPinning() if torch.cuda.is_available() else None

    def reserve(self, nbytes: int, parity_nbytes: int) -> None:
        """Have the SMP grow the slots to hold ``nbytes`` of data and ``parity_nbytes`` of
        parity (it checks the shared-memory budget first). At the first allocation the SMP may
        keep two data slots where the budget does not hold three (said once)."""
        with self._lock:
            # A removed node directory has no slot files: never take that for slots to grow.
            self._smp.check_node_dir()
            store = self.store
            grow = [kind for kind, want in ((DATA, nbytes), (PARITY, parity_nbytes)) if store.capacity(kind) < want]
            if not grow:
                return
            self._forget(grow)  # a grown file needs a new mapping
            budget = 0
            if self._budget is not None:
                st = os.statvfs(store.node_dir)
                budget = budget_bytes(self._budget, st.f_blocks * st.f_frsize)
            _, slots = self._smp.request("alloc", store.rank, max(nbytes, store.capacity(DATA)),
                                         max(parity_nbytes, store.capacity(PARITY)), store.data_slots, budget)
            if slots != store.data_slots:
                rank_warning(store.rank, "keeps %d versions in memory, not %d: %d of them do not fit the node's "
                             "\"shm_budget\" %s (%s); a save that comes while an older one is protected is skipped",
                             slots, store.data_slots, store.data_slots, self._budget, fmt_bytes(budget))
                store.data_slots = slots

    def removed_error(self) -> Optional[SharedMemoryRemoved]:
        """The error to stop with if the node directory went away under the job, else None."""
        return self._smp.removed_error()

    def bytes_of(self, slot: int, kind: str = DATA) -> torch.Tensor:
        """The slot file as a writable uint8 tensor over shared memory."""
        with self._lock:
            if (kind, slot) not in self._maps:
                self._smp.check_node_dir()
                mm = self.store.map_slot(slot, writable=True, kind=kind)
                self._maps[(kind, slot)] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
            return self._maps[(kind, slot)][1]

    def pin(self, slot_bytes: torch.Tensor) -> None:
        """Register a mapped slot as pinned host memory (once), so CUDA copies into it are DMA."""
        if self._pinning is not None:
            self._pinning.ensure(slot_bytes)

    def _forget(self, kinds) -> None:
        """Drop the mappings of ``kinds`` from the cache, unmapped once their last user lets go."""
        for key in [key for key in self._maps if key[0] in kinds]:
            _, view = self._maps.pop(key)
            if self._pinning is not None:
                self._pinning.release(view)  # no device copy is in flight: slots grow before or after one

    def unmap(self) -> None:
        """Unmap every slot now. Only once no other thread uses them (the engine's close)."""
        maps = list(self._maps.values())
        self._forget((DATA, PARITY))
        for mm, _ in maps:
            mm.close()
