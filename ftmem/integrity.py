"""Integrity: a version's bytes checked against the checksums its writer took.

The rank's copy thread checksums the slot bytes of a version right after copying them
(:func:`ftmem.checksum.data_checksum`), before the commit marker exists, and keeps the
checksum in the commit record; each parity holder checksums its pieces before writing
the parity marker; and every marker carries a checksum of its own payload
(:mod:`ftmem.slots`). A version therefore never counts as committed without a checksum
of exactly what was written, and nothing computed later from whatever bytes are there
can bless a damaged one.

Restore and export read a version only through :func:`verify` or :func:`check_data`
(data) and :func:`check_parity` (parity pieces). A mismatch, or a slot or marker file that is
missing, empty, short or unreadable, is a :class:`CorruptShard`, which restore treats
as a lost shard (rebuilt from parity, or an older version used), never as data.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from .checksum import checksum, data_checksum
from .errors import CorruptShard
from .slots import DATA, PARITY, CommitRecord, ParityRecord, RankStore


# A rank's own mapping of its slot files (:meth:`ftmem.slot_memory.SlotMemory.bytes_of`):
# restore checks a version's bytes through the mapping it then copies them out of, so each
# page is mapped in once, not once per pass plus an unmap.
SlotMapping = Callable[[int, str], torch.Tensor]


def _checksums(store: RankStore, slot: int, kind: str, spans: list[tuple[int, int]], what: str,
               digest: Callable[[memoryview], str] = checksum, mapping: Optional[SlotMapping] = None) -> list[str]:
    """The ``digest`` of each (start, end) span of a slot file, read through ``mapping`` if
    given, else through a mapping of its own; CorruptShard if the file is missing, empty or
    shorter than the spans."""
    path = store.slot_path(slot, kind)
    end = max(e for _, e in spans)
    try:
        if mapping is not None:
            mapped = mapping(slot, kind).numpy()
            # A mapping made earlier in this process may outlast a truncation of its file.
            _enough(min(len(mapped), os.stat(path).st_size), end, path, what)
            return [digest(mapped[start:stop]) for start, stop in spans]
        with store.map_slot(slot, writable=False, kind=kind) as mm, memoryview(mm) as whole:
            _enough(len(whole), end, path, what)
            return [digest(whole[start:stop]) for start, stop in spans]
    except (OSError, ValueError) as e:  # missing, or empty (mmap refuses a zero-length file)
        raise CorruptShard(f"{what}: {path} cannot be read ({e}).") from e


def _enough(length: int, end: int, path: str, what: str) -> None:
    if length < end:
        raise CorruptShard(f"{what}: {path} holds {length} bytes, fewer than the {end} written.")


def verify(store: RankStore, version: int) -> CommitRecord:
    """The version's record if its marker is intact and its bytes match the writer's
    checksum; CorruptShard if not."""
    return check_data(store, store.read_commit(version))


def check_data(store: RankStore, record: CommitRecord, mapping: Optional[SlotMapping] = None) -> CommitRecord:
    """``record`` (read from an intact marker) if the slot bytes match its checksum; CorruptShard if not."""
    what = f"rank {store.rank} version {record.version}"
    (data,) = _checksums(store, record.slot, DATA, [(0, record.plan.nbytes)], what, data_checksum, mapping)
    if data != record.checksum:
        raise CorruptShard(f"{what}: data in {store.slot_path(record.slot)} does not match its checksum.")
    return record


def check_parity(store: RankStore, record: ParityRecord, mapping: Optional[SlotMapping] = None) -> ParityRecord:
    """``record`` (read from an intact marker) if its pieces match their checksums; CorruptShard if not."""
    what = f"rank {store.rank} version {record.version}"
    piece = record.piece_size
    spans = [(i * piece, (i + 1) * piece) for i in range(len(record.checksums))]
    for i, (got, expected) in enumerate(zip(_checksums(store, record.slot, PARITY, spans, what, mapping=mapping), record.checksums)):
        if got != expected:
            raise CorruptShard(f"{what}: parity piece {i} in {store.slot_path(record.slot, PARITY)} does not match "
                               f"its checksum.")
    return record
