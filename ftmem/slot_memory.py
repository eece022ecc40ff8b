"""A rank's mapped slots: each slot file is mapped once and reused by every later save,
registered as pinned memory for device-to-host copies where CUDA is present, and grown
through the node's SMP (which owns allocation) when the state outgrows it."""
from __future__ import annotations

import mmap
from typing import Optional

import torch

from .copier import CudaPinning
from .slots import DATA, PARITY, RankStore
from .smp_client import SmpClient


class SlotMemory:
    def __init__(self, store: RankStore, smp: SmpClient):
        self.store, self._smp = store, smp
        self._maps: dict[tuple[str, int], tuple[mmap.mmap, torch.Tensor]] = {}
        self._pinning: Optional[CudaPinning] = CudaPinning() if torch.cuda.is_available() else None

    def reserve(self, nbytes: int, parity_nbytes: int) -> None:
        """Have the SMP grow the slots to hold ``nbytes`` of data and ``parity_nbytes`` of
        parity (it checks the shared-memory budget first)."""
        store = self.store
        grow = [kind for kind, want in ((DATA, nbytes), (PARITY, parity_nbytes)) if store.capacity(kind) < want]
        if grow:
            self.unmap(grow)  # a grown file needs a new mapping
            self._smp.request("alloc", store.rank, max(nbytes, store.capacity(DATA)),
                              max(parity_nbytes, store.capacity(PARITY)))

    def bytes_of(self, slot: int, kind: str = DATA) -> torch.Tensor:
        """The slot file as a writable uint8 tensor over shared memory."""
        if (kind, slot) not in self._maps:
            mm = self.store.map_slot(slot, writable=True, kind=kind)
            self._maps[(kind, slot)] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return self._maps[(kind, slot)][1]

    def pin(self, slot_bytes: torch.Tensor) -> None:
        """Register a mapped slot as pinned host memory (once), so CUDA copies into it are DMA."""
        if self._pinning is not None:
            self._pinning.ensure(slot_bytes)

    def unmap(self, kinds=(DATA, PARITY)) -> None:
        for key in [key for key in self._maps if key[0] in kinds]:
            mm, view = self._maps.pop(key)
            if self._pinning is not None:
                self._pinning.release(view)
            del view
            mm.close()
