"""The job's store (torch.distributed's default store): the TCP store under it, whether this
process serves it, a connection of a caller's own to it, and the bounded wait of a rank that
must not end before the others read what it decided. Under torchrun its agent serves the
store; under the deepspeed launcher and plain ``env://`` the process of rank 0 does, and the
store ends with that process."""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp*
_POLL_S = 0.05


def tcp_store_under(store: dist.Store) -> Optional[dist.TCPStore]:
    """The TCP store under ``store``'s prefixes; None where it is another kind (a file's)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


class StoreGone(RuntimeError):
    """Nothing listens at the job's store's address any more: the process that served it
    ended, and the store with it (it never comes back: a job's store is not restarted)."""


def own_connection(store: dist.Store, wait_s: float) -> dist.Store:
    """A connection of the caller's own to the TCP store under ``store``, whose calls, and
    whose connecting, wait at most ``wait_s``: a store client serves one call at a time, and
    the training's own calls on the default one (a ``get`` of a key a slow rank has not set
    yet, NCCL's watchdog) may block it for minutes. Its keys are the store's own, outside the
    prefixes ``store`` may add (a launcher's per attempt): callers name theirs by the engine's
    run, new at each start. Where the store is no TCP store (a file's), ``store`` itself.

    Nothing listening at the store's address (its process ended: rank 0 serves it under
    ``env://``) raises :class:`StoreGone` at once, where a store client would try to connect
    again until its timeout."""
    tcp = tcp_store_under(store)
    if tcp is None:
        return store
    try:
        socket.create_connection((tcp.host, tcp.port), timeout=wait_s).close()
    except ConnectionRefusedError as e:
        raise StoreGone(f"{store_name(store)} is gone: nothing listens there any more (the process that served "
                        f"it ended)") from e
    return dist.TCPStore(tcp.host, tcp.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=wait_s))


def store_name(store: dist.Store) -> str:
    """The job's store in words, with its address where it has one."""
    tcp = tcp_store_under(store)
    return f"the job's store ({tcp.host}:{tcp.port})" if tcp is not None else "the job's store"


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
