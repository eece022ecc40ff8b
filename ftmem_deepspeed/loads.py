"""The load side of the DeepSpeed adapter: what ``load_checkpoint`` resumes from, and the
files its loads read, served from the version memory gave back.

A load asks once (the first time it reaches ftmem) and keeps the answer, a :class:`_Load`,
until it returns; every file it then reads is served from that answer. Files read by
path, outside a load, are served from any version memory holds.
"""
from __future__ import annotations

import functools
import glob
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from ftmem import FtmemError, NotRecoverableFromMemory, ParallelLayout, Restored
from ftmem.adapter import (DISK, MEMORY, AdapterRuntime, Adopted, DiskCheckpoint, OtherWorlds, RestoreTargets,
                           Resumption, everyone_joins, flushed, job_info, lowest_rank_first)

from .stub import is_stub, read_stub, version_of


def _is_layer_file(key: str) -> bool:
    return os.path.basename(key).startswith("layer_")


def file_key(path: str) -> str:
    """A checkpoint file's name relative to the save dir: ``<tag>/<file>``."""
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


@dataclass(frozen=True)
class _Load:
    """What one ``load_checkpoint`` resumes from, until it returns (:meth:`DeepSpeedLoads.end`)."""

    resumption: Resumption
    files: Optional[dict] = None  # from memory: the version's files by key (every old rank's, when adopted)
    tag: Optional[str] = None  # from memory: the version's tag


class DeepSpeedLoads:
    """One rank's loads from ftmem, for its :class:`~ftmem_deepspeed.FtmemCheckpointEngine`."""

    def __init__(self, runtime: AdapterRuntime, persist_dir: Optional[str], layout: ParallelLayout, universal: bool):
        """``universal``: the job loads universal checkpoints (``"load_universal"``)."""
        self.runtime, self._persist_dir, self._layout, self._universal = runtime, persist_dir, layout, universal
        self._load: Optional[_Load] = None  # the load in progress, once it has asked ftmem
        # ((job, tag), every rank's files) last read by path: a cache, as a reader reads a version's
        # files one by one
        self._served: Optional[tuple[tuple[str, str], dict]] = None

    @property
    def active(self) -> bool:
        return self._load is not None or self._served is not None

    def resume_point(self, load_dir: str, into: Optional[RestoreTargets] = None) -> Optional[tuple[str, Optional[str]]]:
        """What ``load_checkpoint(load_dir)`` without a tag resumes from, whatever DeepSpeed's
        ``latest`` says (it may name a version memory never committed, or be empty after a
        kill mid-write): ``(load_dir, tag)`` of memory's newest recoverable version, else
        ``(persist dir, tag)`` of the persistent tier's newest checkpoint, else
        ``(load_dir, None)`` to let DeepSpeed read ``latest`` when it names another
        engine's files; None for a fresh job, which has nothing to resume from. Memory that
        held versions it cannot give back, with no disk checkpoint, is refused with the
        reason (:meth:`ftmem.adapter.AdapterRuntime.resumed`). A restore from memory
        writes into the engine's tensors that ``into`` names (:mod:`ftmem_deepspeed.targets`).
        When ``latest`` names an ftmem checkpoint that neither memory nor the persistent
        tier can give back, the load is refused: DeepSpeed's default engine would have
        loaded that checkpoint, so a fresh start in its place would be a silently wrong
        resume. A job that loads universal checkpoints (``"load_universal"``) loads the one
        DeepSpeed's ``latest_universal`` names: ``(load_dir, None)`` (see :meth:`file`).
        Collective: every rank loads."""
        if self._universal:
            return load_dir, None
        latest = _read_latest(load_dir)
        stub = _stub_in(os.path.join(load_dir, latest)) if latest else None
        self._load = self._resume(stub, into)
        resumption = self._load.resumption
        if resumption.source == MEMORY:
            return load_dir, self._load.tag
        if resumption.source == DISK:
            return os.path.split(resumption.disk.directory)
        if latest and stub is None:
            return load_dir, None  # files another engine wrote: DeepSpeed loads them as usual
        if latest:
            self._refuse_another_job_s(stub)
            raise NotRecoverableFromMemory(
                f"{os.path.join(load_dir, 'latest')} names {latest}, an ftmem checkpoint that neither memory nor the "
                f"persistent tier can give back ({resumption.reason or 'memory holds no version of this job'}). "
                f"ftmem does not start from scratch in its place. To resume, load a checkpoint on disk "
                f"(load_checkpoint(dir, tag) of one the default engine or the persistent tier wrote); to start "
                f"over on purpose, remove {os.path.join(load_dir, 'latest')}.")
        self.runtime.resumed(resumption)  # refused where memory held what it could not give back
        return None

    def file(self, path: str) -> Any:
        """What DeepSpeed's load of the stub ``path`` reads (collective at a load's first file,
        or a version's first file read by path)."""
        if self._universal and not _is_optimizer_file(_key_of(path)) and not self._saved_on_this_world(path):
            # A universal checkpoint's model states, copies of another world's stubs (the
            # conversion copies those files as they are). DeepSpeed's universal load reads
            # only their tensor-free entries: weights and optimizer come from its zero/ files.
            job_info("%s: a universal checkpoint's copy of a stub of job %s on another world: its tensor-free "
                     "entries are served, and DeepSpeed loads the weights and the optimizer from the "
                     "universal checkpoint's files", path, _stub(path)["job"])
            return read_stub(path)["metadata"]
        self._refuse_another_job_s(path)
        if self._load is None:  # a load of a tag the script named: this is its first file
            self._load = self._resume_named(path)
        files, key = self._load.files, _key_of(path)
        if files is not None and key in files:
            return files[key]
        if files is not None and self._load.tag == os.path.dirname(key) and not _is_optimizer_file(key):
            # Another rank's model states of the restored version: DeepSpeed reads only their
            # tensor-free entries, and not on every rank (the pipeline engine's check).
            return read_stub(path)["metadata"]
        # Another rank's optimizer partition (the elastic loader reads them all, on every
        # rank), or a version other than the one restored.
        return self.serve(path)

    def serve(self, path: str) -> Any:
        """What the default engine's file that the stub at ``path`` stands for would hold (a
        copy of a stub stands for the same file), from the version its tag names: the
        restored one, or any other that memory holds. The file may be another rank's (see
        :meth:`_files_of_every_rank`), or another job's whose memory is all on this host (a
        checkpoint another world wrote: zero_to_fp32 of it in a ZeRO-3 universal load without
        the optimizer's states)."""
        key, job = _key_of(path), _stub(path)["job"]
        tag = os.path.dirname(key)
        if self._served is None or self._served[0] != (job, tag):
            self._served = None  # one version's files at a time
            files = (self._files_of_every_rank(tag, path) if self._of_this_job(path)
                     else self._files_of_another_job(tag, path))
            self._served = ((job, tag), files)
        files = self._served[1]
        if key not in files:
            raise FtmemError(f"{path} is an ftmem stub, but no rank's snapshot of tag {tag!r} holds {key} "
                             f"(it holds {sorted(files)}).")
        return files[key]

    def _files_of_another_job(self, tag: str, path: str) -> dict:
        """Every rank's files of the version of another job whose stub ``path`` is, read from
        this host's shared memory; refused where that job's memory is not all here."""
        info = _stub(path)
        saved, version = version_of(info), _version_of_tag(os.path.dirname(path))
        states = self.runtime.read_here(version, saved and saved.uid, job=info["job"])
        if states is None:
            self._refuse_another_job_s(path)
        _check_tag(path, version, states[0]["tag"])
        return lowest_rank_first([_of_tag(state["files"], tag) for state in states])

    def _files_of_every_rank(self, tag: str, path: str) -> dict:
        """Every rank's files of the version whose stub ``path`` is. Outside a load of it, read
        from this host's shared memory where every rank's node memory is here, with no
        collective (a read on some ranks only: DeepSpeed's universal-checkpoint conversion on
        rank 0); else gathered from every rank, which must all read (a bounded rendezvous first)."""
        loaded = self._load is not None and self._load.tag == tag
        if not loaded:
            saved, version = version_of(_stub(path)), _version_of_tag(os.path.dirname(path))
            states = self.runtime.read_here(version, saved and saved.uid)
            if states is not None:
                _check_tag(path, version, states[0]["tag"])
                return lowest_rank_first([_of_tag(state["files"], tag) for state in states])
        everyone_joins(f"reading {path} from memory",
                       "To read an ftmem checkpoint on some ranks only, or in another process, get real files first: "
                       "`ftmem export`, or the persistent tier (\"persist\" in the \"ftmem\" config).")
        if loaded:
            files = self._load.files
        else:
            files = self._checked(path, self.runtime.read_version(version)).state["files"]
        # A file every DP replica holds (the model states) is served as the default engine
        # writes it: from the lowest rank.
        return lowest_rank_first(self.runtime.gather(_of_tag(files, tag)))

    def end(self) -> None:
        """Forget what the last load resumed from and what was served by path (see
        :meth:`ftmem_deepspeed.FtmemCheckpointEngine.loaded`)."""
        self._load = self._served = None

    def _resume(self, latest_stub: Optional[str], into: Optional[RestoreTargets]) -> _Load:
        """A resume (collective): memory's newest of the run whose stub ``latest`` names
        (``latest_stub``; an earlier run's versions are stale), else the persistent tier's newest
        checkpoint (then DeepSpeed reads its real files, see :meth:`resume_point`), else nothing."""
        persist_dir = self._persist_dir
        newest = flushed(persist_dir)[-1] if persist_dir and flushed(persist_dir) else None
        disk = DiskCheckpoint(newest["version"], os.path.join(persist_dir, newest["name"])) if newest else None
        plan = self.runtime.plan_resume(disk, OtherWorlds(refuse=self._cannot_load),
                                        newest_saved=version_of(_stub(latest_stub)) if latest_stub else None)
        # What to restore into is built here, between the collective phases.
        targets = into(plan.saved) if into is not None and plan.chosen is not None else None
        plan = self.runtime.restore(plan, into=targets)
        if plan.source == DISK:
            return _Load(self.runtime.resumed(plan))  # its RNG, from the flushed checkpoint
        return self._resumed(plan) if plan.source == MEMORY else _Load(plan)

    def _resume_named(self, path: str) -> _Load:
        """A load of the tag whose stub ``path`` is (collective): that version, from memory, or a refusal."""
        plan = self.runtime.plan_resume(named=_version_of_tag(os.path.dirname(path)))
        plan = self.runtime.restore(plan)
        self._checked(path, plan.restored)
        return self._resumed(plan)

    def _resumed(self, plan: Resumption) -> _Load:
        """Serve the version memory gave back. Another world's: every old rank's files (the
        model states from the lowest old rank, as the default engine writes them from the
        first DP replica)."""
        if plan.adopted is not None:
            files = lowest_rank_first([state["files"] for state in plan.adopted.states])
            tag = plan.adopted.states[0]["tag"]
        else:
            files, tag = plan.restored.state["files"], plan.restored.state["tag"]
            self._share_layer_files(files)
        return _Load(self.runtime.resumed(plan, detail=f"tag {tag}"), files, tag)

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

    @staticmethod
    def _checked(path: str, restored: Restored) -> Restored:
        """``restored``, the version whose stub ``path`` is, unless a later save of the same
        global step replaced it, or it is another run's save of that step."""
        version = restored.version
        _check_tag(path, version, restored.state["tag"])
        saved = version_of(_stub(path))
        if saved is not None and saved.uid != restored.uid:
            raise FtmemError(f"{path} is a stub of job {saved.job}'s version {version}, but memory's version {version} "
                             f"is another run's save of that step (stale memory of an earlier run of the same save "
                             f"dir, or the stub is). Load a checkpoint on disk, or run the job that wrote the stub.")
        return restored

    def _saved_on_this_world(self, stub: str) -> bool:
        """The stub was written by this job, on the world it runs on (a job id may be set, and
        kept across a change of size)."""
        info, identity = _stub(stub), self.runtime.identity
        now = [identity.world_size, identity.ranks_per_node]
        return info["job"] == identity.job and info.get("world", now) == now

    def _of_this_job(self, stub: str) -> bool:
        """The stub is this job's, or the adopted one's (a load of another world's memory)."""
        adopted = self._adopted()
        return _stub(stub)["job"] in (self.runtime.identity.job, adopted and adopted.job)

    def _refuse_another_job_s(self, stub: str) -> None:
        """Refuse a checkpoint whose stubs another job wrote (:meth:`ftmem.adapter.AdapterRuntime.refuse_other_job`)."""
        info = _stub(stub)
        then = tuple(info["world"]) if info.get("format", 1) >= 2 else None  # format 1 does not say
        self.runtime.refuse_other_job(f"{stub} is a stub of", info["job"], then, self._adopted())

    def _adopted(self) -> Optional[Adopted]:
        """The other world's job the load under way adopted, if it did."""
        return self._load.resumption.adopted if self._load is not None else None

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


def _of_tag(files: dict, tag: str) -> dict:
    """The files of ``tag`` among a rank's snapshot's ``files`` (by key, ``<tag>/<file>``)."""
    return {key: file for key, file in files.items() if os.path.dirname(key) == tag}


def _check_tag(path: str, version: int, held_tag: str) -> None:
    """Memory's version ``version`` (of tag ``held_tag``) is the one whose stub ``path`` is,
    unless a later save of the same global step replaced it."""
    tag = os.path.dirname(_key_of(path))
    if held_tag != tag:
        raise FtmemError(f"{path} is a stub of version {version} (tag {tag!r}), but memory's version {version} is "
                         f"tag {held_tag!r}: a later save of the same global step replaced it. Load tag {held_tag!r}, "
                         f"or a checkpoint on disk.")


def _key_of(stub: str) -> str:
    """The file a stub stands for, as ``<tag>/<file>`` (:func:`file_key` of where it was written):
    where it lies tells nothing, since a copy of a stub (DeepSpeed's universal-checkpoint
    conversion copies model-states files) stands for the same file."""
    return _stub(stub)["tag_file"]


def _stub(path: str) -> dict:
    """A stub's info (:func:`read_stub`), read once for each version of the file: a load asks
    about the same stub several times."""
    status = os.stat(path)
    return _read_stub(path, status.st_ino, status.st_mtime_ns, status.st_size)


@functools.lru_cache(maxsize=256)
def _read_stub(path: str, inode: int, mtime_ns: int, size: int) -> dict:
    return read_stub(path)


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


def _stub_in(tag_dir: str) -> Optional[str]:
    """The first ftmem stub in a tag's directory; None where it holds none (another engine's files)."""
    return next((f for f in sorted(glob.glob(os.path.join(tag_dir, "*"))) if is_stub(f)), None)


def _read_latest(load_dir: str) -> str:
    """The tag DeepSpeed's ``latest`` names; empty if it is missing or empty."""
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""
