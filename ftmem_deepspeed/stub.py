"""The stub files ftmem writes where DeepSpeed writes checkpoint files.

A stub keeps ``load_checkpoint``'s ``latest``/glob/exists checks working and carries its
file's tensor-free top-level entries (``mp_world_size``, ``global_steps``, ...), which
DeepSpeed reads from files other ranks hold. Its data is in shared memory.

A stub is a valid torch archive (``torch.save``) of one call:
``ftmem_guard.ftmem_in_memory_checkpoint_stub(info)``. Read by anything but this module
(``torch.load`` in DeepSpeed's own file readers such as zero_to_fp32, or in a user's
script), that call raises ``FtmemStubFile``, which says what the file is and how to get
real files. This module reads the call's argument instead of making it.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any, Optional

import torch

import ftmem_guard
from ftmem.adapter import VersionRef, write_atomically

_STUB_GLOBAL = (ftmem_guard.__name__, ftmem_guard.ftmem_in_memory_checkpoint_stub.__name__)

# Under torch.load(weights_only=True) too (torch's default), a stub read in this process
# raises the clear error rather than torch's "unsupported global" advice.
torch.serialization.add_safe_globals([ftmem_guard.ftmem_in_memory_checkpoint_stub])


# The stub's own format. 1: tag_file, job, metadata; 2: also world (the writer's world size
# and ranks per node); 3: also version (the save it stands for, a VersionRef's fields); 4: the
# metadata pickled apart, as bytes; 5: each metadata entry pickled apart, a dict of bytes
# (read_stub returns the metadata unpickled). A stub without "format" is of format 1.
STUB_FORMAT = 5
# An entry whose pickle is at least this long is kept for the next save (EntryPickles).
_KEPT_FROM_BYTES = 4096


class _Stub:
    def __init__(self, info: dict):
        self.info = info

    def __reduce__(self):
        return ftmem_guard.ftmem_in_memory_checkpoint_stub, (self.info,)


class EntryPickles:
    """The tensor-free entries of a rank's files, each pickled apart, and a long pickle kept
    while its entry stays equal to what the pickle holds. DeepSpeed builds its param_shapes
    (a torch.Size per parameter: thousands) anew at every save, equal to the last save's, and
    pickling them cost the save call ten times more than comparing them. The comparison is with
    the kept pickle's own copy, never with an object of the caller's (which may have changed in
    place since), and of the same type: a changed entry is pickled anew."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], tuple[Any, bytes]] = {}  # (file, entry) -> (its copy, its pickle)

    def __call__(self, file: str, metadata: dict) -> dict[str, bytes]:
        """``file``: which of the rank's files (its name in the tag's directory); the same
        bytes object for an entry as long as it is kept."""
        pickled = {}
        for name, value in metadata.items():
            kept = self._kept.get((file, name))
            if kept is not None and type(kept[0]) is type(value) and _equal(kept[0], value):
                pickled[name] = kept[1]
                continue
            pickled[name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            if len(pickled[name]) >= _KEPT_FROM_BYTES:
                self._kept[(file, name)] = (pickle.loads(pickled[name]), pickled[name])
            else:
                self._kept.pop((file, name), None)
        return pickled


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an entry without a plain equality (an array's is elementwise): not the same
        return False


def write_stub(path: str, tag_file: str, version: VersionRef, entries: dict[str, bytes], world: tuple[int, int],
               durable: bool = True) -> None:
    """``entries``: the file's tensor-free entries, each pickled (:class:`EntryPickles`);
    ``version``: the save the stub stands for, told apart from an earlier run's save of the
    same number; ``world``: the writing job's (world size, ranks per node), for a refusal to
    name what a relaunch at another size changed. Not ``durable``: left to the page cache, for
    the caller to sync later (a save's stubs are synced by its copy thread, not the training
    thread)."""
    # Every DP replica writes the same model-states stub: each under a temporary name of its own.
    stub = io.BytesIO()
    # The metadata goes into the archive as bytes of its own pickles: torch.save's pickler asks
    # a Python hook about every object, and DeepSpeed's param_shapes alone are thousands of them,
    # written on the training thread at every save.
    torch.save(_Stub({"format": STUB_FORMAT, "tag_file": tag_file, "job": version.job, "metadata": entries,
                      "world": list(world), "version": dataclasses.asdict(version)}), stub)
    write_atomically(path, stub.getvalue(), durable=durable)


def version_of(info: dict) -> Optional[VersionRef]:
    """The save a stub (its ``info``) stands for; None for a stub of a format before 3, which does not say."""
    return VersionRef(**info["version"]) if info.get("format", 1) >= 3 else None


class _NotAStub(Exception):
    pass


class _IsStub(Exception):
    pass


def _unpickler(whole: bool):
    """An unpickler module for torch.load that returns a stub's info instead of raising.
    It looks no further than the first global: a stub's is the call, and a real
    checkpoint's comes before any of its data. With ``whole`` False, that settles it."""
    class Unpickler(pickle.Unpickler):
        seen_stub = False

        def find_class(self, module, name):
            if (module, name) == _STUB_GLOBAL:
                if not whole:
                    raise _IsStub
                self.seen_stub = True
                return lambda info: info
            if not self.seen_stub:
                raise _NotAStub
            return super().find_class(module, name)

    class Module:
        pass

    Module.Unpickler, Module.load = Unpickler, pickle.load
    Module.__name__ = "ftmem_stub_reader"
    return Module


# torch.load as it was before ftmem_deepspeed's hook (imported after this module): a
# stub's own reads must not be served from memory.
_stock_torch_load = torch.load


def _load(path: str, whole: bool):
    return _stock_torch_load(path, map_location="cpu", weights_only=False, pickle_module=_unpickler(whole))


def read_stub(path: str) -> dict:
    """A stub's info: ``tag_file``, ``job``, ``metadata``, from format 2 on ``world``, and
    from format 3 on ``version`` (:func:`version_of`); ``format``: :data:`STUB_FORMAT`, 1 where
    absent. ValueError if ``path`` is none."""
    try:
        info = _load(path, whole=True)
    except _NotAStub:
        raise ValueError(f"{path} is not an ftmem stub") from None
    # as trusted as the stub's own pickle, read the same way
    if info.get("format", 1) == 4:
        info["metadata"] = pickle.loads(info["metadata"])
    elif info.get("format", 1) >= 5:
        info["metadata"] = {name: pickle.loads(entry) for name, entry in info["metadata"].items()}
    return info


def is_stub(path: str) -> bool:
    try:
        _load(path, whole=False)
    except _IsStub:
        return True
    except Exception:  # a real checkpoint (_NotAStub), no torch archive, unreadable: no stub
        return False
    return False  # a torch archive that names no global
