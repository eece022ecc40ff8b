"""The driver's own ``--ckpt-format torch`` save and load, as Megatron-LM does them without
ftmem (the layout and its contents are :mod:`ftmem_megatron.torch_checkpoint`'s): what an
uninterrupted reference run writes, and what a job loads when memory cannot serve.

Writes are atomic: every rank writes under ``iter_XXXXXXX.tmp``, which global rank 0
renames to ``iter_XXXXXXX`` once all are done, and ``latest_checkpointed_iteration.txt``
is replaced last — a crash at any point leaves the previous checkpoint loadable. The
messages are Megatron-LM's.
"""
from __future__ import annotations

import os
import shutil

import torch

from ftmem.adapter import save_atomically
from ftmem_megatron.checkpointing import LoadScope
from ftmem_megatron.torch_checkpoint import (DISTRIB_OPTIM_FILENAME, MODEL_FILENAME, RELEASE, checkpoint_content,
                                             checkpoint_name, iteration_dir, model_keys, model_state, rank_dir_name,
                                             read_tracker, rng_index, rng_state, set_rng_state, write_tracker)


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    args) -> None:
    """Write the checkpoint of ``iteration`` under ``args.save`` (collective: every rank calls it)."""
    from megatron.core import parallel_state

    final_dir, staging_dir = iteration_dir(args.save, iteration), iteration_dir(args.save, iteration) + ".tmp"
    if args.rank == 0:
        shutil.rmtree(staging_dir, ignore_errors=True)  # a save that a crash interrupted
        os.makedirs(staging_dir)
    torch.distributed.barrier()

    rng_states = rng_state(args)  # with --data-parallel-random-init: a collective over DP
    is_writer = parallel_state.get_data_parallel_rank() == 0
    rank_dir = os.path.join(staging_dir, rank_dir_name())
    if args.use_distributed_optimizer:  # collective over DP; DP rank 0 writes
        if is_writer:
            os.makedirs(rank_dir, exist_ok=True)
        optimizer.save_parameter_state(os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME))
    if is_writer:
        state_dict = checkpoint_content(args, iteration, model_state(model), optimizer.state_dict(),
                                        opt_param_scheduler.state_dict(), rng_states,
                                        num_floating_point_operations_so_far)
        os.makedirs(rank_dir, exist_ok=True)
        save_atomically(state_dict, os.path.join(rank_dir, MODEL_FILENAME))
    torch.distributed.barrier()

    if args.rank == 0:
        if os.path.exists(final_dir):  # saved before (a resumed run passing the same iteration)
            shutil.rmtree(final_dir)
        os.rename(staging_dir, final_dir)
        write_tracker(args.save, iteration)
        print(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
              f"[ t {parallel_state.get_tensor_model_parallel_world_size()}, "
              f"p {parallel_state.get_pipeline_model_parallel_world_size()} ]", flush=True)
    torch.distributed.barrier()


def load_checkpoint(model, optimizer, opt_param_scheduler, args) -> tuple[int, float]:
    """Load the latest checkpoint under ``args.load`` (``--ckpt-step``'s iteration, where
    given) into model, optimizer, scheduler and RNGs, as far as ``--finetune``,
    ``--no-load-optim`` and ``--no-load-rng`` allow (:class:`LoadScope`); returns
    (iteration, num_floating_point_operations_so_far), (0, 0.0) when there is none.
    Collective: every rank calls it."""
    scope = LoadScope.of(args)
    iteration = read_tracker(args.load) if args.ckpt_step is None else args.ckpt_step
    if iteration == RELEASE:
        raise NotImplementedError("release checkpoints are not supported")
    mine = -1 if iteration is None else iteration
    # On the job's default group: NCCL on GPUs takes only CUDA tensors.
    seen = torch.tensor([mine], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
    if mine != seen.item():
        raise RuntimeError(f"ranks read different latest iterations from {args.load} "
                           f"({iteration} here, {seen.item()} elsewhere)")
    if iteration is None:
        if args.rank == 0:
            print(f"no checkpoint in {args.load}; training from scratch", flush=True)
        return 0, 0.0

    path = checkpoint_name(args.load, iteration)
    state_dict = torch.load(path, map_location="cpu", weights_only=False)
    for name, chunk in zip(model_keys(len(model)), model):
        chunk.load_state_dict(state_dict[name], strict=True)
    if scope.optimizer:
        optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer:  # collective over DP
            # no_grad: with fp32 parameters the DistributedOptimizer's main params are views
            # of the model's (leaf, requires-grad) params, which it copy_()s into.
            with torch.no_grad():
                optimizer.load_parameter_state(os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILENAME))
        opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    if scope.rng:
        set_rng_state(state_dict["rng_state"][rng_index(args)])
    torch.distributed.barrier()
    if args.rank == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration}", flush=True)
    return (state_dict["iteration"] if scope.progress else 0), state_dict["num_floating_point_operations_so_far"]
