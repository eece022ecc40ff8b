"""Storage: one rank's versions in its node's shared-memory directory.

Each rank owns three data slot files (or two: ``"slots"``) and two parity slot files:
the newest protected version's, the one being protected, and the newest copy (see
:mod:`ftmem._engine.commit`). Version v is visible only through
its commit marker, written atomically (temporary name, then rename) after all of
v's bytes are in the slot; the marker holds the checksum of those bytes, taken by the
writer before the marker exists, so no version ever counts as committed without one.
With erasure coding, the parity slots hold the parity pieces this rank keeps for its EC
group's versions, apart from the data slots: only the protected version and the one being
protected have parity. Files::

    rank00003.slot0 / .slot1 / .slot2          raw tensor bytes of one version each
    rank00003.v000000000012.s1.commit          marker: the skeleton, byte plan and data checksum
                                               of v12, in slot 1
    rank00003.parity0 / rank00003.parity1      parity pieces of one version each
    rank00003.v000000000012.s0.parity          marker: parity of v12 in parity slot 0, the EC geometry (k, m, nodes, piece size,
                                               members' lengths), members' commit records,
                                               checksums of the pieces

Every marker starts with a checksum of its own payload (:func:`ftmem._state.checksum.with_checksum`):
a marker that is missing, empty, torn or flipped reads as :class:`CorruptShard`, never as
a record. The payload is JSON of the record's fields under a format version
(:func:`encode_record`), never a pickle: shared memory is writable by whoever planted
files there before the job's checks, and reading a marker must run no code.

Before a slot is overwritten, the marker of the version it held is removed, so a
process killed mid-copy leaves a slot that no marker points at: the torn version is
invisible and the other slot's version is untouched.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import mmap
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ftmem.config import DATA_SLOTS
from ftmem._state.checksum import checked, with_checksum
from ftmem.errors import CorruptShard, ShmBudgetError
from ftmem._common.units import fmt_bytes
from ftmem._shm.private import open_private, read_private, unlink_if_present, write_atomically

if typing.TYPE_CHECKING:
    from ftmem._state.plan import SnapshotPlan
    from ftmem._common.parallel import ParallelLayout

DATA, PARITY = "slot", "parity"
PARITY_SLOTS = 2  # the protected version's and the one being protected
_MARKER_RE = re.compile(r"^rank(\d{5})\.v(\d{12})\.s(\d)\.(commit|parity)$")
# Bumped whenever a record's fields change meaning: a reader refuses what it does not know.
# 2: a commit record's checksum is ftmem._state.checksum.data_checksum (of chunks), no longer one xxh3.
# 3: a skeleton names each tensor by a call of ftmem._state.serialize.tensor_reference, no longer by a persistent id.
# 4: a parity record says which of its pieces copy one member's data (k = 1), and carries that member's checksum for them.
# 5: a commit record names its save (uid) and timeline; its lineage is a VersionRef, no longer (job, version).
# 6: a skeleton is two pickles, where its references go among the tensors, then the state, whose
#    references are calls of ftmem._state.serialize.next_tensor (taking the tensors in order).
RECORD_FORMAT = 6


@dataclass(frozen=True)
class VersionRef:
    """One saved version, told apart from every other of the same number: an earlier run of
    the same command into the same save dir saves the same numbers again."""

    job: str  # the job that saved it
    version: int
    uid: str  # of that save: the saving run's id and the save's place in that run (CommitRecord.uid)
    # The line of training it belongs to: named by the run that started it from scratch (or
    # from a disk checkpoint), carried on by every restart that resumes from memory.
    timeline: str


@dataclass(frozen=True)
class CommitRecord:
    """What a commit marker holds: enough to rebuild the rank's state from its slot."""

    version: int
    rank: int
    slot: int
    plan: SnapshotPlan
    skeleton: bytes
    layout: Optional[ParallelLayout] = None  # the job's parallel layout when the version was saved
    format: Optional[str] = None  # the FrameworkFormat that writes it to disk (ftmem._disk.format), by name
    checksum: Optional[str] = None  # of the slot's bytes in use; set by the writer before the marker exists
    origin: Optional[str] = None  # the job that saved it (ftmem._engine.ownership)
    # Another world's version that this job's line of versions resumed from (ftmem._engine.elastic),
    # carried on by the versions saved after a restore of one of them.
    lineage: Optional[VersionRef] = None
    uid: Optional[str] = None  # VersionRef.uid
    timeline: Optional[str] = None  # VersionRef.timeline

    def ref(self, job: str) -> VersionRef:
        """This version as saved by ``job``."""
        return VersionRef(job, self.version, self.uid, self.timeline)


@dataclass(frozen=True)
class ParityRecord:
    """What a parity marker holds: enough to rebuild any member of the EC column."""

    version: int
    slot: int
    k: int  # the EC geometry the parity was encoded under (a rebuild needs the same)
    m: int
    nodes: tuple[int, ...]  # the group's nodes, by position
    piece_size: int
    lengths: tuple[int, ...]  # data bytes of each member, by position in the group
    records: tuple[CommitRecord, ...]  # each member's commit record, by position
    checksums: tuple[str, ...]  # of the parity pieces this rank holds, in storage order
    # Per piece: the position of the member whose data it copies (k = 1, a plain copy), whose
    # data checksum it then carries (ftmem._shm.integrity.check_parity), or -1 where it is encoded.
    copy_of: tuple[int, ...]


def ranks_in(node_dir: str) -> list[int]:
    """Ranks that have slot files in a node directory."""
    ranks = set()
    for name in os.listdir(node_dir):
        if name.startswith("rank") and ".slot" in name:
            ranks.add(int(name[4:9]))
    return sorted(ranks)


class RankStore:
    """One rank's files in a node directory: their names, which versions the markers say
    are held, and reading and writing markers. Checking slot bytes against the markers'
    checksums is :mod:`ftmem._shm.integrity`; allocating the slots is the SMP's
    (:mod:`ftmem._shm.allocation`)."""

    def __init__(self, node_dir: str, rank: int, data_slots: int = DATA_SLOTS):
        self.node_dir = node_dir
        self.rank = rank
        self.data_slots = data_slots
        self._prefix = os.path.join(node_dir, f"rank{rank:05d}")

    # -- paths -------------------------------------------------------------
    def slot_path(self, slot: int, kind: str = DATA) -> str:
        return f"{self._prefix}.{kind}{slot}"

    def commit_path(self, version: int, slot: int) -> str:
        return f"{self._prefix}.v{version:012d}.s{slot}.commit"

    def parity_marker_path(self, version: int, slot: int) -> str:
        return f"{self._prefix}.v{version:012d}.s{slot}.parity"

    # -- what is held ------------------------------------------------------
    def _markers(self, kind: str) -> dict[int, int]:
        held = {}
        for name in os.listdir(self.node_dir):
            m = _MARKER_RE.match(name)
            if m and int(m.group(1)) == self.rank and m.group(4) == kind:
                held[int(m.group(2))] = int(m.group(3))
        return held

    def committed(self) -> dict[int, int]:
        """Committed versions of this rank, mapped to the slot that holds each."""
        return self._markers("commit")

    def parity_held(self) -> dict[int, int]:
        """Versions this rank holds parity for, mapped to the parity slot."""
        return self._markers("parity")

    def slots(self, kind: str = DATA) -> int:
        return self.data_slots if kind == DATA else PARITY_SLOTS

    def free_slot(self, kind: str = DATA, keep: tuple[int, ...] = ()) -> Optional[int]:
        """A slot of ``kind`` to write next, none of ``keep``: one that holds no version, else
        the one holding the oldest; None if every slot is kept."""
        held = {slot: version for version, slot in self._markers("commit" if kind == DATA else "parity").items()}
        candidates = [s for s in range(self.slots(kind)) if s not in keep]
        empty = [s for s in candidates if s not in held]
        return empty[0] if empty else min(candidates, key=held.__getitem__, default=None)

    def capacity(self, kind: str = DATA) -> int:
        try:
            return min(os.path.getsize(self.slot_path(s, kind)) for s in range(self.slots(kind)))
        except FileNotFoundError:
            return 0

    # -- changes -----------------------------------------------------------
    def drop(self, version: int) -> None:
        """Make a version invisible: its commit and parity markers."""
        slot = self.committed().get(version)
        if slot is not None:
            unlink_if_present(self.commit_path(version, slot))
        self.drop_parity(version)

    def drop_parity(self, version: int) -> None:
        slot = self.parity_held().get(version)
        if slot is not None:
            unlink_if_present(self.parity_marker_path(version, slot))

    def drop_slot(self, slot: int, kind: str = DATA) -> None:
        """Before slot ``slot`` of ``kind`` is overwritten: what it held becomes invisible
        (a version's data and its parity live in slots of their own)."""
        marker = self.commit_path if kind == DATA else self.parity_marker_path
        for version, s in self._markers("commit" if kind == DATA else "parity").items():
            if s == slot:
                unlink_if_present(marker(version, slot))

    def drop_from(self, version: int) -> None:
        """Drop every held version >= ``version`` (an abandoned future after a restore)."""
        for v in set(self.committed()) | set(self.parity_held()):
            if v >= version:
                self.drop(v)

    def protected_path(self) -> str:
        return f"{self._prefix}.protected"

    def write_protected(self, version: int) -> None:
        """Record that the whole job has protected ``version`` (for ``ftmem status``)."""
        self._write_marker(self.protected_path(), str(version).encode(), f"the mark of protected version {version}")

    def read_protected(self) -> Optional[int]:
        """The newest version known protected job-wide, if this rank still holds it."""
        try:
            version = int(read_private(self.protected_path()))
        except (OSError, ValueError):  # missing, or not ours to read (a link)
            return None
        return version if version in self.committed() and version in self.parity_held() else None

    def write_parity(self, record: ParityRecord) -> None:
        self._write_marker(self.parity_marker_path(record.version, record.slot), _marker(record),
                           f"version {record.version}'s parity marker")

    def read_parity(self, version: int) -> ParityRecord:
        """A version's parity record; CorruptShard if there is none, or its marker is damaged."""
        slot = self.parity_held().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no parity for version {version}.")
        return _read_marker(ParityRecord, self.parity_marker_path(version, slot),
                            f"rank {self.rank} version {version}: parity marker")

    def write_commit(self, record: CommitRecord) -> None:
        self._write_marker(self.commit_path(record.version, record.slot), _marker(record),
                           f"version {record.version}'s commit marker")

    def _write_marker(self, path: str, data: bytes, what: str) -> None:
        """Write a marker, a new small file each version: the slots' pages are reserved when they
        grow, the markers' are not, so a file system that something else filled since refuses
        them (ShmBudgetError, saying so; the versions already held are left as they are)."""
        try:
            write_atomically(path, data, private=True)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            st = os.statvfs(self.node_dir)
            raise ShmBudgetError(
                f"shared memory full: rank {self.rank} could not write {what} ({fmt_bytes(len(data))}) into "
                f"{self.node_dir}: its file system has {fmt_bytes(st.f_bavail * st.f_frsize)} free of "
                f"{fmt_bytes(st.f_blocks * st.f_frsize)}, and ftmem's slots were reserved when they grew, so "
                f"something else filled it (df -h, and the largest files there). Free that space, or enlarge the "
                f"file system, and restart the job: the versions this node held are kept, and the restart "
                f"resumes from the newest the whole job holds.") from e

    def read_commit(self, version: int) -> CommitRecord:
        """A committed version's record; CorruptShard if it is not committed, or its marker is damaged."""
        slot = self.committed().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no committed version {version} in {self.node_dir}.")
        return _read_marker(CommitRecord, self.commit_path(version, slot),
                            f"rank {self.rank} version {version}: commit marker")

    # -- memory ------------------------------------------------------------
    def map_slot(self, slot: int, writable: bool, kind: str = DATA) -> mmap.mmap:
        fd = open_private(self.slot_path(slot, kind), os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file


# -- records as JSON ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _record_types() -> dict[str, Any]:
    """The types a record holds beyond JSON's (torch's among them), imported when a record is
    first encoded or decoded. The SMP imports this module for the slots' files alone and never
    gets here: it starts without torch, whose import a restart onto a new node would otherwise
    wait for (2 s and more on a loaded host)."""
    import torch

    from ftmem._common.parallel import ParallelLayout
    from ftmem._state.plan import SnapshotPlan

    return {"torch": torch, "SnapshotPlan": SnapshotPlan, "ParallelLayout": ParallelLayout}


# The last plan written and its JSON: a rank's saves reuse one plan while the state keeps its
# shapes (ftmem._state.plan.Planner), and encoding every entry anew would cost the copy thread,
# GIL held, time at every commit.
_last_plan_json: tuple[Optional[SnapshotPlan], Any] = (None, None)


def _to_json(value: Any) -> Any:
    global _last_plan_json
    types = _record_types()
    if isinstance(value, types["SnapshotPlan"]):
        last = _last_plan_json
        if last[0] is not value:
            last = _last_plan_json = (value, _fields_json(value))
        return last[1]
    if dataclasses.is_dataclass(value):
        return _fields_json(value)
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, bytes):
        # Latin-1 maps each byte to one code point: text stays text in the marker.
        return value.decode("latin-1")
    if isinstance(value, types["torch"].dtype):
        return str(value).removeprefix("torch.")
    return value


def _fields_json(value: Any) -> dict:
    return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}


@functools.lru_cache(maxsize=None)
def _decoder(kind: Any) -> Callable[[Any], Any]:
    """The function that turns parsed JSON into an instance of the type hint ``kind``
    (ValueError if it is not one). Built once per hint: a record holds an entry per tensor,
    and asking ``typing`` about each value's hint again took most of a restart's reading
    of its markers."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:  # Optional[X]
        inner = _decoder(next(a for a in args if a is not type(None)))
        return lambda value: None if value is None else inner(value)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind, localns=_record_types())
        fields = {name: _decoder(hint) for name, hint in hints.items()}

        def instance(value: Any) -> Any:
            if not isinstance(value, dict) or not value.keys() <= fields.keys():
                raise ValueError(f"{kind.__name__} needs an object with the keys {sorted(fields)}, got {value!r:.200}")
            return kind(**{name: fields[name](v) for name, v in value.items()})
        return instance
    if origin is tuple:
        each = _decoder(args[0]) if args[-1] is Ellipsis else None
        items = None if each else [_decoder(a) for a in args]

        def items_of(value: Any) -> tuple:
            if not isinstance(value, list):
                raise ValueError(f"expected a list, got {value!r:.200}")
            if each:
                return tuple(map(each, value))
            if len(items) != len(value):
                raise ValueError(f"expected {len(items)} items, got {len(value)}")
            return tuple(decode(v) for decode, v in zip(items, value))
        return items_of
    if kind is bytes:
        return lambda value: value.encode("latin-1") if isinstance(value, str) else _not_a(kind, value)
    torch = _record_types()["torch"]
    if kind is torch.dtype:
        return lambda value: (getattr(torch, value) if isinstance(value, str) and
                              isinstance(getattr(torch, value, None), torch.dtype) else _not_a(kind, value))
    if kind in (int, str, bool):
        return lambda value: value if type(value) is kind else _not_a(kind, value)
    raise TypeError(f"records cannot hold a {kind!r}")


def _not_a(kind: Any, value: Any):
    raise ValueError(f"expected {getattr(kind, '__name__', kind)}, got {value!r:.200}")


def encode_record(record: Any) -> bytes:
    """A CommitRecord or ParityRecord as JSON, under :data:`RECORD_FORMAT`."""
    return json.dumps({"format": RECORD_FORMAT, "type": type(record).__name__, "fields": _to_json(record)},
                      separators=(",", ":")).encode()


def decode_record(kind: type, payload: bytes) -> Any:
    """The record of type ``kind`` that :func:`encode_record` wrote; ValueError for anything else."""
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not an ftmem record ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or doc.get("type") != kind.__name__:
        raise ValueError(f"not an ftmem {kind.__name__} of format {RECORD_FORMAT}")
    return _decoder(kind)(doc.get("fields"))


def _marker(record) -> bytes:
    return with_checksum(encode_record(record))


def _read_marker(kind: type, path: str, what: str):
    """The record in a marker file; CorruptShard if the file is missing, empty, torn or damaged."""
    try:
        payload = checked(read_private(path))
    except OSError as e:  # removed meanwhile, unreadable, or a symbolic link
        raise CorruptShard(f"{what} {path} cannot be read ({e}).") from e
    if payload is None:
        raise CorruptShard(f"{what} {path} is empty or damaged: it does not match its own checksum.")
    try:
        return decode_record(kind, payload)
    except (ValueError, TypeError) as e:  # intact bytes of another format (an older ftmem, or planted)
        raise CorruptShard(f"{what} {path} is unreadable ({e}).") from e
