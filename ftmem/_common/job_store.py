"""The job's store (torch.distributed's default store): the TCP store under it, whether this
process serves it, and the bounded wait of a rank that must not end before the others read
what it decided. Under torchrun its agent serves the store; under the deepspeed launcher and
plain ``env://`` the process of rank 0 does, and the store ends with that process."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch.distributed as dist

_LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp*
_POLL_S = 0.05


def tcp_store_under(store: dist.Store) -> Optional[dist.TCPStore]:
    """The TCP store under ``store``'s prefixes; None where it is another kind (a file's)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def served_here(store: dist.Store) -> bool:
    """Whether this process listens on the port of the TCP store under ``store``."""
    tcp = tcp_store_under(store)
    if tcp is None:
        return False
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == tcp.port:
                listening.add(f"socket:[{fields[9]}]")
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in listening:
                return True
        except OSError:  # closed since the listing
            continue
    return False


def until_counted(store: dist.Store, key: str, count: int, wait_s: float) -> int:
    """Until the counter ``key`` on ``store`` reaches ``count`` (the ranks that have read a
    decision), at most ``wait_s``; the count reached, which the caller names if it falls short."""
    end = time.monotonic() + wait_s
    while (counted := store.add(key, 0)) < count and time.monotonic() < end:
        time.sleep(_POLL_S)
    return counted
