"""Shard checksums. xxh3-64 runs at >20 GB/s per core here and releases the GIL."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum(buffer) -> str:
    """Hex digest of a bytes-like object (bytes, memoryview, mmap slice)."""
    return xxhash.xxh3_64_hexdigest(buffer)
