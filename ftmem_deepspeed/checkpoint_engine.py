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
the first stage's model-states file on every stage), never their tensors.
"""
from __future__ import annotations

import glob
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

from ftmem import FtmemConfig, FtmemError, NotRecoverableFromMemory, ParallelLayout, Restored
from ftmem.adapter import (DISK, MEMORY, Adopted, AdapterRuntime, OtherWorlds, RestoreTargets, check_startup,
                           everyone_joins, flushed, gather_dp_groups, job_info, save_atomically, world_in_words)

from .format import DeepSpeedFormat
from .stub import is_stub, read_stub, write_stub

# DeepSpeed's own types in the state it hands a checkpoint engine. ftmem loads a snapshot's
# skeleton only with admitted types (the list torch.load(weights_only=True) uses); these
# hold plain fields and are rebuilt without running DeepSpeed code.
torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])


def file_key(path: str) -> str:
    """A checkpoint file's name relative to the save dir: ``<tag>/<file>``."""
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def apply_map_location(obj: Any, map_location) -> Any:
    """What ``torch.load(map_location=...)`` would have done to restored CPU tensors:
    a device or string moves them; a callable gets each storage, as torch.load calls it.
    Containers are always new, as torch.load's are: callers may change what they get (a
    restored or served state is handed out more than once)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if map_location is None:
            return t
        if callable(map_location):
            storage = map_location(t.untyped_storage(), "cpu")
            if storage is t.untyped_storage():
                return t
            return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(),
                                                                             t.size(), t.stride())
        return t.to(map_location)

    if isinstance(obj, torch.Tensor):
        return move(obj)
    if isinstance(obj, dict):
        return type(obj)((k, apply_map_location(v, map_location)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(apply_map_location(v, map_location) for v in obj)
    return obj


def _is_layer_file(key: str) -> bool:
    return os.path.basename(key).startswith("layer_")


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
        self.format = DeepSpeedFormat()
        self._layout = parallel_layout(zero_stage)
        # Checked now, at deepspeed.initialize; the runtime itself starts at the first save
        # or load, when the save dir (the job's origin) is known.
        check_startup(self.config, dist.get_rank(), dist.get_world_size())
        self.runtime: Optional[AdapterRuntime] = None
        self._files: dict[str, Any] = {}
        self._replicated: set[int] = set()
        self._restored: Optional[dict] = None
        self._restore_tried = False
        self._disk_dir: Optional[str] = None  # the persisted checkpoint a restart fell back to
        self._memory_failed: Optional[str] = None  # why memory could not serve a restart, when it could not
        self._dir: Optional[str] = None  # the save dir: the job's origin
        self._served: Optional[tuple[str, dict]] = None  # (tag, every rank's files) last read by path
        self._adopted_job: Optional[str] = None  # the job of another world whose version the last load adopted
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
        return self.runtime

    def create(self, info: CheckpointCommitInfo) -> None:
        # The runtime starts at commit: only then is it known whether this is a checkpoint
        # (whose save dir is the job's origin) or an export to some other directory.
        self._files, self._replicated = {}, set()

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self._files[path] = state_dict
        if self._holds_replicated_module(state_dict):
            # Module weights (and, without ZeRO, the optimizer) are the same on every DP
            # replica: each replica keeps only its slice of them. Buffers are not: DeepSpeed
            # does not keep them in step (a BatchNorm's running statistics follow each
            # replica's data), so each replica keeps its own.
            buffers = set(state_dict.get("buffer_names") or ())
            module = state_dict.get("module") or {}
            self._replicated |= {id(t) for name, value in module.items() if name not in buffers
                                 for t in _tensors(value)}
            if self.zero_stage == 0:
                self._replicated |= {id(t) for t in _tensors(state_dict.get("optimizer"))}

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Start the snapshot of everything saved since ``create`` (its files become stubs);
        returns at once. Two kinds of save are exports, not checkpoints, written for real as
        the default engine writes them and not snapshotted: files of no global step
        (``save_16bit_model``: one file on rank 0, nothing on the others), and a save into
        a directory other than the job's save dir (its versions are numbered by global
        step: a snapshot of the same step would replace the one the save dir's stubs name)."""
        files, replicated = self._files, self._replicated
        self._files, self._replicated, self._served = {}, set(), None
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
        for path, state_dict in files.items():
            metadata = {k: v for k, v in state_dict.items() if not _tensors(v)} if isinstance(state_dict, dict) else {}
            write_stub(path, file_key(path), identity.job, metadata, (identity.world_size, identity.ranks_per_node))
        runtime.save({"files": {file_key(path): state_dict for path, state_dict in files.items()}, "tag": info.tag},
                     version, replicated=lambda t: id(t) in replicated)
        return True

    def load(self, path: str, map_location=None):
        if not is_stub(path):  # a checkpoint written by another engine: stock behaviour
            return torch.load(path, map_location=map_location, weights_only=False)
        self._start(os.path.dirname(os.path.dirname(path)))
        self._refuse_another_job_s(path)
        state = self._restore(path)
        key = file_key(path)
        if state is not None and key in state["files"]:
            return apply_map_location(state["files"][key], map_location)
        if state is not None and state["tag"] == _tag_of(path) and not _is_optimizer_file(key):
            # Another rank's model states of the restored version: DeepSpeed reads only their
            # tensor-free entries, and not on every rank (the pipeline engine's check).
            return read_stub(path)["metadata"]
        # Another rank's optimizer partition (the elastic loader reads them all, on every
        # rank), or a version other than the one restored.
        return apply_map_location(self.serve(path), map_location)

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return True  # every DP replica snapshots its slice of the replicated state

    def is_decoupled(self) -> bool:
        return False

    # -- ftmem ---------------------------------------------------------------------------
    def resume_point(self, load_dir: str, into: Optional[RestoreTargets] = None) -> Optional[tuple[str, Optional[str]]]:
        """What ``load_checkpoint(load_dir)`` without a tag resumes from, whatever DeepSpeed's
        ``latest`` says (it may name a version memory never committed, or be empty after a
        kill mid-write): ``(load_dir, tag)`` of memory's newest recoverable version, else
        ``(persist dir, tag)`` of the persistent tier's newest checkpoint, else
        ``(load_dir, None)`` to let DeepSpeed read ``latest`` when it names another
        engine's files; None for a fresh job, which has nothing to resume from. Memory that
        held versions it cannot give back, with no disk checkpoint, is refused with the
        reason (:meth:`ftmem.adapter.AdapterRuntime.resumed_from_scratch`). A restore from memory
        writes into the engine's tensors that ``into`` names (:mod:`ftmem_deepspeed.targets`).
        When ``latest`` names an ftmem checkpoint that neither memory nor the persistent
        tier can give back, the load is refused: DeepSpeed's default engine would have
        loaded that checkpoint, so a fresh start in its place would be a silently wrong
        resume. Collective: every rank loads."""
        self._start(load_dir)
        self._restore(into=into)
        if self._restored is not None:
            return load_dir, self._restored["tag"]
        if self._disk_dir is not None:
            return os.path.dirname(self._disk_dir), os.path.basename(self._disk_dir)
        latest = _read_latest(load_dir)
        stub = next((f for f in sorted(glob.glob(os.path.join(load_dir, latest, "*"))) if is_stub(f)),
                    None) if latest else None
        if latest and stub is None:
            return load_dir, None  # files another engine wrote: DeepSpeed loads them as usual
        if latest:
            self._refuse_another_job_s(stub)
            raise NotRecoverableFromMemory(
                f"{os.path.join(load_dir, 'latest')} names {latest}, an ftmem checkpoint that neither memory nor the "
                f"persistent tier can give back ({self._memory_failed or 'memory holds no version of this job'}). "
                f"ftmem does not start from scratch in its place. To resume, load a checkpoint on disk "
                f"(load_checkpoint(dir, tag) of one the default engine or the persistent tier wrote); to start "
                f"over on purpose, remove {os.path.join(load_dir, 'latest')}.")
        self.runtime.resumed_from_scratch(self._memory_failed)
        return None

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
        """What the default engine's file at ``path`` (a stub in the save dir) would hold,
        from the version its tag names: the restored one, or any other that memory holds.
        The file may be another rank's, so the first read of a version is a collective
        (every rank's files of it are gathered; see :func:`ftmem.adapter.everyone_joins`)."""
        self._refuse_another_job_s(path)
        tag = _tag_of(path)
        if self._served is None or self._served[0] != tag:
            self._served = None  # one version's files at a time
            self._served = (tag, self._files_of_every_rank(tag, path))
        files = self._served[1]
        if file_key(path) not in files:
            raise FtmemError(f"{path} is an ftmem stub, but no rank's snapshot of tag {tag!r} holds {file_key(path)} "
                             f"(it holds {sorted(files)}).")
        return files[file_key(path)]

    def _files_of_every_rank(self, tag: str, path: str) -> dict:
        everyone_joins(f"reading {path} from memory",
                       "To read an ftmem checkpoint on some ranks only, or in another process, get real files first: "
                       "`ftmem export`, or the persistent tier (\"persist\" in the \"ftmem\" config).")
        if self._restored is not None and self._restored["tag"] == tag:
            state = self._restored
        else:
            state = self._restore_tag(path, resume=False).state
        mine = {key: file for key, file in state["files"].items() if os.path.dirname(key) == tag}
        # A file every DP replica holds (the model states) is served as the default engine
        # writes it: from the lowest rank (DeepSpeed fills some entries, such as the tied
        # weights' shared_params, on rank 0 only).
        served: dict = {}
        for files in self.runtime.gather(mine):
            for key, file in files.items():
                served.setdefault(key, file)
        return served

    def wait_reusable(self) -> None:
        """Before the optimizer writes the state again: the snapshot's copy must be done. The
        step also ends the load before it, where nothing else did: the patch calls
        :meth:`loaded` only as the next load begins, and from here on the optimizer trains
        any restored tensors it kept."""
        if self._restore_tried or self._served is not None:
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
        self._restored, self._restore_tried, self._disk_dir, self._memory_failed = None, False, None, None
        self._served = None

    def _restore(self, named: Optional[str] = None, into: Optional[RestoreTargets] = None) -> Optional[dict]:
        """Restore once per load (all ranks load together). A resume (no ``named`` file):
        memory's newest, else the persistent tier's newest checkpoint (then DeepSpeed reads
        its real files, see :meth:`resume_point`). A load of a tag the script named (the
        first stub it reads, ``named``): that tag's version, with its RNG, or a refusal."""
        if self._restore_tried:
            return self._restored
        self._restore_tried = True
        if named is not None:
            return self._resumed_from_memory(self._restore_tag(named, resume=True))
        persist_dir = self.config.persist.dir
        on_disk = flushed(persist_dir)[-1] if persist_dir and flushed(persist_dir) else None
        resumption = self.runtime.restore(disk_version=on_disk["version"] if on_disk else None, into=into,
                                          other_worlds=OtherWorlds(refuse=self._cannot_load))
        if resumption.adopted is not None:
            self._resumed_by_adoption(resumption.adopted)
        elif resumption.source == MEMORY:
            self._resumed_from_memory(resumption.restored)
        elif resumption.source == DISK:
            self._disk_dir = os.path.join(persist_dir, on_disk["name"])
            self.format.restore_rng_from(self._disk_dir, self.runtime.rank)
            self.runtime.resumed_from_disk(on_disk["version"], self._disk_dir, resumption.reason)
        else:
            self._memory_failed = resumption.reason  # said by resume_point, or in the stub read's refusal
        return self._restored

    def _cannot_load(self, saved: ParallelLayout) -> Optional[str]:
        """Why DeepSpeed cannot load, on this job's world, a version saved under the layout
        ``saved`` (another world's); None if it can. Its ZeRO-1 and ZeRO-2 loaders read every
        old DP rank's optimizer partition (repartitioned by the elastic loader, when the
        config asks for it) and the module states, which the old world's version holds."""
        now = self._layout
        if saved.pp_size > 1 or now.pp_size > 1:
            return ("it resumes DeepSpeed from another world's memory only without pipeline or model parallelism "
                    f"(saved with {saved.pp_size} model-parallel rank(s), now {now.pp_size})")
        if 3 in (saved.zero_stage, now.zero_stage):
            return ("it resumes DeepSpeed from another world's memory only at ZeRO stages 0 to 2 (ZeRO-3 partitions "
                    f"the module as well; saved at stage {saved.zero_stage}, now {now.zero_stage})")
        if saved.zero_stage != now.zero_stage:
            return f"they were saved at ZeRO stage {saved.zero_stage}, and this job runs stage {now.zero_stage}"
        return None

    def _resumed_by_adoption(self, adopted: Adopted) -> None:
        """Serve another world's version: every old rank's files (the model states from the
        lowest old rank, as the default engine writes them from the first DP replica)."""
        files: dict = {}
        for state in adopted.states:
            for key, file in state["files"].items():
                files.setdefault(key, file)
        tag = adopted.states[0]["tag"]
        self._restored, self._adopted_job = {"files": files, "tag": tag}, adopted.job
        self.runtime.resumed_by_adoption(adopted, detail=f"tag {tag}")

    def _restore_tag(self, path: str, resume: bool) -> Restored:
        """The version whose stub ``path`` is, from memory (collective), or a refusal: for the
        job to resume from (``resume``: a load of that tag), or for a read of its files."""
        tag, version = _tag_of(path), _version_of_tag(os.path.dirname(path))
        restored = (self.runtime.restore_named(version) if resume
                    else self.runtime.read_version(version))
        if restored.state["tag"] != tag:
            raise FtmemError(f"{path} is a stub of version {version} (tag {tag!r}), but memory's version {version} is "
                             f"tag {restored.state['tag']!r}: a later save of the same global step replaced it. Load "
                             f"tag {restored.state['tag']!r}, or a checkpoint on disk.")
        return restored

    def _refuse_another_job_s(self, stub: str) -> None:
        """Refuse a checkpoint whose stubs another job wrote (a relaunch at another world
        size, or another FTMEM_JOB_ID, into the same save dir): this job's memory may hold a
        version of the same number, which is not that checkpoint."""
        identity, info = self.runtime.identity, read_stub(stub)
        ours, theirs = identity.job, info["job"]
        if theirs not in (ours, self._adopted_job):
            world = (identity.world_size, identity.ranks_per_node)
            then = tuple(info["world"]) if info.get("format", 1) >= 2 else world  # format 1 does not say
            changed = (f" Job {theirs} saved it on {world_in_words(*then)}; this job runs on "
                       f"{world_in_words(*world)}." if then != world else "")
            raise FtmemError(
                f"{stub} is a stub of job {theirs}'s in-memory checkpoint, but this job is {ours}.{changed} A job's id derives "
                f"from its save dir and its world layout (world size, ranks per node) unless FTMEM_JOB_ID or "
                f"\"job_id\" sets it, so a relaunch at another size is another job, and ftmem restores from memory "
                f"only onto the layout a checkpoint was saved with. Relaunch as it was saved, or write real files "
                f"first (`ftmem export --job {theirs} --out DIR`) and load those.")

    def _resumed_from_memory(self, restored: Restored) -> dict:
        self._restored = restored.state
        self._share_layer_files(restored.state["files"])
        self.runtime.resumed_from_memory(restored, detail=f"tag {restored.state['tag']}")
        return self._restored

    def _share_layer_files(self, files: dict) -> None:
        """The pipeline engine writes a stage's layer files from its first DP replica only,
        but every replica loads them: that replica sends them to the others (collective
        over the DP group, at restore only)."""
        if self.runtime.dp_group is None:
            return
        source = self.runtime.dp_ranks[0]
        shared = [{k: v for k, v in files.items() if _is_layer_file(k)} if dist.get_rank() == source else None]
        dist.broadcast_object_list(shared, src=source, group=self.runtime.dp_group)
        for key, state_dict in shared[0].items():
            files.setdefault(key, state_dict)


def _tag_of(path: str) -> str:
    return os.path.basename(os.path.dirname(path))


def _is_optimizer_file(key: str) -> bool:
    return "optim_states" in os.path.basename(key)


def _version_of_tag(tag_dir: str) -> int:
    """The version (global step) whose stubs ``tag_dir`` holds: DeepSpeed puts the step
    in every model-states file."""
    steps = {read_stub(f)["metadata"].get("global_steps") for f in glob.glob(os.path.join(tag_dir, "*.pt"))
             if is_stub(f)} - {None}
    if len(steps) != 1:
        raise FtmemError(f"cannot tell which version the ftmem stubs in {tag_dir} are of (their global steps: "
                         f"{sorted(steps)}).")
    return int(steps.pop())


def _read_latest(load_dir: str) -> str:
    """The tag DeepSpeed's ``latest`` names; empty if it is missing or empty."""
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _global_steps(files: dict) -> set:
    """The global steps a checkpoint's files name (DeepSpeed puts one in every rank's model states)."""
    return {sd.get("global_steps") for sd in files.values() if isinstance(sd, dict)} - {None}


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
