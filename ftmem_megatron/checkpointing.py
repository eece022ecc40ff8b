"""Megatron's in-memory non-persistent checkpoints through ftmem.

``save_checkpoint`` and ``load_checkpoint`` take what Megatron-LM's functions of the
same names take; the patch in ``patches/``, the runtime installer
(:func:`ftmem_megatron.install`) and the driver (``examples/megatron/pretrain_gpt.py``) call them when
``--non-persistent-ckpt-type in_memory`` is set.

A version (= the iteration) holds the model chunks' and the optimizer's sharded state
(see :mod:`ftmem_megatron.sharded_state`), the LR scheduler, every RNG including
megatron-core's model-parallel tracker, the training progress and the args that must
match to resume. ``save_checkpoint`` returns once the snapshot is started; the copy
overlaps the next forward/backward, and the optimizer's step waits for it, since the
step overwrites what is being copied.

Megatron-LM calls module functions, so this module keeps one :class:`MegatronCheckpointer`
per process (started at the first save or load) and the functions delegate to it; the
policies it shares with the DeepSpeed adapter live in :class:`ftmem.adapter.AdapterRuntime`.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from megatron.core import parallel_state

from ftmem import ConfigError, LayoutMismatch, ParallelLayout, Restored, RestoreTimes, SaveHandle
from ftmem.adapter import (DISK, MEMORY, SCRATCH, Adopted, AdapterRuntime, DiskCheckpoint, OtherWorlds, Resumption,
                           DISTRIBUTED_OPTIMIZER, check_versions, gather_dp_groups, rank_info,
                           require_for, tensors, with_collection_deferred)

from .arguments import validate_ftmem_args
from .format import MegatronFormat, TorchFormat, flushes_from_memory
from .sharded_state import ReplicatedPaths, from_snapshot, local_tensors, pieces_by_key, to_snapshot
from .torch_checkpoint import RELEASE, read_tracker

try:
    from megatron.core.utils import unwrap_model
except ImportError:  # megatron-core < 0.14 left the helper to Megatron-LM (megatron.training.utils)
    def unwrap_model(model: list) -> list:
        """The model chunks without the wrappers megatron-core puts around them (its DDP and
        Float16Module), peeled as megatron-core's own helper does from 0.14 on."""
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.transformer.module import Float16Module

        chunks = []
        for chunk in model:
            while isinstance(chunk, (DistributedDataParallel, Float16Module)):
                chunk = chunk.module
            chunks.append(chunk)
        return chunks


# Args a resumed job must share with the one that saved (beyond the parallel layout,
# which the engine checks, and the tensors' places, which the templates check).
COMPATIBILITY_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                      "max_position_embeddings", "padded_vocab_size", "vocab_size", "micro_batch_size",
                      "global_batch_size", "use_distributed_optimizer")
# Of those, the ones that only shape the training progress.
PROGRESS_SHAPING_ARGS = ("micro_batch_size", "global_batch_size")
# Megatron-LM's training progress, kept in args; its data loaders start from it.
PROGRESS_ARGS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
# Settings under which parameters the snapshot copies are written before the next optimizer
# step (gathered in the next forward, the router's expert bias updated with the gradients):
# the whole copy must then finish before save returns. (Buffers are copied during the save
# call in any case.)
WRITES_BEFORE_STEP = ("overlap_param_gather", "moe_router_enable_expert_bias", "reuse_grad_buf_for_mxfp8_param_ag")
# The distributed optimizer's format that keeps each DP rank's own shard as it is, with
# no gathering across ranks (its default, fully_sharded_model_space, is refused by
# megatron-core's own ShardedTensor checks); other optimizers ignore it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass(frozen=True)
class LoadScope:
    """What a load puts back, as Megatron-LM's load_checkpoint decides it from its flags:
    ``--finetune`` takes the model alone and starts at iteration 0; ``--no-load-optim``
    leaves the optimizer and the LR scheduler as built; ``--no-load-rng`` the RNGs."""

    optimizer: bool
    rng: bool
    progress: bool  # the iteration and the consumed samples

    @classmethod
    def of(cls, args) -> "LoadScope":
        finetune = getattr(args, "finetune", False)
        return cls(optimizer=not (finetune or getattr(args, "no_load_optim", False)),
                   rng=not (finetune or getattr(args, "no_load_rng", False)), progress=not finetune)

    @property
    def detail(self) -> str:
        """The log line's note of what was left out (empty for a whole resume)."""
        skipped = [what for what, loaded in (("optimizer and scheduler", self.optimizer), ("RNG", self.rng),
                                             ("iteration", self.progress)) if not loaded]
        return f"without its {', '.join(skipped)}" if skipped else ""


def parallel_layout(args) -> ParallelLayout:
    """The job's parallel layout from megatron-core's parallel_state (collective)."""
    # Context-parallel ranks hold the same parameters too, so the replicas are the
    # DP x CP group; its size already counts CP.
    mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    return ParallelLayout(dp_groups=gather_dp_groups(mine),
                          tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                          pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
                          ep_size=parallel_state.get_expert_model_parallel_world_size(),
                          zero_stage=1 if getattr(args, "use_distributed_optimizer", False) else 0)


def _give_distributed_optimizer_a_state(optimizer) -> None:
    """A fresh DistributedOptimizer over torch's Adam (no Apex/TransformerEngine) cannot
    describe itself for loading: its state_dict reads the "step" that torch's Adam keeps
    per parameter, and a fresh Adam has none. megatron-core's own remedy (used for its
    fsdp_dtensor format) is a step with zero gradients; what it writes is overwritten by
    the load that follows."""
    for part in _distributed_parts(optimizer):
        if not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


def _distributed_parts(optimizer) -> list:
    """The DistributedOptimizers in ``optimizer`` (one, or those it chains)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(part, DistributedOptimizer)]


class _AllocatedNotZeroed(TorchFunctionMode):
    """``torch.zeros_like`` allocates without filling (``torch.empty_like``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return (torch.empty_like if func is torch.zeros_like else func)(*args, **(kwargs or {}))


def _give_optimizer_placeholders(optimizer) -> list:
    """The state megatron-core's ``init_state_fn`` gives an optimizer before a load (Adam's
    moments), allocated but not zero-filled; returns what it gave, as (state, parameter)
    pairs. Zero-filling fresh memory first was a pass as long as the copy itself (0.09 s
    of a 0.27 s restore of a 53M GPT at TP 2 on 2 cores): a restore copies over every byte
    of a placeholder, or the optimizer's ``load_state_dict`` replaces it with the restored
    tensor, and a load that takes nothing from memory drops them all
    (:meth:`MegatronCheckpointer.load`), so that no optimizer ever steps on them.
    Megatron's own call on loading then finds the state there and leaves it. The
    distributed optimizer is given its state by a step
    (:func:`_give_distributed_optimizer_a_state`), whose arithmetic reads it: not here."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    given = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        init_state_fn = getattr(part, "init_state_fn", None)
        if init_state_fn is None or isinstance(part, DistributedOptimizer):
            continue
        inner = part.optimizer
        stateless = [p for group in inner.param_groups for p in group["params"] if not inner.state[p]]
        with _AllocatedNotZeroed():
            init_state_fn(inner, part.config)
        given += [(inner.state, p) for p in stateless]
    return given


def _drop(placeholders: list) -> None:
    """Take the optimizer's placeholders back (:func:`_give_optimizer_placeholders`)."""
    for state, param in placeholders:
        state.pop(param, None)


_MODEL = "model"  # the sharded state's key of each model chunk, with its index: model0, model1, ...


def _sharded_state(model: list, optimizer, placeholders: Optional[list] = None) -> dict:
    """The model's and optimizer's sharded state dicts, to save; or, given ``placeholders``
    (a list), a load's template, the optimizer's placeholders added to the list."""
    chunks = unwrap_model(model)
    is_loading = placeholders is not None
    if is_loading and optimizer is not None:
        _give_distributed_optimizer_a_state(optimizer)
        placeholders.extend(_give_optimizer_placeholders(optimizer))
    state = {f"{_MODEL}{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    if optimizer is not None:
        # Only the distributed optimizer reads the metadata, and megatron-core before 0.13 takes
        # none (ftmem needs 0.15 with the distributed optimizer: MegatronCheckpointer checks).
        metadata = {"metadata": OPTIMIZER_METADATA} if _distributed_parts(optimizer) else {}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, **metadata)
    return state


def _args_mismatch(saved: dict, args, scope: LoadScope) -> Optional[str]:
    # A load that takes no progress (--finetune) may change the batch sizes, as Megatron-LM allows.
    diffs = [f"{name} {was} -> {getattr(args, name, None)}" for name, was in saved.items()
             if was != getattr(args, name, None) and (scope.progress or name not in PROGRESS_SHAPING_ARGS)]
    return (f"the snapshot was saved with other args: {'; '.join(diffs)}. Restart with the args it was saved with."
            if diffs else None)


def disk_iteration(load_dir: Optional[str]) -> int:
    """The iteration of Megatron's newest persistent checkpoint in ``load_dir``; -1 if none."""
    found = read_tracker(load_dir) if load_dir else None
    return -1 if found is None else 0 if found == RELEASE else found


def saved_iteration(save_dir: Optional[str]) -> Optional[int]:
    """The iteration of Megatron's newest persistent checkpoint in ``save_dir``; None if none."""
    found = disk_iteration(save_dir)
    return found if found >= 0 else None


class MegatronCheckpointer:
    """One rank's in-memory checkpoints for Megatron (collective construction)."""

    def __init__(self, args):
        check_versions("megatron-core")
        if getattr(args, "use_distributed_optimizer", False):
            require_for(DISTRIBUTED_OPTIMIZER, "megatron-core")
        persist_dir = args.save if flushes_from_memory(args) else None
        # Megatron-LM's loop ends without calling finish(args): at exit, the runtime asks the
        # save dir's tracker whether Megatron's own save holds the newest version.
        self.runtime = AdapterRuntime(validate_ftmem_args(args), parallel_layout(args), MegatronFormat(),
                                      save_dir=args.save, persist_dir=persist_dir,
                                      framework_on_disk=functools.partial(saved_iteration, args.save))
        self._described = False
        self._replicated_paths = ReplicatedPaths()
        self._torch_format = TorchFormat()
        self._last_resume: Optional[Resumption] = None  # the last load's, for the disk line after Megatron's own load

    def save(self, iteration: int, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
             args, persistent: bool) -> SaveHandle:
        if persistent and not flushes_from_memory(args):
            raise ConfigError("ftmem writes persistent checkpoints only with --ckpt-format torch and without "
                                 "the distributed optimizer; Megatron's own save_checkpoint writes the others.")
        self.runtime.make_step_wait(optimizer)
        model = model if isinstance(model, list) else [model]
        # megatron-core's sharded state dicts are tens of thousands of objects
        handle = with_collection_deferred(self._snapshot, iteration, model, optimizer, opt_param_scheduler,
                                          num_floating_point_operations_so_far, args, persistent)
        if any(getattr(args, name, False) for name in WRITES_BEFORE_STEP):
            self.runtime.wait_reusable()
        return handle

    def _snapshot(self, iteration: int, model: list, optimizer, opt_param_scheduler,
                  num_floating_point_operations_so_far, args, persistent: bool) -> SaveHandle:
        data, places, placed = to_snapshot(_sharded_state(model, optimizer))
        shared = [placed[path] for path in self._replicated_paths.of(places, self.runtime.dp_group)]
        replicated = {id(t) for t in shared}
        if not self._described:
            self._described = True
            self._describe(data, shared, len(self.runtime.dp_ranks))
        state = {
            "sharded": data,
            "places": places,
            "scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
            "iteration": iteration,
            "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
            "args": {name: getattr(args, name, None) for name in COMPATIBILITY_ARGS},
            "progress": {name: getattr(args, name) for name in PROGRESS_ARGS if hasattr(args, name)},
            # After "sharded": its tensors are the same ones, stored once, with the flags above.
            "torch_format": self._torch_format.view(unwrap_model(model), optimizer, args, persistent, {
                path: place for path, place in places.items() if path.startswith(_MODEL)}, placed),
        }
        # The next forward may write the modules' buffers in place before the step (the
        # router's token counts, normalization statistics): copied during this call. No
        # predicate where the model has none: the core would ask it of every tensor.
        buffers = {b.untyped_storage().data_ptr() for chunk in unwrap_model(model) for b in chunk.buffers()}
        return self.runtime.save(state, iteration, replicated=lambda t: id(t) in replicated, persist=persistent,
                                 written_in_forward=(lambda t: t.untyped_storage().data_ptr() in buffers)
                                 if buffers else None)

    def _describe(self, data, shared: list, replicas: int) -> None:
        """One line at the first save: what this rank snapshots and how much of it is
        identical on its DP replicas (kept once across them with DP sharding)."""
        def mib(held) -> float:
            return sum(t.numel() * t.element_size() for t in held) / 2**20

        rank_info(self.runtime.rank, "snapshots %.2f MiB of tensors per version, %.2f MiB of them identical on its "
                  "%d DP replica(s)", mib(tensors(data)), mib(shared), replicas)

    def load(self, model, optimizer, opt_param_scheduler, args) -> Optional[tuple[int, Any]]:
        """See :func:`load_checkpoint`. The restore runs in the runtime's phases; Megatron's
        code (the load's template, the loads into model and optimizer) runs between them."""
        model = model if isinstance(model, list) else [model]
        scope = LoadScope.of(args)
        # An optimizer left as built is not asked for its state: building a load's template
        # gives it (empty) state.
        kept_optimizer, optimizer = optimizer, (optimizer if scope.optimizer else None)
        step = getattr(args, "ckpt_step", None)
        on_disk = disk_iteration(args.load) if step is None else step
        plan = self.runtime.plan_resume(DiskCheckpoint(on_disk, args.load) if on_disk >= 0 else None,
                                        OtherWorlds(refuse=self._cannot_load, loads=self._loads), named=step)
        template, placeholders, problem = None, [], None
        if plan.source == MEMORY:
            if plan.adopted is not None:
                plan = dataclasses.replace(plan, restored=self._taken_from(plan.adopted))
            saved = plan.saved if plan.restored is None else plan.restored.state
            # The load's template only for a version this load will take (its args fit): building
            # it gives the optimizer its state, and the restore copies into its tensors.
            problem = _args_mismatch(saved["args"], args, scope)
            if problem is None:
                template = _sharded_state(model, optimizer, placeholders)
            into = None
            if template is not None and plan.chosen is not None:  # another world's version is copied already
                into = {"sharded": local_tensors(template, saved["places"])}
            plan = self.runtime.restore(plan, into=into, problem=problem)
        if plan.source == MEMORY:
            state = plan.restored.state
            try:
                filled = from_snapshot(template, state["sharded"], state["places"], self._split_pieces(plan.adopted))
            except LayoutMismatch as e:
                problem = str(e)
            plan = self.runtime.resumed(plan, problem, detail=scope.detail, rng=state["rng"] if scope.rng else None)
        self._last_resume = plan
        if plan.source != MEMORY:
            _drop(placeholders)
            return None
        # no_grad: with fp32 parameters the DistributedOptimizer's main params are views of
        # the model's leaf parameters, which its load copies into.
        with torch.no_grad():
            for i, chunk in enumerate(unwrap_model(model)):
                chunk.load_state_dict(filled[f"{_MODEL}{i}"], strict=True)
            if optimizer is not None:
                optimizer.load_state_dict(filled["optimizer"])
            elif kept_optimizer is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
                # As Megatron-LM: main params of a mixed-precision optimizer left as built
                # would overwrite the loaded weights at the first step.
                kept_optimizer.reload_model_params()
        if opt_param_scheduler is not None and scope.optimizer:
            opt_param_scheduler.load_state_dict(state["scheduler"])
        if scope.progress:
            for name, value in state["progress"].items():
                setattr(args, name, value)
        return (state["iteration"] if scope.progress else 0), state["num_floating_point_operations_so_far"]

    def _cannot_load(self, saved: ParallelLayout) -> Optional[str]:
        """Why this job cannot load a version that another world saved under ``saved`` (None
        if it can). Each rank takes the state of the first DP replica of its place (the same
        TP, PP, CP and EP ranks), as Megatron-LM's torch-format load takes that replica's file,
        and joins what the distributed optimizer splits from its place's old DP group
        (:meth:`_split_pieces`): that holds all the rank needs only where the DP size alone
        changed."""
        now = self.runtime.layout
        changed = [f"{name} {getattr(saved, name)} -> {getattr(now, name)}"
                   for name in ("tp_size", "pp_size", "cp_size", "ep_size")
                   if getattr(saved, name) != getattr(now, name)]
        if changed:
            return (f"it resumes Megatron from another world's memory only where the DP size alone changed "
                    f"({'; '.join(changed)}): the model's tensors would have to be split otherwise, which is not "
                    f"built")
        if saved.ep_size > 1:
            return ("it resumes Megatron from another world's memory only without expert parallelism: the DP replicas "
                    "of a place then hold other experts, and taking or joining theirs is not built")
        if saved.zero_stage != now.zero_stage:
            return (f"the version was saved {'with' if saved.zero_stage else 'without'} the distributed optimizer, "
                    f"and this job runs {'with' if now.zero_stage else 'without'} it")
        return None

    def _old_dp_group(self, saved: ParallelLayout) -> tuple:
        """The old ranks of this rank's place (its old DP group) in a version saved under
        ``saved``. Both worlds order their DP groups alike (by their lowest rank: by PP, then
        TP rank), and only the DP size changed (:meth:`_cannot_load`)."""
        now = sorted(tuple(sorted(g)) for g in self.runtime.layout.dp_groups)
        then = sorted(tuple(sorted(g)) for g in saved.dp_groups)
        return then[now.index(tuple(sorted(self.runtime.dp_ranks)))]

    def _loads(self, saved: ParallelLayout) -> list[int]:
        """The old ranks whose state this rank takes from a version saved under ``saved``: the
        first DP replica of its place; with the distributed optimizer, which splits its state
        across the replicas, every one of them."""
        group = self._old_dp_group(saved)
        return list(group) if saved.zero_stage else [group[0]]

    def _taken_from(self, adopted: Adopted) -> Restored:
        """This rank's part of another world's version: its first DP replica's (:meth:`_loads`)."""
        return Restored(version=adopted.version, state=adopted.states[self._old_dp_group(adopted.layout)[0]])

    def _split_pieces(self, adopted: Optional[Adopted]):
        """For another world's version saved with the distributed optimizer: its pieces of
        the tensors split across this rank's old DP group (:func:`pieces_by_key`), from which
        a load after a DP change joins this rank's ranges. None otherwise."""
        if adopted is None or not adopted.layout.zero_stage:
            return None
        states = [adopted.states[r] for r in self._old_dp_group(adopted.layout)]
        return pieces_by_key([(state["sharded"], state["places"]) for state in states])

    def finish(self, args) -> None:
        self.runtime.finish(on_disk=saved_iteration(args.save))

    def report_disk_load(self, iteration: int, args) -> None:
        """After Megatron's own load from ``--load``, where memory did not serve: say so, or
        refuse a fresh start in place of what memory held."""
        plan = self._last_resume
        if plan is None or plan.reason is None:
            return
        # Iteration 0 may be a load too (--finetune); a tracker may be missing (--ckpt-step).
        if iteration > 0 or disk_iteration(args.load) >= 0:
            self.runtime.resumed(dataclasses.replace(plan, source=DISK, disk=DiskCheckpoint(iteration, args.load)))
        elif getattr(args, "pretrained_checkpoint", None):  # Megatron-LM loaded it, with --finetune
            self.runtime.resumed(dataclasses.replace(plan, source=SCRATCH), disk_found=(
                f"the only checkpoint on disk is --pretrained-checkpoint {args.pretrained_checkpoint}, which starts "
                f"training over"))
        else:
            self.runtime.resumed(dataclasses.replace(plan, source=SCRATCH))


_checkpointer: Optional[MegatronCheckpointer] = None


def _for(args) -> MegatronCheckpointer:
    """This process's checkpointer, started at the first save or load (collective)."""
    global _checkpointer
    if _checkpointer is None:
        _checkpointer = MegatronCheckpointer(args)
    return _checkpointer


# -- what Megatron-LM (patched or with the installer) and the driver call ---------------
def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    args, persistent: bool = False, **_megatron_extras) -> SaveHandle:
    """Start the snapshot of ``iteration`` (collective: every rank, same iteration);
    returns its handle (Megatron-LM ignores it). ``persistent``: Megatron's persistent
    save, which the snapshot's flush writes to ``args.save`` in the background (only
    where :func:`flushes_from_memory`)."""
    return _for(args).save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, args,
                    persistent)


def load_checkpoint(model, optimizer, opt_param_scheduler, args, **_megatron_extras) -> Optional[tuple[int, Any]]:
    """Restore the newest version memory can recover for every rank, if it is newer
    than the persistent checkpoint in ``args.load`` (``--ckpt-step``'s version, where
    given), as far as Megatron-LM's load flags allow (:class:`LoadScope`); returns
    ``(iteration, num_floating_point_operations_so_far)``, or None to let Megatron load
    from disk (collective)."""
    return _for(args).load(model, optimizer, opt_param_scheduler, args)


def report_disk_load(iteration: int, args) -> None:
    """After Megatron loaded ``iteration`` from ``--load`` because memory could not serve:
    the log line every ftmem adapter writes on a fallback to disk."""
    if _checkpointer is not None:
        _checkpointer.report_disk_load(iteration, args)


def last_restore() -> Optional[RestoreTimes]:
    """Where this process's last load from memory spent its time (None before one)."""
    return _checkpointer.runtime.last_restore if _checkpointer is not None else None


def last_save() -> Optional[SaveHandle]:
    """The handle of this process's last in-memory save (None before its first)."""
    return _checkpointer.runtime.last_save if _checkpointer is not None else None


def wait_protected() -> None:
    """Until every snapshot so far is committed and protected on every rank."""
    if _checkpointer is not None:
        _checkpointer.runtime.wait_protected()


def wait_flushed() -> None:
    """Until every snapshot so far is protected and the persistent checkpoint being
    written from memory, if any, is on disk. Before the process groups go away: the
    flush agrees on its result over one."""
    if _checkpointer is not None:
        _checkpointer.runtime.wait_flushed()


def last_flush():
    """This rank's part of the last persistent checkpoint written from memory (bytes, seconds, of them syncing)."""
    return _checkpointer.runtime.last_flush if _checkpointer is not None else None


def finish(args) -> None:
    """The training ended on this rank (collective, before the process groups go): free
    the job's memory if its newest version is on disk (``args.save``), else keep it for a
    restart and say so."""
    global _checkpointer
    checkpointer, _checkpointer = _checkpointer, None
    if checkpointer is not None:
        checkpointer.finish(args)


def close(job_finished: bool) -> None:
    """Close this rank's engine now (every rank should). With ``job_finished`` the job's
    snapshots are freed once all ranks have closed; without, they stay for a restart, as
    after a crash. The next save or load starts a new one."""
    global _checkpointer
    checkpointer, _checkpointer = _checkpointer, None
    if checkpointer is not None:
        checkpointer.runtime.close(job_finished=job_finished)
