"""Restoring straight into the framework's own tensors.

A restarted framework has already allocated its parameters (and some of its optimizer
state) before it loads. A restore into fresh tensors touches every page of them for the
first time, which on this machine runs at a fraction of the rate into memory already
touched (docs/benchmarks.md), and the framework then copies them into its
own tensors anyway. An adapter may instead name, for the version about to be restored,
the framework tensors that will end up holding each saved tensor: the restore copies
(and DP-gathers) into them and hands them back in the restored state, so the framework's
load finds its tensors already holding the values.

A named tensor is used only where that cannot change what the framework ends up with: a
CPU tensor of the saved tensor's dtype, shape and kind (parameter or not, requiring grad
or not), contiguous, overlapping no other one used. Everything else is restored into
fresh memory as before. The adapter names only tensors that its framework's load then
overwrites from the saved state: a named tensor is overwritten even where the framework
would have ignored the saved value.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ftmem._state.plan import TensorEntry
from ftmem._state.serialize import join_state

# Given the version's saved shape (its state, with a TensorPlace where each saved tensor
# goes: :func:`saved_shape`), the application's answer: the same structure (dicts by key,
# lists and tuples by position), as far as it names its tensors, holding them where the
# saved tensors go. ``SnapshotEngine.restore(into=...)`` takes one; an adapter builds the
# answer itself between the restore's phases (ftmem.adapter.AdapterRuntime.restore).
RestoreTargets = Callable[[Any], Any]


class TensorPlace:
    """Stands for saved tensor ``index`` in the state shown to a :data:`RestoreTargets`."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def saved_shape(skeleton: bytes, count: int) -> Any:
    """A version's state with a TensorPlace in place of each of its ``count`` tensors."""
    return join_state(skeleton, [TensorPlace(i) for i in range(count)])


def destinations(saved: Any, entries: Sequence[TensorEntry], named: Any) -> list[Optional[torch.Tensor]]:
    """For each saved tensor, the framework tensor to restore it into, or None (fresh memory).
    ``named`` is the answer to ``saved`` (:data:`RestoreTargets`); None names nothing."""
    found: list[Optional[torch.Tensor]] = [None] * len(entries)
    if named is None:
        return found
    taken: list[tuple[int, int]] = []  # byte ranges already written into
    for place, tensor in _pairs(saved, named):
        entry = entries[place.index]
        if found[place.index] is not None or not _fits(tensor, entry):
            continue
        span = (tensor.data_ptr(), tensor.data_ptr() + entry.nbytes)
        if entry.nbytes and any(lo < span[1] and span[0] < hi for lo, hi in taken):
            continue
        taken.append(span)
        found[place.index] = tensor
    return found


def _pairs(saved: Any, named: Any) -> Iterator[tuple[TensorPlace, torch.Tensor]]:
    """(place, named tensor) wherever the two structures agree down to a tensor."""
    if isinstance(saved, TensorPlace):
        if isinstance(named, torch.Tensor):
            yield saved, named
    elif isinstance(saved, dict) and isinstance(named, dict):
        for key, value in saved.items():
            if key in named:
                yield from _pairs(value, named[key])
    elif isinstance(saved, (list, tuple)) and isinstance(named, (list, tuple)) and len(saved) == len(named):
        for value, target in zip(saved, named):
            yield from _pairs(value, target)


def _fits(t: torch.Tensor, entry: TensorEntry) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == entry.dtype
            and tuple(t.shape) == entry.shape and t.is_contiguous()
            and isinstance(t, torch.nn.Parameter) == entry.is_parameter and t.requires_grad == entry.requires_grad)
