"""Planning: where each tensor's bytes go in a rank's shared-memory slot.

Unique tensors (bytes only this rank has) are stored whole. Tensors replicated
across the rank's data-parallel group are, with DP sharding (REFT), stored once per
group: their bytes form one *replicated stream* (same order and layout on every
replica), and replica d of D keeps only the d-th of D slices of that stream. A plan
depends only on the tensors' dtypes and shapes, so the buffers it sizes are reused
by every later save of the same state (no per-save allocation).
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Cache-line alignment keeps every tensor's bytes on their own lines, and keeps
# every offset a multiple of any element size so bytes can be viewed as the dtype.
ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a snapshot: where its bytes are and how to rebuild it.

    ``offset`` is into the slot for a unique tensor, into the replicated stream for
    a replicated one.
    """

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_parameter: bool
    requires_grad: bool
    replicated: bool = False


@dataclass(frozen=True)
class ReplicaShard:
    """This replica's slice [start, end) of the replicated stream, kept at ``offset`` in the slot."""

    offset: int
    start: int
    end: int
    stream_nbytes: int
    index: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SnapshotPlan:
    entries: tuple[TensorEntry, ...]
    nbytes: int  # bytes of the slot in use, padding included
    shard: Optional[ReplicaShard] = None

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor], replicated: Optional[Sequence[bool]] = None,
                    replica: tuple[int, int] = (0, 1)) -> "SnapshotPlan":
        """Plan ``tensors``; those flagged in ``replicated`` are DP-sharded as replica
        ``replica = (index, count)`` of their group."""
        replicated = replicated or [False] * len(tensors)
        entries, slot_offset, stream_offset = [], 0, 0
        for t, rep in zip(tensors, replicated):
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(offset=stream_offset if rep else slot_offset, nbytes=nbytes, dtype=t.dtype,
                                       shape=tuple(t.shape), is_parameter=isinstance(t, torch.nn.Parameter),
                                       requires_grad=t.requires_grad, replicated=rep))
            if rep:
                stream_offset += _aligned(nbytes)
            else:
                slot_offset += _aligned(nbytes)
        if not any(replicated):
            return cls(entries=tuple(entries), nbytes=slot_offset)
        index, count = replica
        shard = ReplicaShard(offset=slot_offset, start=stream_offset * index // count,
                             end=stream_offset * (index + 1) // count, stream_nbytes=stream_offset,
                             index=index, count=count)
        return cls(entries=tuple(entries), nbytes=slot_offset + _aligned(shard.nbytes), shard=shard)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _same_shapes_and_dtypes(last: tuple, now: tuple) -> bool:
    """Whether two saves' tensors (their elements, :func:`ftmem._state.serialize.elements`) have
    the same shape and dtype, position by position. Most are the same tensors, whose elements
    are equal; the few that are new at every save (the RNG's states) are
    compared by shape and dtype alone. One pass in C over all of them: comparing shapes and
    dtypes of all (two more passes) took a save call of 3,860 tensors a millisecond."""
    if len(last) != len(now):
        return False
    differ = itertools.compress(range(len(now)), map(operator.ne, last, now))
    return all(last[i][1] == now[i][1] and last[i][3] == now[i][3] for i in differ)


@dataclass
class _Planned:
    depends_on: tuple  # the replica, the replicated flags, and each tensor's type and requires_grad
    elements: tuple  # of the tensors planned (serialize.SplitState.elements)
    plan: SnapshotPlan


class Planner:
    """Plans one rank's saves, and reuses the last plan while every tensor keeps its dtype,
    shape and kind (as from one save of a training loop to the next): a plan depends on
    nothing else, and planning every tensor anew is a cost of every save call. The check
    runs at C speed (tuples compared, attributes mapped): a Python step per tensor costs
    a save call of thousands of tensors milliseconds."""

    def __init__(self):
        self._last: Optional[_Planned] = None

    def plan(self, tensors: Sequence[torch.Tensor], elements: tuple, replicated: Optional[Sequence[bool]],
             replica: tuple[int, int]) -> SnapshotPlan:
        """The plan of ``tensors``, whose ``elements`` (per tensor: its address, shape,
        strides, dtype, device) :func:`ftmem._state.serialize.split_state` gave with them."""
        depends_on = (replica, None if replicated is None else tuple(replicated),
                      tuple(map(type, tensors)), tuple(map(_REQUIRES_GRAD, tensors)))
        last = self._last
        if last is not None and last.depends_on == depends_on and _same_shapes_and_dtypes(last.elements, elements):
            last.elements = elements
            return last.plan
        self._last = _Planned(depends_on, elements, SnapshotPlan.for_tensors(tensors, replicated, replica))
        return self._last.plan


def slot_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor-shaped window of a slot (or of the replicated stream) holding an entry."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)
