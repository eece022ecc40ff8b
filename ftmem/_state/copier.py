"""Copying a save's tensors into a shared-memory slot.

Saving runs on the engine's background thread while the next forward/backward runs:
CPU tensors with ``copy_`` (which releases the GIL), CUDA tensors as asynchronous
device-to-host copies on a side stream into the slot, registered as pinned memory
(:mod:`ftmem._state.pinning`). What the next forward writes is taken first, on the caller's
thread (:func:`taken_now`). Reading a slot back is :mod:`ftmem._state.reader`'s.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable, Optional, Sequence

import torch

from ftmem.config import seconds_from_env
from ftmem._state.plan import ReplicaShard, SnapshotPlan, TensorEntry, slot_view


def _shard_windows(entry: TensorEntry, shard: ReplicaShard) -> Optional[tuple[slice, slice]]:
    """For a replicated entry: (its bytes, the slot bytes) that fall in this replica's shard."""
    lo, hi = max(entry.offset, shard.start), min(entry.offset + entry.nbytes, shard.end)
    if lo >= hi:
        return None
    return (slice(lo - entry.offset, hi - entry.offset),
            slice(shard.offset + lo - shard.start, shard.offset + hi - shard.start))


COPY_TIMEOUT_ENV = "FTMEM_COPY_TIMEOUT_S"
COPY_TIMEOUT_S = 120.0  # the least a copy may take before a wait for it gives up, whatever its size
# Bytes a second below which a copy into shared memory counts as stuck: far below any memory's
# or PCIe link's speed, on a loaded machine too.
COPY_FLOOR_BYTES_PER_S = 50e6


def copy_bound_s(nbytes: int) -> float:
    """How long a copy of ``nbytes`` into shared memory may take before a wait for it gives
    up, naming it: a local copy, which no peer holds up, but a stuck device (a GPU off the
    bus) or a full machine may."""
    return seconds_from_env(COPY_TIMEOUT_ENV, COPY_TIMEOUT_S, minimum=1,
                            what="the least a copy into shared memory may take before a wait for it gives up"
                            ) + nbytes / COPY_FLOOR_BYTES_PER_S


def taken_now(tensors: Sequence[torch.Tensor], written_in_forward: Optional[Callable[[torch.Tensor], bool]]) -> list:
    """``tensors`` for the copy thread, those that ``written_in_forward`` names replaced by
    copies taken now, on the caller's thread (and, on CUDA, its stream, which the next forward
    runs on after them): the copy thread reads the others while the next forward runs, and a
    tensor that forward writes in place (a BatchNorm's running statistics) would reach the
    version with the next step's values beside this step's parameters."""
    if written_in_forward is None:
        return list(tensors)
    with torch.no_grad():
        return [t.detach().clone() if written_in_forward(t) else t for t in tensors]


def capture_cuda_order(tensors: Sequence[torch.Tensor]) -> dict:
    """On the caller's thread: an event per device of ``tensors`` on CUDA, marking where the producing work ends."""
    if not torch.cuda.is_initialized():  # no tensor is on CUDA (and the save call skips a look at each)
        return {}
    events = {}
    for device in set(map(_DEVICE, tensors)):
        if device.type == "cuda":
            events[device] = ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
    return events


_DEVICE = operator.attrgetter("device")


# (a tensor's index, its window in the slot, the slice of its bytes that goes there if only
# this replica's share of a replicated tensor does)
Window = tuple[int, torch.Tensor, Optional[slice]]


class SlotWindows:
    """Where each tensor of a plan goes in a slot: made once per slot mapping and plan, and
    reused by every later save into that slot while the plan stays (:class:`ftmem._state.plan.Planner`
    keeps it). Making a view per tensor at every save costs the copy thread time with the
    GIL held, which the training thread's kernel launches wait for (docs/benchmarks.md)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple] = {}  # slot -> (its mapping, the plan, the windows)

    def of(self, slot: int, slot_bytes: torch.Tensor, plan: SnapshotPlan) -> list[Window]:
        """A Window for each tensor with bytes to copy, in plan order."""
        made = self._made.get(slot)
        if made is None or made[0] is not slot_bytes or made[1] is not plan:
            made = self._made[slot] = (slot_bytes, plan, _windows(slot_bytes, plan))
        return made[2]

    def clear(self) -> None:
        """Let go of every mapping (before they are unmapped)."""
        self._made.clear()


def _windows(slot_bytes: torch.Tensor, plan: SnapshotPlan) -> list[Window]:
    windows = []
    for i, entry in enumerate(plan.entries):
        if entry.nbytes == 0:
            continue
        if not entry.replicated:
            windows.append((i, slot_view(slot_bytes, entry), None))
        elif (shard := _shard_windows(entry, plan.shard)) is not None:  # this replica's slice of it, as raw bytes
            windows.append((i, slot_bytes[shard[1]], shard[0]))
    return windows


def copy_into_slot(
    windows: Sequence[Window],
    tensors: Sequence[torch.Tensor],
    cuda_ready: dict,
    side_streams: dict,
    halfway: Callable[[], None],
) -> None:
    """Copy every tensor into its window of the slot (from :class:`SlotWindows`); returns when
    all bytes are there."""
    destinations = [window for _, window, _ in windows]
    half = len(windows) // 2
    # Each device's side stream waits once for the training stream, and is the current
    # stream of its device for the whole copy; the copies are two foreach calls (one each
    # side of the halfway hook): this thread holds the GIL while it runs Python, so
    # per-tensor work here delays the training thread's kernel launches.
    with torch.no_grad(), contextlib.ExitStack() as on_side_streams:
        for device, ready in cuda_ready.items():
            stream = side_streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_event(ready)
            on_side_streams.enter_context(torch.cuda.stream(stream))
        # On the side streams, after their wait: a non-contiguous tensor's reshape is a copy.
        sources = [tensors[i] if part is None else tensors[i].reshape(-1).view(torch.uint8)[part]
                   for i, _, part in windows]
        _copy(destinations[:half], sources[:half])
        halfway()
        _copy(destinations[half:], sources[half:])
    done_events = []
    for device in cuda_ready:
        ev = torch.cuda.Event()
        ev.record(side_streams[device])
        done_events.append(ev)
    for ev in done_events:
        ev.synchronize()


def _copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if destinations:  # foreach refuses an empty list
        torch._foreach_copy_(destinations, sources, non_blocking=True)
