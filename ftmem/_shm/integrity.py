"""Integrity: a version's bytes checked against the checksums its writer took.

The rank's copy thread checksums the slot bytes of a version right after copying them
(:func:`ftmem._state.checksum.data_checksum`), before the commit marker exists, and keeps the
checksum in the commit record; each parity holder checksums the pieces it encoded before
writing the parity marker (a piece that copies one member's data carries that member's
checksum, taken where the bytes were written); and every marker carries a checksum of its
own payload (:mod:`ftmem._shm.slots`). A version therefore never counts as committed without a checksum
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

from ftmem._state.checksum import checksum, data_checksum
from ftmem.errors import CorruptShard
from ftmem._shm.slots import DATA, PARITY, CommitRecord, ParityRecord, RankStore


# A rank's own mapping of its slot files (:meth:`ftmem._shm.slot_memory.SlotMemory.bytes_of`):
# restore checks a version's bytes through the mapping it then copies them out of, so each
# page is mapped in once, not once per pass plus an unmap.
SlotMapping = Callable[[int, str], torch.Tensor]


# A part of a slot file to check: (start, end, the digest its writer took of it).
Span = tuple[int, int, Callable[[memoryview], str]]


def _checksums(store: RankStore, slot: int, kind: str, spans: list[Span], what: str,
               mapping: Optional[SlotMapping] = None) -> list[str]:
    """The digest of each span of a slot file, read through ``mapping`` if given, else
    through a mapping of its own; CorruptShard if the file is missing, empty or shorter
    than the spans."""
    path = store.slot_path(slot, kind)
    end = max(e for _, e, _ in spans)
    try:
        if mapping is not None:
            mapped = mapping(slot, kind).numpy()
            # A mapping made earlier in this process may outlast a truncation of its file.
            _enough(min(len(mapped), os.stat(path).st_size), end, path, what)
            return [digest(mapped[start:stop]) for start, stop, digest in spans]
        with store.map_slot(slot, writable=False, kind=kind) as mm, memoryview(mm) as whole:
            _enough(len(whole), end, path, what)
            return [digest(whole[start:stop]) for start, stop, digest in spans]
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
    (data,) = _checksums(store, record.slot, DATA, [(0, record.plan.nbytes, data_checksum)], what, mapping)
    if data != record.checksum:
        raise CorruptShard(f"{what}: data in {store.slot_path(record.slot)} does not match its checksum.")
    return record


def check_parity(store: RankStore, record: ParityRecord, mapping: Optional[SlotMapping] = None) -> ParityRecord:
    """``record`` (read from an intact marker) if its pieces match their checksums; CorruptShard if not.

    A piece that copies one member's data carries that member's data checksum, so its
    first bytes, as many as that member's data, are checked as data; the zeros after them
    never reach a rebuild (:func:`ftmem._ec.protect.decode_member` cuts a member's bytes to its
    length)."""
    what = f"rank {store.rank} version {record.version}"
    piece = record.piece_size
    if len(record.copy_of) != len(record.checksums) or not all(-1 <= src < len(record.lengths) for src in record.copy_of):
        raise CorruptShard(f"{what}: the parity marker does not fit itself (copies {list(record.copy_of)} for "
                           f"{len(record.checksums)} pieces in a group of {len(record.lengths)} members).")
    spans = [(i * piece, i * piece + record.lengths[src], data_checksum) if src >= 0
             else (i * piece, (i + 1) * piece, checksum) for i, src in enumerate(record.copy_of)]
    got = _checksums(store, record.slot, PARITY, spans, what, mapping)
    for i, (digest, expected) in enumerate(zip(got, record.checksums)):
        if digest != expected:
            raise CorruptShard(f"{what}: parity piece {i} in {store.slot_path(record.slot, PARITY)} does not match "
                               f"its checksum.")
    return record
