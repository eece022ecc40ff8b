"""Megatron-LM's ``--ckpt-format torch`` persistent checkpoints:

    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt          (PP = 1)
    <save>/iter_0000100/mp_rank_01_003/model_optim_rng.pt      (PP > 1: TP rank, PP rank)
    <save>/iter_0000100/mp_rank_01_003/distrib_optim.pt        (--use-distributed-optimizer)
    <save>/latest_checkpointed_iteration.txt

each ``model_optim_rng.pt`` holding Megatron-LM's keys: ``args``,
``checkpoint_version``, ``iteration``, ``model``, ``optimizer``,
``opt_param_scheduler``, ``rng_state`` (:func:`rng_state`) and
``num_floating_point_operations_so_far``. As in Megatron-LM only DP rank 0 of each
(TP, PP) position writes it; the DistributedOptimizer's sharded state is gathered to
DP rank 0 into ``distrib_optim.pt``.

This module holds the layout's names and contents, which the persistent tier writes
from memory (:mod:`ftmem_megatron.format`); the driver's own synchronous save and load
of the layout, Megatron-LM's stand-in, are in ``examples/megatron/torch_checkpoint.py``.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from ftmem.adapter import write_atomically

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # what the tracker holds for a release checkpoint (iteration 0)
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name() -> str:
    """``mp_rank_XX``, or ``mp_rank_XX_YYY`` with pipeline parallelism (Megatron-LM's get_checkpoint_name)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{parallel_state.get_pipeline_model_parallel_rank():03d}"


def checkpoint_name(root: str, iteration: int) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_dir_name(), MODEL_FILENAME)


def own_rng_state() -> dict:
    """This rank's RNG states in the form of one ``rng_state`` entry of a checkpoint."""
    from megatron.core import tensor_parallel

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def rng_state(args) -> list:
    """The ``rng_state`` entry as Megatron-LM writes it: with ``--data-parallel-random-init``
    every DP rank's states (gathered: a collective over DP), each rank loading its own;
    else this rank's alone, which every DP rank loads (their states are the same)."""
    from megatron.core import parallel_state

    if not getattr(args, "data_parallel_random_init", False):
        return [own_rng_state()]
    states = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(states, own_rng_state(), group=parallel_state.get_data_parallel_group())
    return states


def rng_index(args) -> int:
    """Which entry of ``rng_state`` (:func:`rng_state`) this rank loads."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank() if getattr(args, "data_parallel_random_init", False) else 0


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if not state["rng_tracker_states"]:
        raise KeyError("the checkpoint holds no model-parallel RNG tracker states")
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def model_state(model: list) -> dict:
    """The model entries of ``model_optim_rng.pt``: ``model``, or ``model0``, ``model1``, ...
    with virtual pipeline stages, as Megatron-LM's generate_state_dict."""
    return {name: chunk.state_dict_for_save_checkpoint() for name, chunk in zip(model_keys(len(model)), model)}


def model_keys(chunks: int) -> list[str]:
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def checkpoint_content(args, iteration: int, model_entries: dict, optimizer_state: dict, scheduler_state: dict,
                       rng_states: list, num_floating_point_operations_so_far: float) -> dict:
    """What one ``model_optim_rng.pt`` holds."""
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, **model_entries,
            "optimizer": optimizer_state, "opt_param_scheduler": scheduler_state, "rng_state": rng_states,
            "num_floating_point_operations_so_far": num_floating_point_operations_so_far}


def write_tracker(root: str, iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (atomically: the last step of a save)."""
    write_atomically(os.path.join(root, TRACKER_FILENAME), str(iteration).encode())


def read_tracker(root: str) -> int | str | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, ``RELEASE``, or None."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return RELEASE if text == RELEASE else int(text)
