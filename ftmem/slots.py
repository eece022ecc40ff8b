"""Storage: one rank's versions in its node's shared-memory directory.

Each rank owns two slot files (double buffering). Version v is visible only through
its commit marker, written atomically (temporary name, then rename) after all of
v's bytes are in the slot; the SMP later adds a seal holding the checksums. With
erasure coding, each data slot has a parity slot beside it, holding the parity
pieces this rank keeps for its EC group's version in that slot. Files::

    rank00003.slot0 / rank00003.slot1          raw tensor bytes of one version each
    rank00003.v000000000012.s1.commit          marker: the skeleton and byte plan of v12, in slot 1
    rank00003.v000000000012.seal               checksums of v12 (JSON), written by the SMP
    rank00003.parity0 / rank00003.parity1      parity pieces, for the version in the same slot
    rank00003.v000000000012.s1.parity          marker: piece size, group members' lengths and
                                               commit records, checksums of the pieces

Before a slot is overwritten, the marker of the version it held is removed, so a
process killed mid-copy leaves a slot that no marker points at: the torn version is
invisible and the other slot's version is untouched.
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import re
from dataclasses import dataclass
from typing import Optional

from .errors import CorruptShard
from .plan import SnapshotPlan
from .parallel import ParallelLayout

NUM_SLOTS = 2
DATA, PARITY = "slot", "parity"
_MARKER_RE = re.compile(r"^rank(\d{5})\.v(\d{12})\.s(\d)\.(commit|parity)$")


def write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class CommitRecord:
    """What a commit marker holds: enough to rebuild the rank's state from its slot."""

    version: int
    rank: int
    slot: int
    plan: SnapshotPlan
    skeleton: bytes
    layout: Optional[ParallelLayout] = None  # the job's parallel layout when the version was saved
    format: Optional[str] = None  # the FrameworkFormat that writes it to disk (ftmem.format), by name


@dataclass(frozen=True)
class ParityRecord:
    """What a parity marker holds: enough to rebuild any member of the EC column."""

    version: int
    slot: int
    piece_size: int
    lengths: tuple[int, ...]  # data bytes of each member, by position in the group
    records: tuple[bytes, ...]  # each member's pickled CommitRecord, by position
    checksums: tuple[str, ...]  # of the parity pieces this rank holds, in storage order


def ranks_in(node_dir: str) -> list[int]:
    """Ranks that have slot files in a node directory."""
    ranks = set()
    for name in os.listdir(node_dir):
        if name.startswith("rank") and ".slot" in name:
            ranks.add(int(name[4:9]))
    return sorted(ranks)


class RankStore:
    """One rank's files in a node directory: their names, which versions the markers say
    are held, and reading and writing markers and seals. Checking bytes against seals is
    :mod:`ftmem.integrity`; allocating the slots is the SMP's (:mod:`ftmem.allocation`)."""

    def __init__(self, node_dir: str, rank: int):
        self.node_dir = node_dir
        self.rank = rank
        self._prefix = os.path.join(node_dir, f"rank{rank:05d}")

    # -- paths -------------------------------------------------------------
    def slot_path(self, slot: int, kind: str = DATA) -> str:
        return f"{self._prefix}.{kind}{slot}"

    def commit_path(self, version: int, slot: int) -> str:
        return f"{self._prefix}.v{version:012d}.s{slot}.commit"

    def parity_marker_path(self, version: int, slot: int) -> str:
        return f"{self._prefix}.v{version:012d}.s{slot}.parity"

    def seal_path(self, version: int) -> str:
        return f"{self._prefix}.v{version:012d}.seal"

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

    def free_slot(self) -> int:
        """The slot to write next: never the one holding the newest committed version."""
        held = self.committed()
        if not held:
            return 0
        return 1 - held[max(held)]

    def capacity(self, kind: str = DATA) -> int:
        try:
            return min(os.path.getsize(self.slot_path(s, kind)) for s in range(NUM_SLOTS))
        except FileNotFoundError:
            return 0

    # -- changes -----------------------------------------------------------
    def drop(self, version: int) -> None:
        """Make a version invisible: markers first, then its seal."""
        slot = self.committed().get(version)
        if slot is not None:
            unlink_if_present(self.commit_path(version, slot))
        self.drop_parity(version)
        unlink_if_present(self.seal_path(version))

    def drop_parity(self, version: int) -> None:
        slot = self.parity_held().get(version)
        if slot is not None:
            unlink_if_present(self.parity_marker_path(version, slot))

    def drop_slot(self, slot: int) -> None:
        """Before slot ``slot`` (data and parity) is overwritten: drop what it held."""
        for version, s in self.committed().items():
            if s == slot:
                self.drop(version)
        for version, s in self.parity_held().items():
            if s == slot:
                self.drop_parity(version)

    def drop_from(self, version: int) -> None:
        """Drop every held version >= ``version`` (an abandoned future after a restore)."""
        for v in set(self.committed()) | set(self.parity_held()):
            if v >= version:
                self.drop(v)

    def protected_path(self) -> str:
        return f"{self._prefix}.protected"

    def write_protected(self, version: int) -> None:
        """Record that the whole job has protected ``version`` (for ``ftmem status``)."""
        write_atomically(self.protected_path(), str(version).encode())

    def read_protected(self) -> Optional[int]:
        """The newest version known protected job-wide, if this rank still holds it."""
        try:
            with open(self.protected_path()) as f:
                version = int(f.read())
        except (FileNotFoundError, ValueError):
            return None
        return version if version in self.committed() and version in self.parity_held() else None

    def write_parity(self, record: ParityRecord) -> None:
        write_atomically(self.parity_marker_path(record.version, record.slot), pickle.dumps(record, protocol=5))

    def read_parity(self, version: int) -> tuple[int, bytes]:
        """(parity slot, raw parity marker) of a version; CorruptShard if there is none."""
        slot = self.parity_held().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no parity for version {version}.")
        return slot, read_bytes(self.parity_marker_path(version, slot))

    def write_commit(self, record: CommitRecord) -> None:
        write_atomically(self.commit_path(record.version, record.slot), pickle.dumps(record, protocol=5))

    def read_marker(self, version: int) -> tuple[int, bytes]:
        """(slot, raw commit marker) of a committed version; CorruptShard if it is not committed."""
        slot = self.committed().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no committed version {version} in {self.node_dir}.")
        return slot, read_bytes(self.commit_path(version, slot))

    def read_commit(self, version: int) -> CommitRecord:
        _, raw = self.read_marker(version)
        try:
            return pickle.loads(raw)
        except Exception as e:
            raise CorruptShard(f"rank {self.rank} version {version}: commit marker unreadable ({e}).") from e

    def write_seal(self, version: int, seal: dict) -> None:
        write_atomically(self.seal_path(version), json.dumps(seal).encode())

    def read_seal(self, version: int) -> Optional[dict]:
        try:
            return json.loads(read_bytes(self.seal_path(version)))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"unreadable": True}

    # -- memory ------------------------------------------------------------
    def map_slot(self, slot: int, writable: bool, kind: str = DATA) -> mmap.mmap:
        with open(self.slot_path(slot, kind), "r+b" if writable else "rb") as f:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=prot)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
