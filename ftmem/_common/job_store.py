"""The job's store (torch.distributed's default store): the TCP store under it, whether this
process serves it, a connection of a caller's own to it, and the bounded wait of a rank that
must not end before the others read what it decided. Under torchrun its agent serves the
store; under the deepspeed launcher and plain ``env://`` the process of rank 0 does, and the
store ends with that process."""
from __future__ import annotations

import functools
import os
import socket
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ftmem._common.logs import log

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


def own_connection(store: dist.Store, wait_s: float, connect_s: Optional[float] = None) -> dist.Store:
    """A connection of the caller's own to the TCP store under ``store``, whose calls wait at
    most ``wait_s`` and whose connecting at most ``connect_s`` (``wait_s`` where None): a store
    client serves one call at a time, and the training's own calls on the default one (a
    ``get`` of a key a slow rank has not set yet, NCCL's watchdog) may block it for minutes. Its keys are the store's own, outside the
    prefixes ``store`` may add (a launcher's per attempt): callers name theirs by the engine's
    run, new at each start. Where the store is no TCP store (a file's), ``store`` itself.

    Nothing listening at the store's address (its process ended: rank 0 serves it under
    ``env://``) raises :class:`StoreGone` at once, where a store client would try to connect
    again until its timeout."""
    tcp = tcp_store_under(store)
    if tcp is None:
        return store
    connect_s = wait_s if connect_s is None else connect_s
    try:
        socket.create_connection((tcp.host, tcp.port), timeout=connect_s).close()
    except ConnectionRefusedError as e:
        raise StoreGone(f"{store_name(store)} is gone: nothing listens there any more (the process that served "
                        f"it ended)") from e
    connection = dist.TCPStore(tcp.host, tcp.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=connect_s))
    connection.set_timeout(timedelta(seconds=wait_s))
    return connection


class StandingConnection:
    """A connection of this rank's own to the job's store, made ahead of the job-wide decision
    it is for (the job's end, a preemption's: at the engine's start) rather than at it. At the
    decision every rank of the job comes within a second or so, and torch's store looks up the
    address of each new connection by name (a reverse DNS query) on the one thread that serves
    every request: 16,384 ranks connecting at once would hold the store for seconds, longer than
    a preemption's decision may take.

    Made ahead, where nothing waits on it, its making may take up to :data:`AHEAD_CONNECT_S`
    (a store that takes it late: busy with a large job's start, or its serving thread waiting
    on a resolver that dropped the lookup, 5 s by default); the decision's calls keep their own
    bound. It may sit idle for days, and something on the way may drop an idle connection (a
    proxy's or conntrack's idle timeout): :meth:`take` checks it with one request bounded by
    :data:`PROBE_S` and takes a new connection where that fails."""

    def __init__(self, job_store: dist.Store, wait_s: float):
        self._job_store = job_store
        self._connection = own_connection(job_store, wait_s, AHEAD_CONNECT_S)

    @functools.cached_property
    def serves_the_store(self) -> bool:
        """This process serves the store, which ends with it (read off /proc once, where asked)."""
        return served_here(self._job_store)

    def take(self, wait_s: float) -> dist.Store:
        """The connection, each call on it bounded by ``wait_s``, ready for a decision."""
        try:
            self._connection.set_timeout(timedelta(seconds=PROBE_S))
            self._connection.check([_PROBE_KEY])
            self._connection.set_timeout(timedelta(seconds=wait_s))
        except Exception as e:  # dropped on the way (or the store is gone: the new one says so)
            log.debug("ftmem's connection to %s did not answer (%s): taking a new one", store_name(self._job_store), e)
            self._connection = own_connection(self._job_store, wait_s)
        return self._connection


AHEAD_CONNECT_S = 60.0
PROBE_S = 1.0
PROBE_REQUESTS = 1  # what taking it asks of the store
_PROBE_KEY = "ftmem/probe"


def no_answer(e: Exception) -> str:
    """Why a decision of the job's failed where its store failed under it (its first line:
    not torch's C++ frames)."""
    return f"the job's store did not answer ({str(e).splitlines()[0]})"


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
