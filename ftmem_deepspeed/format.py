"""DeepSpeed's checkpoint layout on disk, for the persistent tier and ``ftmem export``.

A version written to disk is the checkpoint directory stock DeepSpeed would have
written for its tag: the files DeepSpeed handed the engine, ``latest`` and the recovery
scripts, so DeepSpeed loads it without ftmem installed and ``zero_to_fp32.py``
converts it. Each rank also writes its RNG states beside them (stock DeepSpeed ignores
those files), which a restart from disk needs to continue bitwise.
"""
from __future__ import annotations

import os
from typing import Any

import deepspeed
import torch

from ftmem.adapter import FrameworkFormat, save_atomically, write_atomically

# What DeepSpeed's own save copies beside ``latest`` (zero_to_torch.py from DeepSpeed 0.19 on).
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def rng_file(rank: int) -> str:
    return f"ftmem_rng_rank{rank:05d}.pt"


def _on_every_replica(file_name: str) -> bool:
    """Files every DP replica holds the same copy of — the model states of ZeRO 0-2
    (``mp_rank_XX_model_states.pt``) and pipeline layer files; ZeRO partitions
    (``zero_pp_rank_*``) are each replica's own."""
    return file_name.startswith(("mp_rank_", "layer_"))


class DeepSpeedFormat(FrameworkFormat):
    name = "deepspeed"

    def checkpoint_name(self, version: int, state: Any) -> str:
        return state["tag"]

    def write_rank(self, state: Any, directory: str, rank: int, first_replica: bool, wrote) -> None:
        files = {os.path.basename(key): sd for key, sd in state["files"].items()}
        files[rng_file(rank)] = state["rng"]
        for file_name, content in files.items():
            if _on_every_replica(file_name) and not first_replica:
                continue  # written once, by the first replica
            path = os.path.join(directory, file_name)
            save_atomically(content, path)
            wrote(path)

    def publish(self, root: str, name: str) -> None:
        """Point DeepSpeed at ``<root>/<name>``: ``latest``, and the recovery scripts beside it."""
        scripts = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
        for script in RECOVERY_SCRIPTS:  # where DeepSpeed puts those this release has
            if os.path.exists(os.path.join(scripts, script)):
                with open(os.path.join(scripts, script), "rb") as f:
                    write_atomically(os.path.join(root, script), f.read())
        write_atomically(os.path.join(root, "latest"), name.encode())

    def read_rng(self, directory: str, rank: int):
        """The RNG a flushed checkpoint holds for ``rank`` (stock DeepSpeed saves none)."""
        return torch.load(os.path.join(directory, rng_file(rank)), weights_only=False)
