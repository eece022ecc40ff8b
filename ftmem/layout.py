"""Planning: where each tensor's bytes go in a rank's shared-memory slot.

A plan depends only on the tensors' dtypes and shapes, so the buffers it sizes are
reused by every later save of the same state (no per-save allocation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# Cache-line alignment keeps every tensor's bytes on their own lines and lets the
# restored views be handed to vectorised copies without a misaligned head.
ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a snapshot: where its bytes are and how to rebuild it."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_parameter: bool
    requires_grad: bool


@dataclass(frozen=True)
class SnapshotPlan:
    entries: tuple[TensorEntry, ...]
    nbytes: int  # bytes of the slot in use, padding included

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor]) -> "SnapshotPlan":
        entries, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(
                TensorEntry(
                    offset=offset,
                    nbytes=nbytes,
                    dtype=t.dtype,
                    shape=tuple(t.shape),
                    is_parameter=isinstance(t, torch.nn.Parameter),
                    requires_grad=t.requires_grad,
                )
            )
            offset += _aligned(nbytes)
        return cls(entries=tuple(entries), nbytes=offset)
