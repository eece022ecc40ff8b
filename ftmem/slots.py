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

from .checksum import ALGORITHM, checksum
from .errors import CorruptShard, ShmBudgetError
from .layout import SnapshotPlan
from .parallel import ParallelLayout
from .units import fmt_bytes

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
    layout: Optional[ParallelLayout] = None  # the job's layout when the version was saved


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
    """One rank's slots, markers and seals in a node directory."""

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

    def verify_parity(self, version: int) -> ParityRecord:
        """The version's parity record if its pieces match their checksums; CorruptShard if not."""
        slot = self.parity_held().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no parity for version {version}.")
        try:
            with open(self.parity_marker_path(version, slot), "rb") as f:
                record: ParityRecord = pickle.loads(f.read())
        except Exception as e:
            raise CorruptShard(f"rank {self.rank} version {version}: parity marker unreadable ({e}).") from e
        with self.map_slot(slot, writable=False, kind=PARITY) as mm, memoryview(mm) as whole:
            for i, expected in enumerate(record.checksums):
                start, end = i * record.piece_size, (i + 1) * record.piece_size
                if len(whole) < end or checksum(whole[start:end]) != expected:
                    raise CorruptShard(
                        f"rank {self.rank} version {version}: parity piece {i} in "
                        f"{self.slot_path(slot, PARITY)} does not match its checksum."
                    )
        return record

    def write_commit(self, record: CommitRecord) -> None:
        write_atomically(self.commit_path(record.version, record.slot), pickle.dumps(record, protocol=5))

    def read_commit(self, version: int) -> CommitRecord:
        slot = self.committed().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} holds no committed version {version} in {self.node_dir}.")
        with open(self.commit_path(version, slot), "rb") as f:
            raw = f.read()
        try:
            return pickle.loads(raw)
        except Exception as e:
            raise CorruptShard(f"rank {self.rank} version {version}: commit marker unreadable ({e}).") from e

    # -- checksums ---------------------------------------------------------
    def seal(self, version: int) -> Optional[dict]:
        """Compute and store the checksums of a committed version; None if it vanished."""
        try:
            slot = self.committed()[version]
            with open(self.commit_path(version, slot), "rb") as f:
                marker = f.read()
            record: CommitRecord = pickle.loads(marker)
            with self.map_slot(slot, writable=False) as mm:
                data = checksum(memoryview(mm)[: record.plan.nbytes])
        except (KeyError, FileNotFoundError):
            return None  # overwritten by a newer save meanwhile: nothing to seal
        seal = {"algorithm": ALGORITHM, "nbytes": record.plan.nbytes, "data": data, "commit": checksum(marker)}
        if version in self.committed():
            write_atomically(self.seal_path(version), json.dumps(seal).encode())
        else:
            unlink_if_present(self.seal_path(version))
        return seal

    def read_seal(self, version: int) -> Optional[dict]:
        try:
            with open(self.seal_path(version), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"unreadable": True}

    def verify(self, version: int) -> CommitRecord:
        """Return the version's record if its bytes match its seal; raise CorruptShard if not."""
        seal = self.read_seal(version)
        if seal is None or seal.get("unreadable"):
            raise CorruptShard(f"rank {self.rank} version {version}: no readable checksum (seal) in {self.node_dir}.")
        slot = self.committed().get(version)
        if slot is None:
            raise CorruptShard(f"rank {self.rank} version {version}: commit marker missing.")
        with open(self.commit_path(version, slot), "rb") as f:
            marker = f.read()
        if checksum(marker) != seal["commit"]:
            raise CorruptShard(f"rank {self.rank} version {version}: commit marker does not match its checksum.")
        record: CommitRecord = pickle.loads(marker)
        with self.map_slot(slot, writable=False) as mm:
            if len(mm) < seal["nbytes"] or checksum(memoryview(mm)[: seal["nbytes"]]) != seal["data"]:
                raise CorruptShard(
                    f"rank {self.rank} version {version}: data in {self.slot_path(slot)} does not match its checksum."
                )
        return record

    # -- memory ------------------------------------------------------------
    def map_slot(self, slot: int, writable: bool, kind: str = DATA) -> mmap.mmap:
        with open(self.slot_path(slot, kind), "r+b" if writable else "rb") as f:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=prot)

    def allocate(self, nbytes: int, parity_nbytes: int) -> None:
        """Grow both data slots to ``nbytes`` and both parity slots to ``parity_nbytes``,
        reserving the pages now.

        The budget counts two versions of data and parity, so a shared-memory
        filesystem that is too small fails here, at the first save, with the
        numbers, and not with SIGBUS in the middle of training.
        """
        growth = {kind: max(0, want - self.capacity(kind)) for kind, want in ((DATA, nbytes), (PARITY, parity_nbytes))}
        needed = NUM_SLOTS * sum(growth.values())
        if needed == 0:
            return
        st = os.statvfs(self.node_dir)
        free = st.f_bavail * st.f_frsize
        message = (
            f"shared memory too small: rank {self.rank} needs {fmt_bytes(needed)} more in {self.node_dir} "
            f"({NUM_SLOTS} versions x ({fmt_bytes(nbytes)} data + {fmt_bytes(parity_nbytes)} parity)), "
            f"but that filesystem has {fmt_bytes(free)} free. Enlarge it (docker run --shm-size=..., "
            f"or mount -o remount,size=... {os.path.dirname(os.path.dirname(os.path.dirname(self.node_dir)))}) "
            f"or set \"shm_dir\" to a larger tmpfs."
        )
        if needed > free:
            raise ShmBudgetError(message)
        for kind, size in ((DATA, nbytes), (PARITY, parity_nbytes)):
            if not growth[kind]:
                continue
            for slot in range(NUM_SLOTS):
                fd = os.open(self.slot_path(slot, kind), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise ShmBudgetError(f"{message} (allocation failed: {e.strerror})") from e
                finally:
                    os.close(fd)


def unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
