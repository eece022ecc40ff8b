"""Checkpoint files that DeepSpeed reads by itself, served from memory.

Some DeepSpeed paths read checkpoint files with ``torch.load`` instead of asking the
checkpoint engine. The core one: at ZeRO-3, ``load_checkpoint(...,
load_optimizer_states=False)`` rebuilds the fp32 weights with zero_to_fp32's
``get_fp32_state_dict_from_zero_checkpoint``, which reads every rank's files. Where those
files are ftmem's stubs of the version a job restored from memory, that function runs
with every rank's files of the version gathered (a collective: every rank of the job
calls it, as ``load_checkpoint`` does), and a ``torch.load`` hook serves exactly those
stub paths while it runs. Every other read is torch's own: a stub read elsewhere raises
``FtmemStubFile`` (see :mod:`ftmem_deepspeed.stub`).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator

import torch

from .checkpoint_engine import apply_map_location

_served: dict[str, Any] = {}  # real path of a stub -> what its file held, while a reader runs


@contextlib.contextmanager
def serving(files: dict[str, Any]) -> Iterator[None]:
    """While the block runs, ``torch.load(path)`` of one of ``files`` (by path) returns
    what that file held, as ``torch.load`` of the real file would."""
    _served.update({os.path.realpath(path): state for path, state in files.items()})
    try:
        yield
    finally:
        _served.clear()


def install_torch_load_hook() -> None:
    """Route ``torch.load`` of a served path to :func:`serving`'s files (idempotent)."""
    stock_load = torch.load
    if getattr(stock_load, "_ftmem", False):
        return

    @functools.wraps(stock_load)
    def load(f, map_location=None, *args, **kwargs):
        if _served and isinstance(f, (str, os.PathLike)):
            state = _served.get(os.path.realpath(os.fspath(f)))
            if state is not None:
                return apply_map_location(state, map_location)
        return stock_load(f, map_location, *args, **kwargs)

    load._ftmem = True
    torch.load = load


def serve_from_memory(read: Callable, files_of_every_rank: Callable[[str, str], dict]) -> Callable:
    """``read`` (a zero_to_fp32 reader: ``read(checkpoint_dir, tag=None, ...)``) that, where
    ``files_of_every_rank(checkpoint_dir, tag)`` gives the files (None: not ftmem's to
    serve), runs with those served."""
    @functools.wraps(read)
    def served_read(checkpoint_dir, tag=None, *args, **kwargs):
        found = files_of_every_rank(checkpoint_dir, tag)
        if found is None:
            return read(checkpoint_dir, tag, *args, **kwargs)
        tag, files = found
        with serving(files):
            return read(checkpoint_dir, tag, *args, **kwargs)

    served_read._ftmem = True
    return served_read
