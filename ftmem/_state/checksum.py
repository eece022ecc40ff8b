"""Checksums: of shard bytes, and of the markers that describe them. xxh3-64 is among the
fastest non-cryptographic hashes and releases the GIL."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import xxhash

from ftmem._common import threads

_DIGEST_CHARS = 16  # an xxh3-64 hex digest, zero-padded


def checksum(buffer) -> str:
    """Hex digest of a bytes-like object (bytes, memoryview, mmap slice, contiguous array)."""
    return xxhash.xxh3_64_hexdigest(buffer)


# A version's data is checksummed in chunks of this size by a few threads at once: on one
# core, the checksum of a large snapshot takes longer than its copy, and a save waits for
# the previous one's checksum.
DATA_CHUNK = 64 << 20
_DATA_THREADS = min(4, os.cpu_count() or 1)
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _hashers() -> ThreadPoolExecutor:
    """This process's checksum threads (a forked child gets its own: it inherits none)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = ThreadPoolExecutor(_DATA_THREADS, thread_name_prefix="ftmem-checksum",
                                                  initializer=threads.block_signals), os.getpid()
        return _pool


def data_checksum(buffer) -> str:
    """Hex digest of a version's data (a contiguous bytes-like object): xxh3-64 of the
    xxh3-64 digests of its :data:`DATA_CHUNK`-byte chunks, which threads take at once."""
    return data_checksum_and_cpu(buffer)[0]


def data_checksum_and_cpu(buffer) -> tuple[str, float]:
    """:func:`data_checksum`, and the CPU seconds the checksum threads spent on it (0 where
    the calling thread took the one chunk itself: its own CPU time counts that)."""
    whole = memoryview(buffer).cast("B")
    chunks = [whole[start : start + DATA_CHUNK] for start in range(0, len(whole), DATA_CHUNK)]
    if len(chunks) > 1:
        digests, seconds = zip(*_hashers().map(_digest_and_cpu, chunks))
        cpu = sum(seconds)
    else:
        digests, cpu = [xxhash.xxh3_64_digest(chunk) for chunk in chunks], 0.0
    return xxhash.xxh3_64_hexdigest(b"".join(digests)), cpu


def _digest_and_cpu(chunk) -> tuple[bytes, float]:
    began = time.thread_time()
    return xxhash.xxh3_64_digest(chunk), time.thread_time() - began


def with_checksum(payload: bytes) -> bytes:
    """``payload`` behind its own checksum, so that a reader tells a damaged file from an
    intact one without any other record (:func:`checked`)."""
    return checksum(payload).encode() + payload


def checked(raw: bytes) -> Optional[bytes]:
    """The payload of what :func:`with_checksum` wrote, or None if it does not match its checksum."""
    digest, payload = raw[:_DIGEST_CHARS], raw[_DIGEST_CHARS:]
    return payload if len(raw) > _DIGEST_CHARS and digest == checksum(payload).encode() else None
