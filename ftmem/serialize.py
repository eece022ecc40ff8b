"""Split a rank's state into a small pickled skeleton and the list of its tensors.

Tensor data is never pickled: the skeleton holds a reference (an index) in place of
each tensor, through pickle's persistent-id hook, the same way ``torch.save`` keeps
storages out of its pickle. Any picklable structure works (dicts, lists, tuples,
dataclasses, OrderedDicts, ...). A tensor that appears twice — the same object, or
another view of exactly the same elements (``p.detach()`` beside ``p``, as a
``state_dict()`` holds it) — is stored once and comes back as one object, so a state
may carry the same tensors in two forms at no extra cost.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Sequence

import torch

from .errors import UnsupportedTensor

_TENSOR_REF = "ftmem.tensor"


def _check_plain_tensor(t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedTensor(
            f"ftmem snapshots plain tensors and nn.Parameter, not {type(t).__name__}: "
            f"hand the engine the local tensor (e.g. DTensor.to_local()) and its layout."
        )
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise UnsupportedTensor(
            f"ftmem snapshots dense strided tensors; got layout={t.layout}, device={t.device}, "
            f"quantized={t.is_quantized}. Convert it (e.g. .to_dense()) before saving."
        )


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index_of: dict[tuple, int] = {}

    def persistent_id(self, obj: Any):
        if not isinstance(obj, torch.Tensor):
            return None
        _check_plain_tensor(obj)
        index = self._index_of.get(_elements(obj))
        if index is None:
            index = self._index_of[_elements(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return (_TENSOR_REF, index)


def _elements(t: torch.Tensor) -> tuple:
    """What identifies the elements a tensor views: two tensors with the same key read
    and write the same memory in the same way. Empty tensors share no memory (their
    storages may all start at address 0): each is itself."""
    if t.numel() == 0:
        return (id(t),)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, tensors: Sequence[torch.Tensor]):
        super().__init__(buf)
        self._tensors = tensors

    def persistent_load(self, pid: Any):
        kind, index = pid
        if kind != _TENSOR_REF:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in an ftmem skeleton")
        return self._tensors[index]


def split_state(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Return (skeleton bytes, tensors in reference order)."""
    buf = io.BytesIO()
    pickler = _SkeletonPickler(buf)
    pickler.dump(state)
    return buf.getvalue(), pickler.tensors


def join_state(skeleton: bytes, tensors: Sequence[torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`: put ``tensors`` back in their places."""
    return _SkeletonUnpickler(io.BytesIO(skeleton), tensors).load()
