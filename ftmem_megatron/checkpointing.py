"""Megatron's in-memory non-persistent checkpoints through ftmem.

``save_checkpoint`` and ``load_checkpoint`` take what Megatron-LM's functions of the
same names take; the patch in ``patches/``, the runtime installer
(:func:`ftmem_megatron.install`) and :mod:`ftmem_megatron.pretrain_gpt` call them when
``--non-persistent-ckpt-type in_memory`` is set.

A version (= the iteration) holds the model chunks' and the optimizer's sharded state
(see :mod:`ftmem_megatron.sharded_state`), the LR scheduler, every RNG including
megatron-core's model-parallel tracker, the training progress and the args that must
match to resume. ``save_checkpoint`` returns once the snapshot is started; the copy
overlaps the next forward/backward, and the optimizer's step waits for it, since the
step overwrites what is being copied (see :func:`_step_waits_for_copy`).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from ftmem import ParallelLayout, SnapshotEngine
from ftmem.errors import LayoutMismatch, NotRecoverableFromMemory
from ftmem.export import EXPORT_WITH
from ftmem.lifecycle import close_at_exit
from ftmem.parallel import gather_dp_groups

from .arguments import validate_ftmem_args
from .persist import MegatronFlushTarget, flushes_from_memory, torch_format
from .sharded_state import from_snapshot, replicated_paths, tensors_at, to_snapshot
from .torch_checkpoint import RELEASE, own_rng_state, read_tracker, set_rng_state

# Args a resumed job must share with the one that saved (beyond the parallel layout,
# which the engine checks, and the tensors' places, which the templates check).
COMPATIBILITY_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                      "max_position_embeddings", "padded_vocab_size", "vocab_size", "micro_batch_size",
                      "global_batch_size", "use_distributed_optimizer")
# Megatron-LM's training progress, kept in args; its data loaders start from it.
PROGRESS_ARGS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
# Settings under which something the snapshot copies is written before the next
# optimizer step (parameters gathered in the next forward, the router's expert bias
# updated with the gradients): the copy must then finish before save returns.
WRITES_BEFORE_STEP = ("overlap_param_gather", "moe_router_enable_expert_bias", "reuse_grad_buf_for_mxfp8_param_ag")

_snapshots: Optional[SnapshotEngine] = None
_handle = None
_memory_failed: Optional[str] = None  # why memory could not serve the last load, for the disk load's log line


def _layout(args) -> ParallelLayout:
    """The job's parallel layout from megatron-core's parallel_state (collective)."""
    # Context-parallel ranks hold the same parameters too, so the replicas are the
    # DP x CP group; its size already counts CP.
    mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    return ParallelLayout(dp_groups=gather_dp_groups(mine),
                          tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                          pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
                          ep_size=parallel_state.get_expert_model_parallel_world_size(),
                          zero_stage=1 if getattr(args, "use_distributed_optimizer", False) else 0)


def _engine(args) -> SnapshotEngine:
    """The rank's engine, started at the first save or load (collective)."""
    global _snapshots
    if _snapshots is None:
        _snapshots = SnapshotEngine(validate_ftmem_args(args), layout=_layout(args))
        close_at_exit(_snapshots)
        if flushes_from_memory(args):
            writer = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
            _snapshots.persist_with(MegatronFlushTarget(first_replica=writer), args.save)
    return _snapshots


# The distributed optimizer's format that keeps each DP rank's own shard as it is, with
# no gathering across ranks (its default, fully_sharded_model_space, is refused by
# megatron-core's own ShardedTensor checks); other optimizers ignore it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _give_distributed_optimizer_a_state(optimizer) -> None:
    """A fresh DistributedOptimizer over torch's Adam (no Apex/TransformerEngine) cannot
    describe itself for loading: its state_dict reads the "step" that torch's Adam keeps
    per parameter, and a fresh Adam has none. megatron-core's own remedy (used for its
    fsdp_dtensor format) is a step with zero gradients; what it writes is overwritten by
    the load that follows."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer) and not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


def _sharded_state(model: list, optimizer, is_loading: bool) -> dict:
    chunks = unwrap_model(model)
    if is_loading and optimizer is not None:
        _give_distributed_optimizer_a_state(optimizer)
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    args, persistent: bool = False, **_megatron_extras) -> None:
    """Start the snapshot of ``iteration`` (collective: every rank, same iteration).
    ``persistent``: Megatron's persistent save, which the snapshot's flush writes to
    ``args.save`` in the background (only where :func:`flushes_from_memory`)."""
    global _handle
    if persistent and not flushes_from_memory(args):
        raise ValueError("ftmem writes persistent checkpoints only with --ckpt-format torch and without the "
                         "distributed optimizer; Megatron's own save_checkpoint writes the others.")
    snapshots = _engine(args)
    _step_waits_for_copy(optimizer)
    model = model if isinstance(model, list) else [model]
    data, places = to_snapshot(_sharded_state(model, optimizer, is_loading=False))
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    shared = tensors_at(data, replicated_paths(places, dp_group))
    replicated = {id(t) for t in shared}
    if _handle is None:
        _describe(data, shared, dist.get_world_size(dp_group))
    state = {
        "sharded": data,
        "places": places,
        "scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        "rng": own_rng_state(),
        "iteration": iteration,
        "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
        "args": {name: getattr(args, name, None) for name in COMPATIBILITY_ARGS},
        "progress": {name: getattr(args, name) for name in PROGRESS_ARGS if hasattr(args, name)},
        # After "sharded": its tensors are the same ones, stored once, with the flags above.
        "torch_format": torch_format(unwrap_model(model), optimizer, args, persistent),
        EXPORT_WITH: MegatronFlushTarget.__module__,
    }
    _handle = snapshots.save(state, iteration, replicated=lambda t: id(t) in replicated, persist=persistent)
    if any(getattr(args, name, False) for name in WRITES_BEFORE_STEP):
        _handle.wait_reusable()


def _describe(data, shared: list, replicas: int) -> None:
    """One line at the first save: what this rank snapshots and how much of it is
    identical on its DP replicas (kept once across them with DP sharding)."""
    def mib(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    print(f"ftmem: rank {dist.get_rank()} snapshots {mib(tensors_at(data, None)):.2f} MiB of tensors per version, "
          f"{mib(shared):.2f} MiB of them identical on its {replicas} DP replica(s)", flush=True)


def _step_waits_for_copy(optimizer) -> None:
    """Make ``optimizer.step`` wait for the last snapshot's copy first. Wrapping the
    step of the instance Megatron drives covers every caller alike — Megatron-LM's
    train_step (patched or with the runtime installer) and the driver — with no hook
    in the training loop to forget."""
    if optimizer is None or getattr(optimizer.step, "_ftmem_waits", False):
        return
    stock_step = optimizer.step

    @functools.wraps(stock_step)
    def step(*args, **kwargs):
        wait_before_optimizer_step()
        return stock_step(*args, **kwargs)

    step._ftmem_waits = True
    optimizer.step = step


def wait_before_optimizer_step() -> None:
    """The last snapshot's copy is done: the optimizer may write the state again."""
    if _handle is not None:
        _handle.wait_reusable()


def wait_protected() -> None:
    """Until the last snapshot is committed and protected on every rank."""
    if _handle is not None:
        _handle.wait_committed()


def wait_flushed() -> None:
    """Until the last snapshot is protected and the persistent checkpoint being written
    from memory, if any, is on disk. Before the process groups go away: the flush agrees
    on its result over one."""
    if _snapshots is not None:
        _snapshots.wait_flushed()


def last_flush() -> Optional[tuple[int, float]]:
    """(bytes this rank wrote, seconds) of the last persistent checkpoint written from memory."""
    return _snapshots.last_flush if _snapshots is not None else None


def close(job_finished: bool) -> None:
    """Close this rank's engine now (collective in effect: every rank should). With
    ``job_finished`` the job's snapshots are freed once all ranks have closed; without,
    they stay for a restart, as after a crash. The next save or load starts a new
    engine."""
    global _snapshots, _handle
    snapshots, _snapshots, _handle = _snapshots, None, None
    if snapshots is not None:
        snapshots.close(job_finished=job_finished)


def disk_iteration(load_dir: Optional[str]) -> int:
    """The iteration of Megatron's newest persistent checkpoint in ``load_dir``; -1 if none."""
    found = read_tracker(load_dir) if load_dir else None
    return -1 if found is None else 0 if found == RELEASE else found


def _agree(problem: Optional[str]) -> Optional[str]:
    """Every rank's verdict on its own part; the first problem any rank has, if any.
    All ranks must take the same path (memory or disk), or the next collective hangs."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p is not None), None)


def _args_mismatch(saved: dict, args) -> Optional[str]:
    diffs = [f"{name} {was} -> {getattr(args, name, None)}" for name, was in saved.items()
             if was != getattr(args, name, None)]
    return f"the snapshot was saved with other args: {'; '.join(diffs)}." if diffs else None


def load_checkpoint(model, optimizer, opt_param_scheduler, args, **_megatron_extras) -> Optional[tuple[int, Any]]:
    """Restore the newest version memory can recover for every rank, if it is newer
    than the persistent checkpoint in ``args.load``; returns ``(iteration,
    num_floating_point_operations_so_far)``, or None to let Megatron load from disk
    (collective)."""
    global _memory_failed
    snapshots = _engine(args)
    on_disk = disk_iteration(args.load)
    _memory_failed = None
    try:
        restored = snapshots.restore()
    except LayoutMismatch as e:
        return _fall_back(args, str(e), on_disk)
    except NotRecoverableFromMemory as e:
        _memory_failed = str(e)
        print(f"ftmem: memory cannot serve this restart ({e}); loading the persistent checkpoint from {args.load}",
              flush=True)
        return None
    # The same iteration in memory and on disk (a flushed version): memory is faster.
    if restored is None or restored.version < on_disk:
        if on_disk >= 0:
            _memory_failed = ("memory holds no version of this job" if restored is None else
                              f"memory's newest version {restored.version} is older than iteration {on_disk} on disk")
        return None
    state = restored.state
    model = model if isinstance(model, list) else [model]
    try:
        problem = _args_mismatch(state["args"], args)
        if problem is None:
            filled = from_snapshot(_sharded_state(model, optimizer, is_loading=True), state["sharded"],
                                   state["places"])
    except LayoutMismatch as e:
        problem = str(e)
    problem = _agree(problem)
    if problem is not None:
        return _fall_back(args, problem, on_disk)

    # no_grad: with fp32 parameters the DistributedOptimizer's main params are views of
    # the model's leaf parameters, which its load copies into.
    with torch.no_grad():
        for i, chunk in enumerate(unwrap_model(model)):
            chunk.load_state_dict(filled[f"model{i}"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(filled["optimizer"])
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    for name, value in state["progress"].items():
        setattr(args, name, value)
    how = ", rebuilt from parity" if restored.rebuilt else ""
    print(f"ftmem: restored iteration {restored.version} from memory (rank {dist.get_rank()}{how})", flush=True)
    return state["iteration"], state["num_floating_point_operations_so_far"]


def report_disk_load(iteration: int, args) -> None:
    """After Megatron loaded ``iteration`` from ``--load`` because memory could not serve:
    the log line every ftmem adapter writes on a fallback to disk."""
    if _memory_failed is None:
        return
    if iteration > 0:
        print(f"ftmem: restored iteration {iteration} from disk {args.load} (rank {dist.get_rank()}; memory could not "
              f"serve: {_memory_failed})", flush=True)
    else:
        print(f"ftmem: memory could not serve ({_memory_failed}) and {args.load} holds no checkpoint: rank "
              f"{dist.get_rank()} starts from scratch", flush=True)


def _fall_back(args, problem: str, on_disk: int) -> None:
    global _memory_failed
    _memory_failed = problem
    if not args.ftmem_allow_disk_fallback:
        raise LayoutMismatch(f"ftmem: {problem} Restart with the layout and model the job was saved with, or pass "
                             f"--ftmem-allow-disk-fallback to load the persistent checkpoint from --load "
                             f"({args.load}, iteration {on_disk if on_disk >= 0 else 'none'}) instead.")
    print(f"ftmem: memory holds no version this job can use ({problem}); loading the persistent checkpoint from "
          f"{args.load} as --ftmem-allow-disk-fallback allows", flush=True)
    return None
