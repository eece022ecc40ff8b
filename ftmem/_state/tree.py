"""Walking a nested state: dicts (by key), lists and tuples (by position) down to leaves.

Checkpoint states are such trees. Every walk over one, the core's and the adapters', goes
through here, so that they agree on what a container is: a namedtuple is a leaf (as
``torch.load``'s ``map_location`` leaves it), and a mapped tree is always made of new
containers, which a caller may change without touching the original.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import torch

Path = tuple  # the keys and positions from the root to a node


def _is_sequence(node: Any) -> bool:
    return isinstance(node, (list, tuple)) and not hasattr(node, "_fields")


def map_tree(node: Any, leaf: Callable[[Any, Path], Any], path: Path = ()) -> Any:
    """``node`` with every leaf replaced by ``leaf(value, path)``, in new containers of the same types."""
    if isinstance(node, dict):
        mapped = {k: map_tree(v, leaf, path + (k,)) for k, v in node.items()}
        if type(node) is dict:
            return mapped
        like = copy.copy(node)  # an OrderedDict, a defaultdict (with its factory), ...
        like.clear()
        like.update(mapped)
        return like
    if _is_sequence(node):
        return type(node)(map_tree(v, leaf, path + (i,)) for i, v in enumerate(node))
    return leaf(node, path)


def leaves(node: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, value) of every leaf under ``node``, in order."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, path + (k,))
    elif _is_sequence(node):
        for i, v in enumerate(node):
            yield from leaves(v, path + (i,))
    else:
        yield path, node


def tensors(node: Any) -> list[torch.Tensor]:
    """The tensors under ``node``, in order. (Without :func:`leaves`' paths and generators: a
    save call asks this of states of thousands of tensors, and each generator a leaf passes
    up through costs it time.)"""
    found: list[torch.Tensor] = []
    _collect_tensors(node, found.append)
    return found


def holds_tensors(node: Any) -> bool:
    """Whether a tensor is under ``node`` (it looks no further than the first)."""
    try:
        _collect_tensors(node, _found_one)
    except _FoundOne:
        return True
    return False


def _collect_tensors(node: Any, keep: Callable[[torch.Tensor], Any]) -> None:
    if isinstance(node, dict):
        children = node.values()
    elif _is_sequence(node):
        children = node
    else:
        if isinstance(node, torch.Tensor):
            keep(node)
        return
    for child in children:
        if isinstance(child, torch.Tensor):
            keep(child)
        elif isinstance(child, (dict, list, tuple)) and type(child) is not torch.Size:  # a Size holds ints
            _collect_tensors(child, keep)


class _FoundOne(Exception):
    pass


def _found_one(_tensor: torch.Tensor) -> None:
    raise _FoundOne


def apply_map_location(node: Any, map_location) -> Any:
    """What ``torch.load(map_location=...)`` would have done to restored CPU tensors:
    a device or string moves them; a callable gets each storage, as torch.load calls it.
    Containers are always new, as torch.load's are: callers may change what they get (a
    restored or served state is handed out more than once)."""
    def move(t: Any, _path: Path) -> Any:
        if not isinstance(t, torch.Tensor) or map_location is None:
            return t
        if callable(map_location):
            storage = map_location(t.untyped_storage(), "cpu")
            if storage is t.untyped_storage():
                return t
            return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(),
                                                                             t.size(), t.stride())
        return t.to(map_location)

    return map_tree(node, move)


def lowest_rank_first(per_rank: list[dict]) -> dict:
    """One dict of every rank's entries (``per_rank``: by rank); an entry several ranks hold
    is taken from the lowest of them, as frameworks write files every DP replica holds from
    their first replica (DeepSpeed fills some entries on rank 0 only)."""
    merged: dict = {}
    for entries in per_rank:
        for key, value in entries.items():
            merged.setdefault(key, value)
    return merged
