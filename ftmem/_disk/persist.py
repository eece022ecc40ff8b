"""The persistent tier: protected versions flushed to disk in the background, in the
framework's own checkpoint layout, for the failures memory cannot survive.

Every ``persist.interval``-th protected version, and every version an adapter asks for
(Megatron's persistent saves), the engine hands the :class:`Flusher` a
private, whole copy of the version (the DP-sharded replicated state gathered back from
the replicas), so a flush never holds a slot that a newer save needs. If a flush is
still running on any rank when the next one is due, that version is skipped and
logged: flushes never queue. A flush writes this rank's files through the adapter's
:class:`~ftmem._disk.format.FrameworkFormat` into ``<dir>/.<name>.tmp`` and syncs them; once
every rank has written its part (an all-reduce on the flusher's own gloo group), rank 0
renames it to ``<dir>/<name>``, updates the framework's pointer (DeepSpeed's ``latest``,
Megatron's ``latest_checkpointed_iteration.txt``) and the manifest, and only then deletes the
oldest flushes beyond ``keep``, each step durable before the next (:mod:`ftmem._disk.durable`).
A crash, or a power loss, before the rename leaves the previous checkpoint the newest valid one.

The flushing runs in a thread of each training process rather than in the SMP:
writing a DP replica's files needs the replicated state the other replicas hold, and
only the training processes have the process groups to gather it.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from ftmem._common import open_files, testhooks, threads
from ftmem._common.collective import first_problem, new_group
from ftmem.errors import ConfigError, FtmemError
from ftmem._disk.durable import Written
from ftmem._disk.format import FrameworkFormat
from ftmem._common.logs import job_info, rank_error, rank_info
from ftmem._common.parallel import destroy_groups
from ftmem._state.tree import tensors
from ftmem._shm.private import writing_temporary
from ftmem._shm.private import sync
from ftmem._shm.slots import write_atomically

MANIFEST = "ftmem_flushed.json"  # what this tier completed, oldest first: [{"name", "version"}]
# In each staging directory (``.<name>.tmp``) while it is written: it is ftmem's, and may be removed.
STAGING_MARK = ".ftmem-staging"
PROGRESS_EVERY_S = 5.0


class _KeepsWriteErrors:
    """A file for torch.save that keeps the OSError behind a failed write: torch reports a
    full disk as "[enforce fail at inline_container.cc] unexpected pos", which names nothing."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()


def save_atomically(obj: Any, path: str) -> None:
    """torch.save ``obj`` to ``path`` under a temporary name, then rename: a reader sees
    the whole file or none. A write that fails raises its OSError (ENOSPC, EIO, ...), and
    leaves no temporary file."""
    tmp = path + ".tmp"
    with writing_temporary(tmp), open(tmp, "wb") as f:
        writer = _KeepsWriteErrors(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise OSError(writer.error.errno, writer.error.strerror, tmp) from None
            raise
    os.replace(tmp, path)


def write_problem(e: BaseException, directory: str, needed: int) -> str:
    """What went wrong writing ``needed`` bytes into ``directory``, in words a user can act on."""
    if not isinstance(e, OSError):
        return str(e)
    code = errno.errorcode.get(e.errno, "")
    said = f"{e.strerror or e} ({code})" if code else str(e.strerror or e)
    said += f" writing {e.filename or directory}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            fs = os.statvfs(directory)
            free = f"{fs.f_bavail * fs.f_frsize / 2**20:.1f} MiB"
        except OSError:
            free = "an unknown amount"
        said += f": this rank's files need about {needed / 2**20:.1f} MiB, and {free} is free there"
    return said


def check_writable(root: str) -> None:
    """The persist dir exists (or can be made) and takes files: found now, at start,
    rather than by every flush failing later."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".ftmem-write-test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"the persistent tier's directory {root!r} (\"ftmem.persist.dir\", Megatron's --save) "
                          f"cannot hold checkpoints ({e.strerror or e}): point it at a directory this user can "
                          f"write.") from e


def flushed(root: str) -> list[dict]:
    """The checkpoints this tier completed under ``root``, oldest first:
    ``{"name": directory name, "version": version}``."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return []


class FlushTimes(NamedTuple):
    """This rank's part of a flush: the bytes it wrote, the seconds the flush took, and how many
    of them the syncs took (0 with ``"fsync": false``)."""

    nbytes: int
    seconds: float
    sync_s: float


class Flusher:
    """One rank's side of the persistent tier. Construction is collective (a gloo group)."""

    def __init__(self, root: str, interval: int, keep: Optional[int], format: FrameworkFormat, rank: int,
                 first_replica: bool, world_size: int, interface: Optional[str], fsync: bool = True):
        """``first_replica``: this rank writes the files its DP replicas hold alike. ``interface``:
        the network the tier's group takes, the engine's (``SnapshotEngine.network_interface``).
        ``fsync``: each flush is durable before it is published (:mod:`ftmem._disk.durable`)."""
        self.root, self.interval, self.keep, self.format, self.rank = root, interval, keep, format, rank
        self.fsync = fsync
        self.first_replica = first_replica
        if world_size > 1:
            open_files.make_room(open_files.needed([world_size], open_files.FLUSH),
                                 "the persistent tier's process group")
        self._group = new_group(interface=interface) if world_size > 1 else None
        self._protected = 0
        self._thread: Optional[threading.Thread] = None
        self.last_flush: Optional[FlushTimes] = None  # this rank's part of the last flush, for benchmarks
        self.flushed_version: Optional[int] = None  # the newest version this job wrote to disk
        self._failure: Optional[str] = None  # why the last flush failed, until one succeeds
        check_writable(root)

    def due(self, asked: bool) -> bool:
        """Called once per protected version, in the same order on every rank: whether to
        flush it — ``asked`` for this version by the adapter, or the interval-th one."""
        self._protected += 1
        return asked or (self.interval > 0 and self._protected % self.interval == 0)

    def close(self) -> None:
        """Destroy the tier's gloo group and let go of it (the engine is closed: no flush follows)."""
        destroy_groups(self._group)
        self._group = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, version: int, state: Any) -> None:
        self._thread = threads.start(self._flush, "ftmem-flush", (version, state))

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def raise_failure(self) -> None:
        """Raise if the last flush failed: what it was to write is in memory only."""
        if self._failure is not None:
            raise FtmemError(self._failure)

    def _flush(self, version: int, state: Any) -> None:
        try:
            self._write_and_publish(version, state)
        except Exception as e:  # a collective broke (a peer died mid-flush): recorded, never a dead thread
            self._record_failure(version, f"the flush stopped: {e}")

    def _write_and_publish(self, version: int, state: Any) -> None:
        """Every rank writes its files into a staging directory; rank 0 publishes them once
        every rank wrote, and every rank learns whether it did. Each step's failure is
        agreed on, so that the ranks run the same collectives and reach the same verdict."""
        name = self.format.checkpoint_name(version, state)
        staging = os.path.join(self.root, f".{name}.tmp")
        started = reported = time.monotonic()

        def progress(nbytes: int) -> None:
            nonlocal reported
            testhooks.at("mid_flush", self.rank, version)
            now = time.monotonic()
            if now - reported >= PROGRESS_EVERY_S:
                reported = now
                rank_info(self.rank, "flushing version %d: %.1f MiB written, %.2f GB/s", version,
                          written.nbytes / 2**20, written.nbytes / (now - started) / 1e9)

        written, sync_s = Written(staging, progress), 0.0
        problem = None
        if self.rank == 0:  # staging made once, and marked as ftmem's, before any rank writes into it
            try:
                shutil.rmtree(staging, ignore_errors=True)  # a flush of the same name killed midway
                _remove_leftovers(self.root)  # those of other names
                make_staging(staging)
            except OSError as e:
                problem = f"rank 0: {write_problem(e, staging, 0)}"
        problem = self._first_problem(problem)
        if problem is None:
            try:
                os.makedirs(staging, exist_ok=True)  # where the persist dir is not one file system for all nodes
                self.format.write_rank(state, staging, self.rank, self.first_replica, written)
                sync_s = written.sync() if self.fsync else 0.0
            except Exception as e:  # a disk problem must not kill training: memory still protects it
                problem = f"rank {self.rank}: {write_problem(e, staging, sum(t.nbytes for t in tensors(state)))}"
                rank_error(self.rank, "could not flush version %d to %s: %s", version, staging, problem)
        problem = self._first_problem(problem)
        if problem is None and self.rank == 0:
            try:
                publish(self.root, os.path.basename(staging), name, version, self.format.publish, self.keep,
                        durable=self.fsync)
            except Exception as e:
                problem = f"rank 0 could not publish it: {write_problem(e, self.root, 0)}"
                rank_error(self.rank, "could not publish version %d in %s: %s", version, self.root, problem)
        problem = self._first_problem(problem)
        if problem is not None:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)  # every rank is done with it
            return self._record_failure(version, problem)
        seconds = time.monotonic() - started
        self.last_flush, self.flushed_version, self._failure = FlushTimes(written.nbytes, seconds, sync_s), version, None
        synced = f", {sync_s:.2f} s of it syncing to the disk" if self.fsync else " (not synced: \"fsync\": false)"
        rank_info(self.rank, "flushed version %d to %s: %.1f MiB in %.2f s (%.2f GB/s)%s", version,
                  os.path.join(self.root, name), written.nbytes / 2**20, seconds,
                  written.nbytes / max(seconds, 1e-9) / 1e9, synced)

    def _first_problem(self, problem: Optional[str]) -> Optional[str]:
        """The first problem any rank of the tier has, on every rank (collective)."""
        return first_problem(problem, self._group)

    def _record_failure(self, version: int, why: str) -> None:
        """What it was to write is in memory only: :meth:`raise_failure` says so from now on."""
        try:
            done = flushed(self.root)
            newest = done[-1]["name"] if done else "no checkpoint"
        except (OSError, ValueError) as e:  # the directory gone or replaced, the manifest damaged
            newest = f"whatever it held (its manifest cannot be read: {getattr(e, 'strerror', None) or e})"
        self._failure = (f"the persistent tier could not write version {version} to {self.root} ({why}); {newest} "
                         f"stays the newest on disk. Fix the disk, or export the version from memory with "
                         f"`ftmem export`.")
        job_info("version %d was not flushed (%s); %s stays the newest on disk", version, why, newest)


def make_staging(path: str) -> None:
    """Make the directory a checkpoint is written into before :func:`publish` (and its
    parents), marked as ftmem's: a leftover of it is removed by the next flush."""
    os.makedirs(path)
    write_atomically(os.path.join(path, STAGING_MARK), b"", durable=False)  # (a mark lost leaves a leftover, no harm)


def _remove_leftovers(root: str) -> None:
    """Remove the staging directories that flushes killed midway left in ``root``: only
    those ftmem marked as its own."""
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        leftover = entry.startswith(".") and entry.endswith(".tmp")
        if leftover and os.path.isdir(path) and not os.path.islink(path) and \
                os.path.exists(os.path.join(path, STAGING_MARK)):
            shutil.rmtree(path, ignore_errors=True)


def publish(root: str, staging: str, name: str, version: int, point_at: Callable[[str, str], None],
            keep: Optional[int], durable: bool = True) -> None:
    """Make the complete directory ``<root>/<staging>`` the checkpoint ``<root>/<name>``:
    rename it, point the framework at it (``point_at(root, name)``), record it in the
    manifest and delete the oldest beyond ``keep`` (None: keep all). ``durable``: each step
    is on the disk before the next one (:mod:`ftmem._disk.durable`; the staging directory's
    files were synced already)."""
    final = os.path.join(root, name)
    if os.path.isdir(final):  # the same version written again (a restarted job): the new one wins
        aside = os.path.join(root, f".{name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(os.path.join(root, staging), final)
        shutil.rmtree(aside)
    else:
        os.rename(os.path.join(root, staging), final)
    os.unlink(os.path.join(final, STAGING_MARK))
    if durable:
        sync(root)
    point_at(root, name)
    done = [c for c in flushed(root) if c["name"] != name] + [{"name": name, "version": version}]
    retired, kept = (done[:-keep], done[-keep:]) if keep else ([], done)
    # The manifest first: a kill in between must leave it naming directories that exist
    # (a restart that memory cannot serve loads its newest entry), at worst a stale one on disk.
    write_atomically(os.path.join(root, MANIFEST), json.dumps(kept).encode(), durable=durable)
    for old in retired:
        shutil.rmtree(os.path.join(root, old["name"]), ignore_errors=True)
