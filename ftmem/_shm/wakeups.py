"""Wake-ups between the ranks of one node, for what they wait for in its shared memory (a
decision's round, the verdict their beater tells them): a waiting rank sleeps on a datagram
socket of its own, and the rank that has news sends it a byte. The sockets are in the abstract
namespace (no file; the name's length is not a directory's), named by the directory the ranks
wait on, so that every rank of the node names them alike (the node's ranks share a network
namespace, as they share memory). A wake-up is a hint, never the news: a rank not waiting yet
misses it, so a waiting rank also looks on its own, as often as its caller bounds each wait.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import time
from typing import Callable, Iterable, Iterator

from ftmem._common.logs import log


class Wakeups:
    """The wake-ups of the node's ranks that wait on the directory ``directory``."""

    def __init__(self, directory: str, kind: str):
        digest = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:32]
        self._prefix = f"\0ftmem-{kind}-{digest}"

    def _address(self, rank: int) -> str:
        return f"{self._prefix}-{rank}"

    @contextlib.contextmanager
    def waiting(self, rank: int, unwoken_s: float = math.inf) -> Iterator[Callable[[float], None]]:
        """While ``rank`` waits: a wait of at most some seconds, which a wake-up ends. Where its
        socket's name is taken (another process's), a sleep of at most ``unwoken_s`` (by default
        the whole wait: the rank then looks only as often as its caller does)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
            try:
                wake.bind(self._address(rank))
            except OSError as e:
                log.debug("rank %d: no wake-up socket (%s): it looks on its own", rank, e)
                yield lambda seconds: time.sleep(min(seconds, unwoken_s))
                return

            def woken(seconds: float) -> None:
                wake.settimeout(seconds)
                try:
                    wake.recv(16)
                except socket.timeout:
                    pass
            yield woken

    def wake(self, ranks: Iterable[int]) -> None:
        """Wake ``ranks`` where they wait; a rank that does not (not yet, or done) looks on its own."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            waker.setblocking(False)  # (a rank whose wake-ups queue up is awake: it reads the news)
            for rank in ranks:
                try:
                    waker.sendto(b"!", self._address(rank))
                except OSError:
                    pass
