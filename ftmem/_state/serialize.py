"""Split a rank's state into a small pickled skeleton and the list of its tensors.

Tensor data is never pickled: the skeleton holds a reference (a call of
:func:`next_tensor`) in place of each tensor, as ``torch.save`` keeps storages out of its
pickle. Any picklable structure works (dicts, lists, tuples,
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
import copyreg
import importlib
import io
import operator
import pickle
import types
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
import torch._weights_only_unpickler as weights_only

from ftmem.errors import UnadmittedType, UnsupportedTensor
from ftmem._state.gc_deferral import with_collection_deferred
from ftmem._state.torch_function import modes_off

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
# numpy 2 renamed numpy.core to numpy._core, and pickles name either; numpy 1.26's numpy._core
# is only a shim of some of its modules, so the functions come from the package that holds them.
_NP_CORE = "numpy._core" if int(np.__version__.split(".")[0]) >= 2 else "numpy.core"
_NP_MULTIARRAY = importlib.import_module(f"{_NP_CORE}.multiarray")
_NP_NUMERIC = importlib.import_module(f"{_NP_CORE}.numeric")
for _core in ("numpy._core", "numpy.core"):
    _PLAIN.update({f"{_core}.multiarray._reconstruct": _NP_MULTIARRAY._reconstruct,
                   f"{_core}.multiarray.scalar": _NP_MULTIARRAY.scalar,
                   f"{_core}.numeric._frombuffer": _NP_NUMERIC._frombuffer})


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


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Quantized dtypes: a quantized tensor is strided and has storage, so only its dtype tells it apart.
_QUANTIZED = frozenset(d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2",
                                                                     "quint2x4")) if d is not None)


def _check_plain_tensor(t: torch.Tensor) -> None:
    if type(t) not in _PLAIN_TENSOR_TYPES:
        raise UnsupportedTensor(
            f"ftmem snapshots plain tensors and nn.Parameter, not {type(t).__name__}: "
            f"hand the engine the local tensor (e.g. DTensor.to_local()) and its layout."
        )
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.is_nested:
        raise UnsupportedTensor(
            f"ftmem snapshots dense strided tensors; got layout={t.layout}, device={t.device}, "
            f"quantized={t.is_quantized}, nested={t.is_nested}. Convert it (e.g. .to_dense()) before saving."
        )


def next_tensor() -> Any:
    """What a skeleton calls, by this name, in place of each tensor: the tensors in the order
    the skeleton meets them. Only a skeleton's own unpickler answers the call; called
    otherwise, it says so."""
    raise pickle.UnpicklingError("a tensor reference is an ftmem skeleton's: load it with ftmem._state.serialize")


_NEXT_TENSOR = f"{next_tensor.__module__}.{next_tensor.__qualname__}"
_A_TENSOR = (next_tensor, ())  # a tensor's reduction, the same tuple for every tensor
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
# Per tensor, asked for all tensors at once in C loops (map), not attribute by attribute in Python.
_DATA_PTR, _SHAPE = torch.Tensor.data_ptr, operator.attrgetter("shape")
_DTYPE, _DEVICE_INDEX, _CONTIGUOUS = operator.attrgetter("dtype"), torch.Tensor.get_device, torch.Tensor.is_contiguous


class _SkeletonPickler(pickle.Pickler):
    # reducer_override runs for objects of non-builtin types only, and once per object
    # (pickle's memo answers a tensor met again), where a persistent_id hook would run for
    # every object of the state: at ~1,700 tensors and ~20,000 other objects a save, that
    # was most of the training loop's wait in the save call. Per tensor it only keeps the
    # tensor and answers with the same reduction: a save call meets thousands of tensors,
    # and a Python step for each costs it milliseconds. What tells views apart and what a
    # plan depends on are asked for afterwards, for all tensors at once (elements).
    def __init__(self, buf: io.BytesIO):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.found: list[torch.Tensor] = []  # every tensor object, in the order the skeleton meets them
        self._keep = self.found.append
        self.naming: set = set()  # what decides the globals the skeleton names (_naming)
        self._name = self.naming.add

    def reducer_override(self, obj: Any):
        kind = type(obj)
        if kind is _TENSOR or kind is _PARAMETER:
            self._keep(obj)
            return _A_TENSOR
        if kind is _SIZE:  # as a Size reduces itself, without the way there (DeepSpeed saves thousands)
            return _SIZE, (tuple(obj),)
        if isinstance(obj, torch.Tensor):
            _check_plain_tensor(obj)  # a subclass: refused
        self._name(_naming(obj, kind))
        return NotImplemented


_SIZE = torch.Size
_BY_NAME: dict[type, bool] = {}  # per type: whether pickle names its instances as globals of their own


def _naming(obj: Any, kind: type) -> Any:
    """What decides the globals that pickling ``obj`` names (reducer_override meets every
    object that can name one): ``obj`` itself where pickle names it (a class, a function, a
    dtype), else its type, whose reduction names a callable that pickling meets in its turn."""
    by_name = _BY_NAME.get(kind)
    if by_name is None:
        by_name = _BY_NAME[kind] = isinstance(obj, (type, types.FunctionType)) or _reduces_to_a_name(obj, kind)
    if not by_name:
        return kind
    try:
        hash(obj)
    except TypeError:
        return id(obj)  # never the same twice: a skeleton naming it is checked at every save
    return obj


def _reduces_to_a_name(obj: Any, kind: type) -> bool:
    reduce = copyreg.dispatch_table.get(kind)
    try:
        return isinstance(reduce(obj) if reduce is not None else obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL), str)
    except Exception:  # not picklable: pickling it says why
        return False


def elements(found: list[torch.Tensor]) -> list[tuple]:
    """Per tensor, what identifies the elements it views: (address of the first element,
    shape, strides or None where contiguous, dtype, device index): two tensors with the same
    key read and write the same memory in the same way. UnsupportedTensor for a tensor that is
    not dense and strided."""
    with modes_off():  # asked of thousands of tensors: not a Python call each through a mode
        return _elements(found)


def _elements(found: list[torch.Tensor]) -> list[tuple]:
    try:
        addresses, dtypes = list(map(_DATA_PTR, found)), list(map(_DTYPE, found))
        contiguous = list(map(_CONTIGUOUS, found))
        strides = [None] * len(found) if all(contiguous) else [
            None if c else t.stride() for t, c in zip(found, contiguous)]
        keys = list(zip(addresses, map(_SHAPE, found), strides, dtypes, map(_DEVICE_INDEX, found)))
    except RuntimeError:  # no storage (sparse, mkldnn) or no strides (nested)
        keys = None
    if keys is None:  # one of them is not dense and strided: find it
        return [_checked_elements(t) for t in found]
    rare = [i for i, address in enumerate(addresses) if not address] if 0 in addresses else []
    if not _QUANTIZED.isdisjoint(dtypes):
        rare += [i for i, dtype in enumerate(dtypes) if dtype in _QUANTIZED]
    for i in rare:  # checked in full: empty (each is itself), quantized (refused), on no device (refused)
        keys[i] = _checked_elements(found[i])
    return keys


def _checked_elements(t: torch.Tensor) -> tuple:
    _check_plain_tensor(t)
    if t.data_ptr() == 0:  # empty tensors share no memory (their storages may all start at 0): each is itself
        return (id(t), t.shape, None, t.dtype, t.get_device())
    return (t.data_ptr(), t.shape, None if t.is_contiguous() else t.stride(), t.dtype, t.get_device())


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, when: str, tensors: Sequence[Any] = ()):
        super().__init__(buf)
        self._admitted = admitted_globals()
        self._when = when
        self._in_order = iter(tensors)  # what each reference stands for, in the skeleton's order

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" == _NEXT_TENSOR:
            return self._in_order.__next__
        found = self._admitted.get(f"{module}.{name}")
        if found is None:
            raise _unadmitted(f"{module}.{name}", self._when)
        return found


class SplitState(NamedTuple):
    """A state split for a snapshot."""

    skeleton: bytes
    tensors: list[torch.Tensor]  # each view of the same elements once, in the order the state holds them
    # per tensor, what identifies the elements it views (elements): (address of the first
    # element, shape, strides or None where contiguous, dtype, device index)
    elements: tuple[tuple, ...]


def split_state(state: Any) -> SplitState:
    """The state's skeleton and its tensors. UnadmittedType if the state holds an object that
    a restore would refuse to load, UnsupportedTensor if a tensor that ftmem does not copy.

    The skeleton is two pickles: where each of the state's references goes among the
    tensors (None: each to the next, no two views of the same elements), then the state."""
    return with_collection_deferred(_split, state)  # a save's pickling makes tens of thousands of short-lived objects


def _split(state: Any) -> SplitState:
    buf = io.BytesIO()
    pickler = _SkeletonPickler(buf)
    pickler.dump(state)
    found = pickler.found
    keys = elements(found)
    # Each key's first reference (a dict keeps the last value given for a key).
    first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))
    if len(first) == len(keys):
        tensors, aliases = found, None
    else:
        kept = sorted(first.values())
        number = {reference: i for i, reference in enumerate(kept)}
        aliases = [number[first[key]] for key in keys]
        tensors, keys = [found[i] for i in kept], [keys[i] for i in kept]
    skeleton = pickle.dumps(aliases, protocol=pickle.HIGHEST_PROTOCOL) + buf.getvalue()
    # Loaded as a restore will load it (with no tensors behind the references): the same
    # check, so that what a save accepts a restore accepts. Once for each set of globals
    # the skeletons name and admitted set: loading builds every object of the state anew,
    # which costs a save call of thousands of them a millisecond or more.
    checked = (frozenset(pickler.naming), frozenset(admitted_globals()))
    if checked != _checked_last[0]:
        join_state(skeleton, [None] * len(tensors), "the state to save")
        _checked_last[0] = checked
    return SplitState(skeleton, tensors, tuple(keys))


# What the last skeleton checked named and what was admitted then (split_state).
_checked_last: list = [None]


def join_state(skeleton: bytes, tensors: Sequence[Any], what: str = "the snapshot's skeleton") -> Any:
    """Inverse of :func:`split_state`: put ``tensors`` back in their places.
    UnadmittedType if the skeleton names a global that is not admitted (saying it of ``what``)."""
    buf = io.BytesIO(skeleton)
    aliases = _SkeletonUnpickler(buf, what).load()  # the first pickle: where the references go
    return _SkeletonUnpickler(buf, what, tensors if aliases is None else [tensors[i] for i in aliases]).load()


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
