"""The threads ftmem runs inside the user's training process.

The kernel delivers a signal sent to the process (a scheduler's SIGTERM, a ^C's SIGINT, a
user's SIGUSR1) to any of its threads that does not block it. Delivered to one of ftmem's, it
would not interrupt what the main thread waits in (a sleep, a select, a join), and the handler,
which Python runs on the main thread, would wait for that to end. So each of ftmem's threads
blocks every signal that the process receives from outside, as if ftmem had no threads; those
the kernel raises in the thread itself (a fault in its own code) stay its own.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

# Raised by the kernel in the thread that faults: never blocked (a blocked one kills the process).
_OWN = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, signal.SIGSYS}
#: what ftmem's threads block
FROM_OUTSIDE = frozenset(signal.valid_signals() - _OWN - {signal.SIGKILL, signal.SIGSTOP})


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    """This thread blocks :data:`FROM_OUTSIDE` meanwhile: a thread started within inherits the
    mask from its first instruction on. A signal that comes meanwhile waits for the end."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, FROM_OUTSIDE)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start(target: Callable, name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread of ftmem's, started, blocking :data:`FROM_OUTSIDE`."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _blocked():
        thread.start()
    return thread


def block_signals() -> None:
    """For a pool's ``initializer``: its worker blocks :data:`FROM_OUTSIDE` from here on."""
    signal.pthread_sigmask(signal.SIG_BLOCK, FROM_OUTSIDE)
