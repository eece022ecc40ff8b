"""DeepSpeed's layout for the persistent tier (``"ftmem": {"persist": {...}}``): a flushed
version is the checkpoint directory stock DeepSpeed would have written for its tag —
the files DeepSpeed handed the engine, ``latest`` and the recovery scripts — so
DeepSpeed loads it without ftmem installed and ``zero_to_fp32.py`` converts it. Each
rank also writes its RNG states beside them (stock DeepSpeed ignores those files),
which a restart from disk needs to continue bitwise.

``ftmem export`` writes the same layout from shared memory (:func:`export_dp_group`);
a snapshot names this module for it.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Sequence

import deepspeed

from ftmem.persist import save_atomically
from ftmem.slots import write_atomically

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def rng_file(rank: int) -> str:
    return f"ftmem_rng_rank{rank:05d}.pt"


def _on_every_replica(file_name: str) -> bool:
    """Files every DP replica holds the same copy of — the model states of ZeRO 0-2
    (``mp_rank_XX_model_states.pt``) and pipeline layer files; ZeRO partitions
    (``zero_pp_rank_*``) are each replica's own."""
    return file_name.startswith(("mp_rank_", "layer_"))


class DeepSpeedFlushTarget:
    def __init__(self, rank: int, first_replica: bool):
        self.rank, self.first_replica = rank, first_replica

    def name(self, version: int, state: Any) -> str:
        return state["tag"]

    def write(self, state: Any, directory: str, wrote: Callable[[int], None]) -> None:
        files = {os.path.basename(key): sd for key, sd in state["files"].items()}
        files[rng_file(self.rank)] = state["rng"]
        for file_name, content in files.items():
            if _on_every_replica(file_name) and not self.first_replica:
                continue  # written once, by the first replica
            path = os.path.join(directory, file_name)
            save_atomically(content, path)
            wrote(os.path.getsize(path))

    def publish(self, root: str, name: str) -> None:
        publish(root, name)


def publish(root: str, name: str) -> None:
    """Point DeepSpeed at ``<root>/<name>``: ``latest``, and the recovery scripts beside it."""
    scripts = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
    for script in RECOVERY_SCRIPTS:
        shutil.copyfile(os.path.join(scripts, script), os.path.join(root, script))  # where DeepSpeed puts them
    write_atomically(os.path.join(root, "latest"), name.encode())


def export_dp_group(group: Sequence[int], read_state: Callable[[int], Any], directory: str,
                    wrote: Callable[[int], None]) -> str:
    """``ftmem export``: write the files of one DP group's ranks (``read_state(rank)``
    gives a rank's snapshot) into ``directory``; returns the checkpoint's name (the tag)."""
    for index, rank in enumerate(group):
        state = read_state(rank)
        DeepSpeedFlushTarget(rank, first_replica=index == 0).write(state, directory, wrote)
    return state["tag"]
