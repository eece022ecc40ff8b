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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                      ShardedTensorFactory, apply_factories, apply_factory_merges)

from ftmem import LayoutMismatch


@dataclass(frozen=True)
class Place:
    """Where a local tensor sits in its global tensor."""

    key: str
    global_shape: tuple
    global_offset: tuple
    flattened_range: Optional[tuple]
    dtype: str

    @classmethod
    def of(cls, sharded: ShardedTensor) -> "Place":
        flat = sharded.flattened_range
        return cls(sharded.key, tuple(sharded.global_shape), tuple(sharded.global_offset),
                   None if flat is None else (flat.start, flat.stop), str(sharded.dtype))


def _path(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def to_snapshot(sharded_state: Any) -> tuple[Any, dict[str, Place]]:
    """The local data of ``sharded_state`` (same structure, live tensors, no copies) and
    the place of each ShardedTensor by path. Factories are applied in place, as
    megatron-core does before saving; non-persistent objects are left out."""
    apply_factories(sharded_state)
    places: dict[str, Place] = {}

    def walk(node, path):
        if isinstance(node, ShardedTensor):
            places[_path(path)] = Place.of(node)
            return node.data
        if isinstance(node, ShardedObject):
            return node.data
        if isinstance(node, LocalNonpersistentObject):
            return None  # restored from the job's own template
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
        return node

    return walk(sharded_state, ()), places


def from_snapshot(template: Any, data: Any, places: dict[str, Place]) -> Any:
    """Fill ``template`` (sharded state dicts built for loading) with a snapshot's data.

    Raises :class:`LayoutMismatch` naming the first tensor whose place differs.
    """
    factories, _ = extract_matching_values(template, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(template)

    def walk(expected, held, path):
        where = _path(path)
        if isinstance(expected, ShardedTensor):
            wanted, saved = Place.of(expected), places.get(where)
            if saved != wanted:
                raise LayoutMismatch(f"the snapshot's tensor at {where!r} does not fit this job: saved as {saved}, "
                                     f"this job expects {wanted}.")
            return held
        if isinstance(expected, ShardedObject):
            return held
        if isinstance(expected, LocalNonpersistentObject):
            return expected.unwrap()
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
            if not isinstance(held, (list, tuple)) or len(held) != len(expected):
                raise LayoutMismatch(f"the snapshot's state at {where!r} has another length than this job expects.")
            return type(expected)(walk(v, h, path + (i,)) for i, (v, h) in enumerate(zip(expected, held)))
        return held

    return apply_factory_merges(walk(template, data, ()), factories)


def local_tensors(template: Any, places: dict[str, Any]) -> Any:
    """The local tensors of ``template`` (sharded state dicts built for loading), in the
    structure of a snapshot's data, as far as each sits at the place the snapshot recorded
    for its path: the tensors a restore may write straight into (:mod:`ftmem.destinations`),
    which :func:`from_snapshot` then finds holding their values. Factories are left as they
    are (not applied), and what they would build is not named."""
    def walk(node, path):
        if isinstance(node, ShardedTensor):
            return node.data if places.get(_path(path)) == Place.of(node) else None
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        return None

    return walk(template, ())


def _holds_sharded(node) -> bool:
    if isinstance(node, (ShardedTensor, ShardedObject)):
        return True
    if isinstance(node, dict):
        return any(_holds_sharded(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_sharded(v) for v in node)
    return False


def replicated_paths(places: dict[str, Place], dp_group) -> set[str]:
    """Paths whose tensors every member of ``dp_group`` holds at the same place: the
    same bytes on every replica (collective over the group)."""
    if dist.get_world_size(dp_group) == 1:
        return set()
    everyone: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(everyone, places, group=dp_group)
    return {path for path, place in places.items() if all(other.get(path) == place for other in everyone)}


def tensors_at(data: Any, paths: Optional[set[str]]) -> list[torch.Tensor]:
    """The tensors of a snapshot tree (from :func:`to_snapshot`) at ``paths`` (all if None)."""
    if paths is not None and not paths:
        return []  # at every save of a job without DP replicas: no walk
    found = []

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            if paths is None or _path(path) in paths:
                found.append(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))

    walk(data, ())
    return found
