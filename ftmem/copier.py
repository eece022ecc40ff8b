"""Moving tensor bytes between the training process and a shared-memory slot.

Saving runs on the engine's background thread while the next forward/backward runs:
CPU tensors with ``copy_`` (which releases the GIL), CUDA tensors as asynchronous
device-to-host copies on a side stream into the slot, registered as pinned memory.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .layout import SnapshotPlan, TensorEntry


def slot_view(slot_bytes: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor-shaped window of a slot that holds one entry's bytes."""
    raw = slot_bytes[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)


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


def capture_cuda_order(tensors: Sequence[torch.Tensor]) -> dict:
    """On the caller's thread: an event per device marking where the producing work ends."""
    events = {}
    for t in tensors:
        if t.is_cuda and t.device not in events:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            events[t.device] = ev
    return events


def copy_into_slot(
    slot_bytes: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    plan: SnapshotPlan,
    cuda_ready: dict,
    side_streams: dict,
    halfway: Callable[[], None],
) -> None:
    """Copy every tensor into its window of the slot; returns when all bytes are there."""
    half = len(tensors) // 2
    done_events = []
    for i, (t, entry) in enumerate(zip(tensors, plan.entries)):
        if i == half:
            halfway()
        if entry.nbytes == 0:
            continue
        dst = slot_view(slot_bytes, entry)
        src = t.detach()
        if src.is_cuda:
            stream = side_streams.setdefault(src.device, torch.cuda.Stream(src.device))
            stream.wait_event(cuda_ready[src.device])
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
    for device, stream in side_streams.items():
        ev = torch.cuda.Event()
        ev.record(stream)
        done_events.append(ev)
    for ev in done_events:
        ev.synchronize()


def read_from_slot(slot_bytes: torch.Tensor, plan: SnapshotPlan, device: torch.device) -> list[torch.Tensor]:
    """Fresh tensors (not views of shared memory) rebuilt from a slot on ``device``."""
    out = []
    for entry in plan.entries:
        t = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        if entry.nbytes:
            t.copy_(slot_view(slot_bytes, entry))
        if entry.is_parameter:
            t = torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        elif entry.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out
