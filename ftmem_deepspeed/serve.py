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
"""
from __future__ import annotations

import functools
import os

import torch

from ftmem.adapter import apply_map_location

from .checkpoint_engine import FtmemCheckpointEngine


def install_torch_load_hook() -> None:
    """Serve ``torch.load`` of a stub of a live engine's save dir from memory (idempotent)."""
    stock_load = torch.load
    if getattr(stock_load, "_ftmem", False):
        return

    @functools.wraps(stock_load)
    def load(f, map_location=None, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            engine = FtmemCheckpointEngine.serving(os.fspath(f))
            if engine is not None:
                return apply_map_location(engine.serve(os.fspath(f)), map_location)
        return stock_load(f, map_location, *args, **kwargs)

    load._ftmem = True
    torch.load = load
