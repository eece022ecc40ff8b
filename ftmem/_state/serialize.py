"""Split a rank's state into a small pickled skeleton and the list of its tensors.

Tensor data is never pickled: the skeleton holds a reference (a call of
:func:`tensor_reference` with an index) in place of each tensor, as ``torch.save`` keeps
storages out of its pickle. Any picklable structure works (dicts, lists, tuples,
dataclasses, OrderedDicts, ...). A tensor that appears twice — the same object, or
another view of exactly the same elements (``p.detach()`` beside ``p``, as a
``state_dict()`` holds it) — is stored once and comes back as one object, so a state
may carry the same tensors in two forms at no extra cost.

A skeleton is read back from shared memory, where another local user may have planted
one, so it is loaded by a restricted unpickler: a global (a class or function the pickle
names) loads only if it is on an allowlist of plain types (:func:`admitted_globals`),
the same list torch's ``weights_only`` loading uses, with what the user added there
through ``torch.serialization.add_safe_globals``. Anything else is refused with the
name and the way to admit it. A save checks its skeleton the same way, so a job learns
of an unadmitted type at its first save rather than at a restore after a crash.
"""
from __future__ import annotations

import argparse
import collections
import io
import pickle
from typing import Any, Sequence

import numpy as np
import torch
import torch._weights_only_unpickler as weights_only

from ftmem.errors import UnadmittedType, UnsupportedTensor
from ftmem._state.gc_deferral import collection_deferred

# Plain types a state holds beyond what torch's weights_only list has: containers and
# scalars, argparse.Namespace (Megatron's args), numpy arrays (numpy's RNG state) under
# numpy 2's module names and numpy 1's. Constructing any of them runs no user code.
_PLAIN = {f"builtins.{t.__name__}": t for t in (bool, int, float, complex, str, bytes, bytearray, list, tuple,
                                                  dict, set, frozenset)}
_PLAIN.update({
    "collections.OrderedDict": collections.OrderedDict,
    "collections.defaultdict": collections.defaultdict,
    "argparse.Namespace": argparse.Namespace,
    "numpy.ndarray": np.ndarray,
    "numpy.dtype": np.dtype,
})
_NP_CORE = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed it; pickles name either
for _core in ("numpy._core", "numpy.core"):
    _PLAIN.update({f"{_core}.multiarray._reconstruct": _NP_CORE.multiarray._reconstruct,
                   f"{_core}.multiarray.scalar": _NP_CORE.multiarray.scalar,
                   f"{_core}.numeric._frombuffer": _NP_CORE.numeric._frombuffer})


def admitted_globals() -> dict[str, Any]:
    """Every global a skeleton may name, by ``module.name``: the plain types above, torch's
    own weights_only list (dtypes, torch.Size, torch.device, ...), and what the user
    admitted with ``torch.serialization.add_safe_globals`` (asked anew each time: a user
    may admit more at any point before a save or a restore)."""
    admitted = dict(_PLAIN)
    admitted.update(weights_only._get_allowed_globals())
    admitted.update(weights_only._get_user_allowed_globals())
    return admitted


def _unadmitted(name: str, when: str) -> UnadmittedType:
    return UnadmittedType(
        f"{when} names {name}, which ftmem does not load from shared memory (another local user could have "
        f"written it there, and loading it could run code). Admitted are plain containers and scalars, "
        f"OrderedDict/defaultdict, argparse.Namespace, numpy arrays and torch dtypes/Size/device. If {name} is "
        f"yours and safe to construct, admit it in every process of the job, before its first save and restore: "
        f"torch.serialization.add_safe_globals([{name}]) (and `ftmem export --admit {name}`); else keep it out "
        f"of the saved state."
    )


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


def tensor_reference(index: int) -> Any:
    """What a skeleton calls, by this name, in place of the tensor at ``index``. Only a
    skeleton's own unpickler answers the call (with the tensor); called otherwise, it says so."""
    raise pickle.UnpicklingError(f"tensor reference {index} is an ftmem skeleton's: load it with ftmem._state.serialize")


_TENSOR_REFERENCE = f"{tensor_reference.__module__}.{tensor_reference.__qualname__}"


class _SkeletonPickler(pickle.Pickler):
    # A tensor is reduced to a call of tensor_reference(index). reducer_override runs for
    # objects of non-builtin types only, and once per object (pickle's memo answers a
    # tensor met again), where a persistent_id hook would run for every object of the
    # state: at ~1,700 tensors and ~20,000 other objects a save, that was most of the
    # training loop's wait in the save call.
    def __init__(self, buf: io.BytesIO):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index_of: dict[tuple, int] = {}

    def reducer_override(self, obj: Any):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        _check_plain_tensor(obj)
        key = _elements(obj)
        index = self._index_of.get(key)
        if index is None:
            index = self._index_of[key] = len(self.tensors)
            self.tensors.append(obj)
        return tensor_reference, (index,)


def _elements(t: torch.Tensor) -> tuple:
    """What identifies the elements a tensor views: two tensors with the same key read
    and write the same memory in the same way. Empty tensors share no memory (their
    storages may all start at address 0): each is itself."""
    if t.numel() == 0:
        return (id(t),)
    # The address of the first element stands for storage and offset (cheaper to ask for).
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, tensors: Sequence[Any], when: str):
        super().__init__(buf)
        self._tensors = tensors
        self._admitted = admitted_globals()
        self._when = when

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" == _TENSOR_REFERENCE:
            return self._tensors.__getitem__
        found = self._admitted.get(f"{module}.{name}")
        if found is None:
            raise _unadmitted(f"{module}.{name}", self._when)
        return found


def split_state(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Return (skeleton bytes, tensors in reference order). UnadmittedType if the state
    holds an object that a restore would refuse to load."""
    buf = io.BytesIO()
    pickler = _SkeletonPickler(buf)
    with collection_deferred():  # a save's pickling makes tens of thousands of short-lived objects
        pickler.dump(state)
        skeleton = buf.getvalue()
        # Loaded as a restore will load it (with no tensors behind the references): the same
        # check, so that what a save accepts a restore accepts.
        _SkeletonUnpickler(io.BytesIO(skeleton), [None] * len(pickler.tensors), "the state to save").load()
    return skeleton, pickler.tensors


def join_state(skeleton: bytes, tensors: Sequence[Any]) -> Any:
    """Inverse of :func:`split_state`: put ``tensors`` back in their places.
    UnadmittedType if the skeleton names a global that is not admitted."""
    return _SkeletonUnpickler(io.BytesIO(skeleton), tensors, "the snapshot's skeleton").load()


class _TensorsApart(pickle.Pickler):
    """Pickles a structure as torch.save does (protocol 2), its tensors left out as numbered references."""

    def persistent_id(self, obj: Any) -> Any:
        return id(obj) if isinstance(obj, torch.Tensor) else None


def refuse_unless_weights_only(obj: Any, what: str) -> None:
    """Raise UnadmittedType if ``torch.load(..., weights_only=True)`` would refuse a file
    holding ``obj`` (``what`` names it): the same check, torch's own unpickler over the
    structure as torch.save pickles it, its tensors left out."""
    buf = io.BytesIO()
    _TensorsApart(buf, protocol=2).dump(obj)
    buf.seek(0)
    unpickler = weights_only.Unpickler(buf, encoding="utf-8")
    unpickler.persistent_load = lambda pid: None
    try:
        unpickler.load()
    except pickle.UnpicklingError as e:
        raise UnadmittedType(f"torch.load(weights_only=True) of {what} (served from memory) refuses it, as it "
                             f"would refuse the file: {e} Load it with weights_only=False if you trust it.") from None
