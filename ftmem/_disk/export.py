"""``ftmem export``: write a version the SMPs hold to disk in the framework's own
checkpoint layout, on demand — e.g. before a planned shutdown, or to keep a version
that is about to be overwritten.

Export reads shared memory only, so it works whether the training processes are
alive, killed or gone (:mod:`ftmem._shm.held`): each rank's data comes from its node's slots (checked against
their checksums), and the DP-sharded replicated state is joined back from the
replicas' slices. It reads one rank at a time, so it holds about one rank's state in
memory. Every node directory of the job must be visible in the shared-memory
directory (one host's virtual nodes, or node directories gathered there); a lost
node's ranks are rebuilt from parity by a restarted job, not by export.

The layout on disk is the framework's: every version names its
:class:`~ftmem._disk.format.FrameworkFormat` in its commit record, whose ``write_group`` writes
one DP group's files and whose ``publish`` points the framework at the result. The directory is written under a temporary name and renamed when complete, as the
persistent tier's flushes are (:func:`ftmem._disk.persist.publish`). Unless forced, export
refuses, before it reads the version's data or writes anything, an output directory that
already holds the checkpoint directory or a pointer file it would replace.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional, TextIO

from ftmem._shm.held import HeldJob
from ftmem.errors import CorruptShard, FtmemError
from ftmem._disk.durable import Written
from ftmem._disk.format import FrameworkFormat, format_named
from ftmem._disk.persist import make_staging, publish
from ftmem._state.serialize import join_state
from ftmem._shm.slots import CommitRecord


@dataclass
class Exported:
    path: str
    version: int
    nbytes: int  # bytes written
    seconds: float


class Progress:
    """A progress bar over the bytes read from shared memory (at most every rank's), with
    what is written so far and the rate; redrawn in place on a terminal, a line per 10%
    otherwise."""

    WIDTH = 30

    def __init__(self, total: int, out: TextIO = sys.stderr):
        self.total, self.out = max(total, 1), out
        self.read = self.written = 0
        self.started = time.monotonic()
        self._tty = out.isatty()
        self._last_tenth = -1

    def add(self, read: int = 0, written: int = 0) -> None:
        self.read += read
        self.written += written
        fraction = min(self.read / self.total, 1.0)
        if not self._tty and int(fraction * 10) == self._last_tenth:
            return
        self._last_tenth = int(fraction * 10)
        filled = int(fraction * self.WIDTH)
        rate = self.written / max(time.monotonic() - self.started, 1e-9) / 1e9
        line = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction:4.0%}  read {self.read / 2**20:.1f} of "
                f"{self.total / 2**20:.1f} MiB, written {self.written / 2**20:.1f} MiB, {rate:.2f} GB/s")
        self.out.write(("\r" + line) if self._tty else line + "\n")
        self.out.flush()

    def end(self) -> None:
        """The last line, at 100%: ``total`` counts every rank's bytes, and a format may need
        fewer (Megatron's file of a DP group holds DP rank 0's state alone, most often)."""
        if 0 < self.read < self.total:
            self.total, self._last_tenth = self.read, -1
            self.add()
        if self._tty:
            self.out.write("\n")


def export(shm_dir: str, job: str, out: str, version: Optional[int] = None,
           progress_to: TextIO = sys.stderr, force: bool = False) -> Exported:
    """Write ``version`` of ``job`` (default: the newest every rank holds) into ``out``
    in the framework's layout; returns where, what and how fast. ``force``: replace the
    checkpoint directory and pointer files ``out`` already holds (refused otherwise)."""
    held = HeldJob(shm_dir, job)
    version, first = held.choose(version)
    writer = _format_of(first)
    if os.path.exists(out) and not os.path.isdir(out):
        raise FtmemError(f"--out {out!r} is a file: name a directory to write the checkpoint into (it is created if "
                         f"missing).")
    if not force:
        _refuse_to_replace(out, writer.checkpoint_name(version, join_state(first.skeleton, _NoTensors())), writer,
                           version)
    try:
        records = held.verified(version)
    except CorruptShard as e:
        raise FtmemError(f"job {job} version {version} cannot be exported: {e} Export an older version "
                         f"(--version), or restart the job to rebuild it from parity.") from e
    progress = Progress(sum(r.plan.nbytes for r in records.values()), progress_to)

    def read_state(rank: int) -> Any:
        state = held.read_state(records, rank)
        progress.add(read=records[rank].plan.nbytes)
        return state

    staging = f".export-v{version}.tmp"
    shutil.rmtree(os.path.join(out, staging), ignore_errors=True)  # an export that was interrupted
    try:
        make_staging(os.path.join(out, staging))  # and out, if missing
    except OSError as e:
        raise FtmemError(f"cannot write into --out {out!r} ({e.strerror or e}): name a directory this user can "
                         f"write (it is created if missing).") from e
    started = time.monotonic()
    written = Written(os.path.join(out, staging), lambda nbytes: progress.add(written=nbytes))
    try:
        names = {writer.write_group(group, read_state, written.staging, written) for group in first.layout.dp_groups}
        written.sync()
    finally:
        progress.end()
    name, = names
    publish(out, staging, name, version, writer.publish, keep=None)
    return Exported(os.path.join(out, name), version, progress.written, time.monotonic() - started)


class _NoTensors:
    """Stands in for a version's tensors where only its other values are read (its
    checkpoint name, from the skeleton alone)."""

    def __getitem__(self, index: int) -> None:
        return None


def _refuse_to_replace(out: str, name: str, writer: FrameworkFormat, version: int) -> None:
    """Refuse to export into ``out`` if it holds the checkpoint directory ``name`` or a
    pointer file that publishing would replace. Which files are pointers only the format
    knows (DeepSpeed's ``latest``, Megatron's tracker file): they are found by
    publishing into an empty scratch directory."""
    if not os.path.isdir(out):
        return
    with tempfile.TemporaryDirectory() as scratch:
        writer.publish(scratch, name)
        written = {name, *os.listdir(scratch)}
    clash = sorted(written & set(os.listdir(out)))
    if clash:
        raise FtmemError(f"--out {out!r} already holds {', '.join(clash)}, which exporting version {version} would "
                         f"replace. Name another directory, or pass --force to replace them.")


def _format_of(record: CommitRecord) -> FrameworkFormat:
    """The framework format that writes this version, as its commit record names it."""
    if record.format is None:
        raise FtmemError("this job's snapshots name no framework format to export to (they were saved through "
                         "the engine directly, not through the DeepSpeed or Megatron adapter).")
    return format_named(record.format)
