"""Slot mappings registered as pinned host memory, so that device-to-host copies into them
run as asynchronous DMA (CUDA only)."""
from __future__ import annotations

import torch


class CudaPinning:
    """Registers slot mappings as pinned host memory once, so D2H copies are async DMA."""

    def __init__(self) -> None:
        self._registered: set[int] = set()

    def ensure(self, slot_bytes: torch.Tensor) -> None:
        ptr = slot_bytes.data_ptr()
        if ptr in self._registered:
            return
        err = torch.cuda.cudart().cudaHostRegister(ptr, slot_bytes.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a {slot_bytes.numel()}-byte slot failed with error {int(err)}")
        self._registered.add(ptr)

    def release(self, slot_bytes: torch.Tensor) -> None:
        ptr = slot_bytes.data_ptr()
        if ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.discard(ptr)
