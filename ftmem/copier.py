"""Moving tensor bytes between the training process and a shared-memory slot.

Saving runs on the engine's background thread while the next forward/backward runs:
CPU tensors with ``copy_`` (which releases the GIL), CUDA tensors as asynchronous
device-to-host copies on a side stream into the slot, registered as pinned memory.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from .plan import ReplicaShard, SnapshotPlan, TensorEntry


def slot_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor-shaped window of a slot (or of the replicated stream) holding an entry."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)


def _shard_windows(entry: TensorEntry, shard: ReplicaShard) -> Optional[tuple[slice, slice]]:
    """For a replicated entry: (its bytes, the slot bytes) that fall in this replica's shard."""
    lo, hi = max(entry.offset, shard.start), min(entry.offset + entry.nbytes, shard.end)
    if lo >= hi:
        return None
    return (slice(lo - entry.offset, hi - entry.offset),
            slice(shard.offset + lo - shard.start, shard.offset + hi - shard.start))


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
    # Each device's side stream waits once for the training stream, and is the current
    # stream of its device for the whole loop: this thread holds the GIL while it runs
    # Python, so per-tensor work here delays the training thread's kernel launches.
    with torch.no_grad(), contextlib.ExitStack() as on_side_streams:
        for device, ready in cuda_ready.items():
            stream = side_streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_event(ready)
            on_side_streams.enter_context(torch.cuda.stream(stream))
        for i, (t, entry) in enumerate(zip(tensors, plan.entries)):
            if i == half:
                halfway()
            if entry.nbytes == 0:
                continue
            if entry.replicated:  # only this replica's slice of it, as raw bytes
                windows = _shard_windows(entry, plan.shard)
                if windows is None:
                    continue
                slot_bytes[windows[1]].copy_(t.reshape(-1).view(torch.uint8)[windows[0]], non_blocking=t.is_cuda)
            else:
                slot_view(slot_bytes, entry).copy_(t, non_blocking=t.is_cuda)
    done_events = []
    for device in cuda_ready:
        ev = torch.cuda.Event()
        ev.record(side_streams[device])
        done_events.append(ev)
    for ev in done_events:
        ev.synchronize()


def shard_bytes(slot_bytes: torch.Tensor, plan: SnapshotPlan) -> torch.Tensor:
    """This replica's slice of the replicated stream, as stored in the slot."""
    return slot_bytes[plan.shard.offset : plan.shard.offset + plan.shard.nbytes]


def read_from_slot(slot_bytes: torch.Tensor, plan: SnapshotPlan, device: torch.device,
                   replicated_stream: Optional[Callable[[], torch.Tensor]] = None,
                   into: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]:
    """Tensors rebuilt on ``device``, never views of shared memory. Unique entries are
    copied out of the slot first, each into its tensor in ``into`` where it has one (see
    :mod:`ftmem.destinations`), else into a fresh one; then ``replicated_stream()`` gives
    the whole replicated stream (gathered from the replicas: private memory already, so
    replicated entries are views of it on the CPU, where the gather has not written them
    into their tensors in ``into`` already). Asking for it last lets a gather run beside
    the copies."""
    into = into or [None] * len(plan.entries)
    out: list = list(into)
    with torch.no_grad():  # a framework tensor may require grad: writing it is no step of any graph
        for i, entry in enumerate(plan.entries):
            if entry.replicated:
                continue
            if out[i] is None:
                out[i] = _copied(entry, slot_bytes, device)
            elif entry.nbytes:
                out[i].copy_(slot_view(slot_bytes, entry))
    if any(entry.replicated for entry in plan.entries):
        stream = replicated_stream()
        for i, entry in enumerate(plan.entries):
            if entry.replicated and out[i] is None:
                out[i] = slot_view(stream, entry) if device.type == "cpu" else _copied(entry, stream, device)
    for i, (t, entry) in enumerate(zip(out, plan.entries)):
        if into[i] is not None:
            continue  # the framework's own tensor, as it was (destinations checked its kind)
        if entry.is_parameter:
            out[i] = torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        elif entry.requires_grad:
            t.requires_grad_(True)
    return out


def _copied(entry: TensorEntry, source: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty(entry.shape, dtype=entry.dtype, device=device)
    if entry.nbytes:
        t.copy_(slot_view(source, entry))
    return t
