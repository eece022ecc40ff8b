"""Integrity: a version's bytes checked against the checksums taken when it was sealed.

The SMP seals a committed version off the critical path (:func:`seal`): an xxh3-64 of
the slot's bytes in use and of the commit marker. Restore and export read a version
only through :func:`verify` (data) and :func:`verify_parity` (parity pieces, whose
checksums travel in their own marker); a mismatch is a :class:`CorruptShard`, which
restore treats as a lost shard, never as data.
"""
from __future__ import annotations

import pickle
from typing import Optional

from .checksum import ALGORITHM, checksum
from .errors import CorruptShard
from .slots import PARITY, CommitRecord, ParityRecord, RankStore, unlink_if_present


def _unpickle(raw: bytes, what: str):
    try:
        return pickle.loads(raw)
    except Exception as e:
        raise CorruptShard(f"{what} unreadable ({e}).") from e


def seal(store: RankStore, version: int) -> Optional[dict]:
    """Compute and store the checksums of a committed version; None if it vanished."""
    try:
        slot, marker = store.read_marker(version)
        record: CommitRecord = _unpickle(marker, f"rank {store.rank} version {version}: commit marker")
        with store.map_slot(slot, writable=False) as mm:
            data = checksum(memoryview(mm)[: record.plan.nbytes])
    except (CorruptShard, FileNotFoundError):
        return None  # overwritten by a newer save meanwhile: nothing to seal
    sealed = {"algorithm": ALGORITHM, "nbytes": record.plan.nbytes, "data": data, "commit": checksum(marker)}
    if version in store.committed():
        store.write_seal(version, sealed)
    else:  # overwritten while it was checksummed
        unlink_if_present(store.seal_path(version))
    return sealed


def verify(store: RankStore, version: int) -> CommitRecord:
    """The version's record if its bytes match its seal; CorruptShard if not."""
    sealed = store.read_seal(version)
    if sealed is None or sealed.get("unreadable"):
        raise CorruptShard(f"rank {store.rank} version {version}: no readable checksum (seal) in {store.node_dir}.")
    slot, marker = store.read_marker(version)
    if checksum(marker) != sealed["commit"]:
        raise CorruptShard(f"rank {store.rank} version {version}: commit marker does not match its checksum.")
    record: CommitRecord = _unpickle(marker, f"rank {store.rank} version {version}: commit marker")
    with store.map_slot(slot, writable=False) as mm:
        if len(mm) < sealed["nbytes"] or checksum(memoryview(mm)[: sealed["nbytes"]]) != sealed["data"]:
            raise CorruptShard(
                f"rank {store.rank} version {version}: data in {store.slot_path(slot)} does not match its checksum."
            )
    return record


def verify_parity(store: RankStore, version: int) -> ParityRecord:
    """The version's parity record if its pieces match their checksums; CorruptShard if not."""
    slot, raw = store.read_parity(version)
    record: ParityRecord = _unpickle(raw, f"rank {store.rank} version {version}: parity marker")
    with store.map_slot(slot, writable=False, kind=PARITY) as mm, memoryview(mm) as whole:
        for i, expected in enumerate(record.checksums):
            start, end = i * record.piece_size, (i + 1) * record.piece_size
            if len(whole) < end or checksum(whole[start:end]) != expected:
                raise CorruptShard(
                    f"rank {store.rank} version {version}: parity piece {i} in "
                    f"{store.slot_path(slot, PARITY)} does not match its checksum."
                )
    return record
