"""ftmem as a DeepSpeed checkpoint engine.

DeepSpeed's ``save_checkpoint`` hands its engine one state dict per file (model
states, ZeRO optimizer partitions, pipeline layer files) between ``create`` and
``commit``. This engine collects them, together with the rank's RNG states (which
DeepSpeed does not save), and at ``commit`` starts one ftmem snapshot of them all as
version = the engine's global step; the copy runs in the background. The tensors are
live (views of DeepSpeed's flat buffers), so the next optimizer step waits for the
copy first (see :func:`ftmem_deepspeed.install`). On disk only small stub files are
written, so ``load_checkpoint``'s ``latest``/glob/exists checks keep working; its
``load`` calls are then served from the restored snapshot. A stub also carries its
file's tensor-free top-level entries (``mp_world_size``, ``global_steps``, ...):
DeepSpeed reads those from files that other ranks hold (the pipeline engine checks
the first stage's model-states file on every stage), never their tensors. What the next
forward may write before the step (the module's buffers, the client state) is copied during
the save call, the rest in the background (:func:`_weights_and_written_in_forward`).
"""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ftmem import FtmemConfig, FtmemError, ParallelLayout
from ftmem.adapter import (AdapterRuntime, RestoreTargets, Written, apply_map_location, check_startup,
                           gather_dp_groups, job_info, save_atomically, tensors)

from .format import DeepSpeedFormat
from .loads import DeepSpeedLoads, file_key
from .stub import EntryPickles, is_stub, write_stub

# DeepSpeed's own types in the state it hands a checkpoint engine. ftmem loads a snapshot's
# skeleton only with admitted types (the list torch.load(weights_only=True) uses); these
# hold plain fields and are rebuilt without running DeepSpeed code.
torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])


def parallel_layout(zero_stage: int) -> ParallelLayout:
    """The job's DP groups as DeepSpeed formed them (sequence-DP included); collective."""
    from deepspeed.utils import groups

    world = dist.get_world_size()
    dp_group = groups._get_sequence_data_parallel_group()
    mine = dist.get_process_group_ranks(dp_group) if dp_group is not None else range(world)
    model_parallel = world // len(mine)
    return ParallelLayout(dp_groups=gather_dp_groups(mine), tp_size=1, pp_size=model_parallel, zero_stage=zero_stage)


class FtmemCheckpointEngine(CheckpointEngine):
    """Selected by ``"checkpoint": {"engine": "ftmem"}``; configured by the ``"ftmem"`` section."""

    # Engines of this process, newest last, for reads of their files by path (serve.py).
    _live: "weakref.WeakValueDictionary[int, FtmemCheckpointEngine]" = weakref.WeakValueDictionary()
    _created = itertools.count()

    def __init__(self, config_params=None, zero_stage: int = 0):
        super().__init__(config_params)
        self.name = "ftmem"
        section = (getattr(config_params, "_param_dict", None) or {}).get("ftmem")
        self.config = FtmemConfig.from_dict(section)
        self.zero_stage = zero_stage
        # DeepSpeedConfig's own flag for "checkpoint": {"load_universal": true} (no config: none)
        self._universal = bool(getattr(config_params, "load_universal_checkpoint", False))
        self.format = DeepSpeedFormat()
        self._layout = parallel_layout(zero_stage)
        # Checked now, at deepspeed.initialize; the runtime itself starts at the first save
        # or load, when the save dir (the job's origin) is known.
        check_startup(self.config, dist.get_rank(), dist.get_world_size())
        self.runtime: Optional[AdapterRuntime] = None
        self._files: dict[str, Any] = {}
        self._metadata: dict[str, dict] = {}  # per file, its tensor-free entries (what its stub carries)
        self._replicated: set[int] = set()
        self._written_in_forward: set[int] = set()
        self._creating: Optional[CheckpointCommitInfo] = None  # the save since create
        self._entry_pickles = EntryPickles()  # the stubs' entries, kept from one save to the next
        self._loads: Optional[DeepSpeedLoads] = None  # the load side, once the runtime started
        self._dir: Optional[str] = None  # the save dir: the job's origin
        self._pid = os.getpid()
        FtmemCheckpointEngine._live[next(FtmemCheckpointEngine._created)] = self

    # -- DeepSpeed's interface ----------------------------------------------------------
    def _start(self, save_dir: str) -> AdapterRuntime:
        """The rank's runtime, started at DeepSpeed's first save or load (collective: all
        ranks save and load together)."""
        if self.runtime is None:
            self._dir = save_dir
            persist = self.config.persist
            self.runtime = AdapterRuntime(self.config, self._layout, self.format, save_dir, persist.dir,
                                          persist.interval, persist.keep)
            self._loads = DeepSpeedLoads(self.runtime, persist.dir, self._layout, self._universal)
        return self.runtime

    def create(self, info: CheckpointCommitInfo) -> None:
        # The runtime starts at commit: only then is it known whether this is a checkpoint
        # (whose save dir is the job's origin) or an export to some other directory.
        self._files, self._metadata, self._replicated, self._written_in_forward = {}, {}, set(), set()
        self._creating = info

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self._files[path] = state_dict
        if not isinstance(state_dict, dict):
            return
        found = {key: tensors(value) for key, value in state_dict.items()}  # each entry walked once
        self._metadata[path] = {key: value for key, value in state_dict.items() if not found[key]}
        if "module" not in state_dict:
            return  # a ZeRO partition (the optimizer's), or a pipeline layer's file (a copy DeepSpeed made)
        weights, written_in_forward = _weights_and_written_in_forward(state_dict, found)
        self._written_in_forward |= written_in_forward
        if self._holds_replicated_module(state_dict):
            # Module weights (and, without ZeRO, the optimizer) are the same on every DP
            # replica: each replica keeps only its slice of them. Buffers are not: DeepSpeed
            # does not keep them in step (a BatchNorm's running statistics follow each
            # replica's data), so each replica keeps its own.
            self._replicated |= weights
            if self.zero_stage == 0:
                self._replicated |= {id(t) for t in tensors(state_dict.get("optimizer"))}

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Start the snapshot of everything saved since ``create`` (its files become stubs);
        returns at once. Two kinds of save are exports, not checkpoints, written for real as
        the default engine writes them and not snapshotted: files of no global step
        (``save_16bit_model``: one file on rank 0, nothing on the others), and a save into
        a directory other than the job's save dir (its versions are numbered by global
        step: a snapshot of the same step would replace the one the save dir's stubs name)."""
        if isinstance(info, str):  # DeepSpeed 0.17 commits with the tag alone, of the info create was given
            info = self._creating
        files, metadata, replicated, written_in_forward = (self._files, self._metadata, self._replicated,
                                                           self._written_in_forward)
        self._files, self._metadata, self._replicated, self._written_in_forward = {}, {}, set(), set()
        self.loaded()  # files served by path are of the versions before this one
        elsewhere = self._dir is not None and os.path.realpath(info.save_dir) != os.path.realpath(self._dir)
        if not _global_steps(files) or elsewhere:
            if elsewhere:
                job_info("%s is not this job's save dir (%s): this checkpoint is written there as real files, as "
                         "the default engine writes them, and is not snapshotted", info.save_dir, self._dir)
            # The first DP replica writes the replicated model states, as the default engine does.
            first_replica = self.runtime is None or self.runtime.dp_ranks[0] == dist.get_rank()
            for path, state_dict in files.items():
                if elsewhere and self._holds_replicated_module(state_dict) and not first_replica:
                    continue
                save_atomically(state_dict, path)
            return True
        version = self._version(files)
        runtime = self._start(info.save_dir)
        identity = runtime.identity
        # The stubs go first, naming the save about to start: a version memory holds always has them.
        # The copy thread syncs them before the version commits, off the training thread.
        saved, stubs = runtime.next_save(version), Written(info.save_dir)
        for path in files:
            write_stub(path, file_key(path), saved, self._entry_pickles(os.path.basename(path), metadata.get(path, {})),
                       (identity.world_size, identity.ranks_per_node), durable=False)
            stubs(path)
        # No predicate where nothing is written in the forward (no buffers): the core asks it of every tensor.
        runtime.save({"files": {file_key(path): state_dict for path, state_dict in files.items()}, "tag": info.tag},
                     version, replicated=lambda t: id(t) in replicated,
                     written_in_forward=(lambda t: id(t) in written_in_forward) if written_in_forward else None,
                     files=stubs)
        return True

    def load(self, path: str, map_location=None):
        if not is_stub(path):  # a checkpoint written by another engine: stock behaviour
            return torch.load(path, map_location=map_location, weights_only=False)
        self._start(os.path.dirname(os.path.dirname(path)))
        return apply_map_location(self._loads.file(path), map_location)

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return True  # every DP replica snapshots its slice of the replicated state

    def is_decoupled(self) -> bool:
        return False

    # -- ftmem ---------------------------------------------------------------------------
    def resume_point(self, load_dir: str, into: Optional[RestoreTargets] = None) -> Optional[tuple[str, Optional[str]]]:
        """What ``load_checkpoint(load_dir)`` without a tag resumes from, whatever DeepSpeed's
        ``latest`` says (:meth:`ftmem_deepspeed.loads.DeepSpeedLoads.resume_point`); the patch calls it."""
        self._start(load_dir)
        return self._loads.resume_point(load_dir, into)

    @classmethod
    def serving(cls, path: str) -> Optional["FtmemCheckpointEngine"]:
        """The newest started engine of this process whose save dir holds ``path`` as a
        stub; None for any other path (torch reads it as usual).

        A forked child (a worker pool of the script or of DeepSpeed's ds_to_universal)
        inherits the engines but not the right to use them: its collectives would share
        the parent's store and gloo sockets. There the stub's own error says what to do."""
        checkpoint_dir = os.path.realpath(os.path.dirname(os.path.dirname(path)))
        for _, engine in sorted(cls._live.items(), reverse=True):
            if (engine.runtime is not None and engine._pid == os.getpid()
                    and os.path.realpath(engine._dir) == checkpoint_dir):
                return engine if is_stub(path) else None
        return None

    def serve(self, path: str) -> Any:
        """What the default engine's file at ``path`` (a stub in the save dir) would hold
        (:meth:`ftmem_deepspeed.loads.DeepSpeedLoads.serve`)."""
        return self._loads.serve(path)

    def wait_reusable(self) -> None:
        """Before the optimizer writes the state again: the snapshot's copy must be done. The
        step also ends the load before it, where nothing else did: the patch calls
        :meth:`loaded` only as the next load begins, and from here on the optimizer trains
        any restored tensors it kept."""
        if self._loads is not None and self._loads.active:
            self.loaded()
        if self.runtime is not None:
            self.runtime.wait_reusable()

    def wait_protected(self) -> None:
        """Until the last snapshot is committed and protected on every rank."""
        if self.runtime is not None:
            self.runtime.wait_protected()

    def wait_flushed(self) -> None:
        """Until the last snapshot is protected and any flush to the persist dir is done."""
        if self.runtime is not None:
            self.runtime.wait_flushed()

    @staticmethod
    def _version(files: dict) -> int:
        steps = _global_steps(files)
        if len(steps) != 1:
            raise FtmemError(f"cannot tell the global step of this checkpoint: its files name global steps "
                             f"{sorted(steps)}.")
        return int(steps.pop())

    def _holds_replicated_module(self, state_dict) -> bool:
        return isinstance(state_dict, dict) and "module" in state_dict and self.zero_stage < 3

    def loaded(self) -> None:
        """DeepSpeed's ``load_checkpoint`` returned (the import's hook), or the next one
        begins (the patch, which has no place after the load): forget what it restored. A later load
        (a rollback mid-run) must find the newest version again, not this one; and the
        framework may now own the restored tensors (an optimizer keeps those it is given and
        trains them), so they must not be served again as the version's; nor may files served
        by path, which their reader may have kept."""
        if self._loads is not None:
            self._loads.end()


def _weights_and_written_in_forward(model_states: dict, found: dict) -> tuple[set[int], set[int]]:
    """The ids of a model-states file's module weights, and of its tensors that the next
    forward may write in place before the optimizer step: all but the module's weights and
    the optimizer's state (which only the step writes), that is the module's buffers (a
    BatchNorm's running statistics), the client state, the scheduler's. ``found``: the tensors
    under each of the file's entries. (A save call pays for every object it visits: each entry
    is walked once.)"""
    buffers = set(model_states.get("buffer_names") or ())
    module = model_states.get("module") or {}
    if buffers:
        weights = {id(t) for t in tensors([value for name, value in module.items() if name not in buffers])}
        in_buffers = tensors([value for name, value in module.items() if name in buffers])
    else:
        weights, in_buffers = {id(t) for t in found.get("module", ())}, []
    kept_for_the_step = weights | {id(t) for t in found.get("optimizer", ())}
    elsewhere = {id(t) for key, under in found.items() if key not in ("module", "optimizer") for t in under}
    return weights, (elsewhere | {id(t) for t in in_buffers}) - kept_for_the_step


def _global_steps(files: dict) -> set:
    """The global steps a checkpoint's files name (DeepSpeed puts one in every rank's model states)."""
    return {sd.get("global_steps") for sd in files.values() if isinstance(sd, dict)} - {None}
