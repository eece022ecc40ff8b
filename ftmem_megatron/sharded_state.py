"""megatron-core sharded state dicts as ftmem snapshot state, and back.

``model.sharded_state_dict()`` and ``optimizer.sharded_state_dict(...)`` describe each
local tensor by its place in a global tensor (``ShardedTensor``: key, global shape and
offset, flattened range, replica id). A snapshot keeps the local data in the same
nested structure and records every place beside it. Two things follow from the places:

* which tensors are identical on every data-parallel replica — those whose place is
  the same on all of them (module weights, and the optimizer state unless the
  distributed optimizer splits it), so ftmem keeps each byte once across the replicas;
* whether a snapshot fits the job that restores it. Restoring builds the same sharded
  state dicts again as templates, as megatron-core's ``dist_checkpointing.load`` does;
  a different TP/PP/DP layout or model gives different places, reported by key.

The filled template is a plain state dict that the modules' and the optimizer's own
``load_state_dict`` take.

A tensor split across the DP replicas (the distributed optimizer's ``dp_reshardable``
buckets: 1-D global tensors, each DP rank holding a range) sits elsewhere after a DP
change. Given the old DP group's pieces (:func:`pieces_by_key`), a template's tensor is
then joined from the pieces of its key that overlap it, as a load planner reads a
``torch_dist`` checkpoint; a part that no piece covers is a :class:`LayoutMismatch`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                      ShardedTensorFactory, apply_factories, apply_factory_merges)

from ftmem import LayoutMismatch
from ftmem.adapter import leaves, map_tree


@dataclass(frozen=True)
class Place:
    """Where a local tensor sits in its global tensor."""

    key: str
    global_shape: tuple
    global_offset: tuple
    flattened_range: Optional[tuple]
    dtype: str
    # Two pieces at one offset differ in length where the DP size split them otherwise. (A
    # place an older ftmem pickled has none: () compares unequal, a LayoutMismatch.)
    local_shape: tuple = ()

    @classmethod
    def of(cls, sharded: ShardedTensor) -> "Place":
        return cls(*place_fields(sharded))

    @classmethod
    def recorded(cls, fields) -> Optional["Place"]:
        """The place a snapshot records (:func:`place_fields`; a Place where an older ftmem pickled one), or None."""
        return fields if fields is None or isinstance(fields, Place) else cls(*fields)


def place_fields(sharded: ShardedTensor) -> tuple:
    """:meth:`Place.of`'s fields in a plain tuple, which a snapshot records: a save handles
    thousands, and a tuple is built, compared and pickled in C (a dataclass in Python)."""
    flat = sharded.flattened_range
    return (sharded.key, tuple(sharded.global_shape), tuple(sharded.global_offset),
            None if flat is None else (flat.start, flat.stop), str(sharded.dtype), tuple(sharded.local_shape))


def _path(path: tuple) -> str:
    return "/".join(map(str, path))


class Snapshot(NamedTuple):
    """A rank's sharded state as ftmem snapshots it (:func:`to_snapshot`)."""

    data: Any  # the same structure, the local tensors live (no copies)
    places: dict[str, tuple]  # the place of each ShardedTensor (:func:`place_fields`), by path
    placed: dict[str, torch.Tensor]  # the local tensor at each of those paths


def to_snapshot(sharded_state: Any) -> Snapshot:
    """``sharded_state``'s local data and places. A factory is built where the walk meets it
    (what megatron-core's ``apply_factories`` does before saving, in a walk of the whole
    state of its own: 1.5 ms of a save call at 3,860 tensors, most states holding no
    factory); non-persistent objects are left out."""
    places: dict[str, tuple] = {}
    placed: dict[str, torch.Tensor] = {}

    def local(node, path):
        if isinstance(node, ShardedTensor):
            at = _path(path)
            places[at], placed[at] = place_fields(node), node.data
            return node.data
        if isinstance(node, ShardedObject):
            return node.data
        if isinstance(node, ShardedTensorFactory):
            return map_tree(node.build(), local, path)  # in its place, as apply_factories puts it
        if isinstance(node, LocalNonpersistentObject):
            return None  # restored from the job's own template
        return node

    return Snapshot(map_tree(sharded_state, local), places, placed)


# A global tensor's pieces, as several ranks saved them: {key: {(offset, shape): (place, data)}}.
Pieces = dict[str, dict[tuple, tuple[Place, torch.Tensor]]]
# Where a template's list is longer than the snapshot's (other pieces after a DP change).
_ABSENT = object()


def pieces_by_key(snapshots: list[tuple[Any, dict[str, tuple]]]) -> Pieces:
    """The tensors of several ranks' snapshots (each its data and places, from
    :func:`to_snapshot`) by key and global offset; a place held by several (DP replicas)
    once."""
    found: Pieces = {}
    for data, places in snapshots:
        for path, tensor in _tensors_by_path(data).items():
            place = Place.recorded(places.get(path))
            if place is not None and place.flattened_range is None:
                found.setdefault(place.key, {}).setdefault((place.global_offset, place.local_shape), (place, tensor))
    return found


def _joined(wanted: Place, like: torch.Tensor, pieces: Pieces, where: str) -> torch.Tensor:
    """A new tensor like the template's ``like`` at ``wanted``, copied from the overlapping pieces."""
    def mismatch(why: str) -> LayoutMismatch:
        return LayoutMismatch(f"the snapshot's tensor at {where!r} does not fit this job: {why} (this job expects "
                              f"{wanted}).")

    if wanted.flattened_range is not None:
        raise mismatch("it is saved at another place, and a flattened range is not joined from other pieces")
    joined, shape = torch.empty_like(like), like.shape
    covered = torch.zeros(shape, dtype=torch.bool)  # each element written once, by exactly one piece
    for place, data in pieces.get(wanted.key, {}).values():
        if (place.global_shape, place.dtype) != (wanted.global_shape, wanted.dtype):
            raise mismatch(f"its key {wanted.key!r} was saved as {place}")
        low = [max(a, b) for a, b in zip(wanted.global_offset, place.global_offset)]
        high = [min(a + n, b + m) for a, n, b, m in zip(wanted.global_offset, shape, place.global_offset, data.shape)]
        if all(lo < hi for lo, hi in zip(low, high)):
            here = tuple(slice(lo - a, hi - a) for lo, hi, a in zip(low, high, wanted.global_offset))
            if covered[here].any():
                raise mismatch(f"the old ranks' pieces of {wanted.key!r} overlap")
            joined[here] = data[tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, place.global_offset))]
            covered[here] = True
    if not covered.all():
        raise mismatch(f"the old ranks' pieces of {wanted.key!r} cover {int(covered.sum())} of its "
                       f"{covered.numel()} elements")
    return joined


def from_snapshot(template: Any, data: Any, places: dict[str, tuple], pieces: Optional[Pieces] = None) -> Any:
    """Fill ``template`` (sharded state dicts built for loading) with a snapshot's data;
    a tensor saved at another place is joined from ``pieces`` (:func:`pieces_by_key`),
    where given.

    Raises :class:`LayoutMismatch` naming the first tensor that does not fit.
    """
    factories, _ = extract_matching_values(template, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(template)

    def walk(expected, held, path):
        where = _path(path)
        if isinstance(expected, ShardedTensor):
            wanted, saved = Place.of(expected), Place.recorded(places.get(where))
            if saved == wanted:
                return held
            if pieces is not None:
                return _joined(wanted, expected.data, pieces, where)
            raise LayoutMismatch(f"the snapshot's tensor at {where!r} does not fit this job: saved as {saved}, "
                                 f"this job expects {wanted}.")
        if isinstance(expected, ShardedObject):
            if held is _ABSENT:
                raise LayoutMismatch(f"the snapshot lacks the state at {where!r}, which this job expects.")
            return held
        if isinstance(expected, LocalNonpersistentObject):
            return expected.unwrap()
        if held is _ABSENT:  # beyond the end of a snapshot's list: only sharded pieces to join
            if isinstance(expected, dict):
                return {k: walk(v, _ABSENT, path + (k,)) for k, v in expected.items()}
            if isinstance(expected, (list, tuple)):
                return type(expected)(walk(v, _ABSENT, path + (i,)) for i, v in enumerate(expected))
            return expected
        if isinstance(expected, dict):
            # As megatron-core's load: the saved plain (non-sharded) entries are taken as
            # saved; every sharded entry the job expects must be there.
            if not isinstance(held, dict):
                raise LayoutMismatch(f"the snapshot's state at {where!r} is a {type(held).__name__}, "
                                     f"this job expects a dict.")
            missing = [str(k) for k, v in expected.items() if k not in held and _holds_sharded(v)]
            if missing:
                raise LayoutMismatch(f"the snapshot's state at {where or 'the top'!r} lacks {missing}, "
                                     f"which this job expects.")
            return {k: walk(expected[k], v, path + (k,)) if k in expected else v for k, v in held.items()}
        if isinstance(expected, (list, tuple)):
            # Joining pieces, a DP change may split a list of sharded pieces (a bucket's) otherwise.
            resplit = pieces is not None and all(_holds_sharded(v) for v in expected)
            if not isinstance(held, (list, tuple)) or (len(held) != len(expected) and not resplit):
                raise LayoutMismatch(f"the snapshot's state at {where!r} has another length than this job expects.")
            return type(expected)(walk(v, held[i] if i < len(held) else _ABSENT, path + (i,))
                                  for i, v in enumerate(expected))
        return held

    return apply_factory_merges(walk(template, data, ()), factories)


def local_tensors(template: Any, places: dict[str, Any]) -> Any:
    """The local tensors of ``template`` (sharded state dicts built for loading), in the
    structure of a snapshot's data, as far as each sits at the place the snapshot recorded
    for its path: the tensors a restore may write straight into (:mod:`ftmem._state.destinations`),
    which :func:`from_snapshot` then finds holding their values. Factories are left as they
    are (not applied), and what they would build is not named."""
    def local(node, path):
        if isinstance(node, ShardedTensor):
            return node.data if Place.recorded(places.get(_path(path))) == Place.of(node) else None
        return None

    return map_tree(template, local)


def _holds_sharded(node) -> bool:
    return any(isinstance(value, (ShardedTensor, ShardedObject)) for _, value in leaves(node))


def replicated_paths(places: dict[str, tuple], dp_group) -> set[str]:
    """Paths whose tensors every member of ``dp_group`` holds at the same place: the
    same bytes on every replica (collective over the group; none without one)."""
    if dp_group is None:
        return set()
    everyone: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(everyone, places, group=dp_group)
    return {path for path, place in places.items() if all(other.get(path) == place for other in everyone)}


class ReplicatedPaths:
    """:func:`replicated_paths`, asked at every save: gathered again only where some replica's
    places changed since the last save, as from one save of a training loop to the next they
    do not. Each replica compares its own places, and one all-reduce of a flag tells every
    replica whether any changed: gathering thousands of places from every replica cost each
    save call tens of milliseconds.

    ``dp_group`` is ftmem's gloo group of the replicas (``AdapterRuntime.dp_group``), whose
    collectives stay on the CPU: on Megatron's own group (NCCL on GPUs) the flag's way back
    to the host would wait for the work queued on the device, the step's included."""

    def __init__(self) -> None:
        self._last: Optional[tuple[dict[str, tuple], set[str]]] = None  # the places, and the paths found

    def of(self, places: dict[str, tuple], dp_group) -> set[str]:
        """:func:`replicated_paths` (collective over ``dp_group``)."""
        if dp_group is None:
            return set()
        changed = torch.tensor([self._last is None or self._last[0] != places], dtype=torch.int32)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=dp_group)
        if changed.item():
            self._last = (places, replicated_paths(places, dp_group))
        return self._last[1]


def _tensors_by_path(data: Any) -> dict[str, torch.Tensor]:
    """The tensors of a snapshot tree (from :func:`to_snapshot`) by path."""
    return {_path(path): value for path, value in leaves(data) if isinstance(value, torch.Tensor)}
