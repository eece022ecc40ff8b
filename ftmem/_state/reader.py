"""Reading a version's tensors back out of a shared-memory slot: into the framework's own
tensors where it names them, else fresh ones, never views of shared memory; a DP-sharded
version's replicated stream joined back from every replica's slice."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ftmem._state.plan import SnapshotPlan, TensorEntry, slot_view


def shard_bytes(slot_bytes: torch.Tensor, plan: SnapshotPlan) -> torch.Tensor:
    """This replica's slice of the replicated stream, as stored in the slot."""
    return slot_bytes[plan.shard.offset : plan.shard.offset + plan.shard.nbytes]


def joined_stream(replicas: Sequence[tuple[torch.Tensor, SnapshotPlan]]) -> torch.Tensor:
    """The whole replicated stream, in private memory, from every replica's (slot bytes,
    plan), in replica order: for a reader that holds every replica's slot."""
    return torch.cat([shard_bytes(slot_bytes, plan) for slot_bytes, plan in replicas])


def read_from_slot(slot_bytes: torch.Tensor, plan: SnapshotPlan, device: torch.device,
                   replicated_stream: Optional[Callable[[], torch.Tensor]] = None,
                   into: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]:
    """Tensors rebuilt on ``device``, never views of shared memory. Unique entries are
    copied out of the slot first, each into its tensor in ``into`` where it has one (see
    :mod:`ftmem._state.destinations`), else into a fresh one; then ``replicated_stream()`` gives
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
