"""Checkpoint files that DeepSpeed, or a user's script, reads by itself, served from memory.

Several DeepSpeed paths read checkpoint files with ``torch.load`` instead of asking the
checkpoint engine: ZeRO-3's ``load_checkpoint(..., load_optimizer_states=False)`` rebuilds
the fp32 weights with zero_to_fp32, which reads every rank's files; zero_to_fp32 called
in-process; scripts that load a model-states file by path. Where ftmem wrote those
files, they are stubs (:mod:`ftmem_deepspeed.stub`).

The mechanism is a ``torch.load`` hook, chosen over patching each reader because the
readers are many (DeepSpeed's own and users'), and all end in ``torch.load`` of a path.
It is narrow: it looks only at path arguments under the save dir of a live
:class:`~ftmem_deepspeed.FtmemCheckpointEngine` in this process, and of those only at
stubs; every other read is torch's own. A stub read there is served by that engine from
the version it names (:meth:`~ftmem_deepspeed.FtmemCheckpointEngine.serve`): a
collective, since the file may be another rank's, joined with a bounded wait. Where no
such engine runs (another process, a job that has not loaded yet), the stub's own pickle
raises ``FtmemStubFile``, which says what the file is and how to get real files.

A served file honours what the caller asked of ``torch.load``: ``map_location`` is
applied; under ``weights_only`` (torch's default) the served state is checked as torch
checks a file, by torch's own restricted unpickler, and refused with torch's reason where
the file would be; ``mmap=True`` asks that the tensors be read lazily from the file, and
served tensors are already in memory, with no file behind them to map.
"""
from __future__ import annotations

import functools
import os

import torch

from ftmem.adapter import apply_map_location, refuse_unless_weights_only

from .checkpoint_engine import FtmemCheckpointEngine


def _asks_weights_only(weights_only, pickle_module) -> bool:
    """Whether this torch.load call loads with ``weights_only``, as torch decides it: True
    by default (without a pickle module of the caller's), unless an environment variable
    forces it either way (the one forcing False only where the caller did not say)."""
    true = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in true:
        return True
    if weights_only is None:
        if os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in true:
            return False
        return pickle_module is None
    return bool(weights_only)


def install_torch_load_hook() -> None:
    """Serve ``torch.load`` of a stub of a live engine's save dir from memory (idempotent)."""
    stock_load = torch.load
    if getattr(stock_load, "_ftmem", False):
        return

    @functools.wraps(stock_load)
    def load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **pickle_load_args):
        if isinstance(f, (str, os.PathLike)):
            engine = FtmemCheckpointEngine.serving(os.fspath(f))
            if engine is not None:
                served = engine.serve(os.fspath(f))
                if _asks_weights_only(weights_only, pickle_module):
                    refuse_unless_weights_only(served, os.fspath(f))
                return apply_map_location(served, map_location)
        return stock_load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args)

    load._ftmem = True
    torch.load = load
