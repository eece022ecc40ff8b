"""Room for ftmem's own open files under the process's open-file limit (RLIMIT_NOFILE).

Each gloo group ftmem makes holds a socket per peer and a few descriptors of its own, and a
rank holds a connection to its SMP and to the job's store: a job of many ranks adds hundreds
of descriptors to each training process. Without room for them, gloo fails deep inside a
group's making ("epoll_create: Too many open files"), which reads like a peer that never came,
or the training runs out of descriptors later, where it did not without ftmem.

So before ftmem makes its groups, :func:`make_room` raises the soft limit by what they take,
as far as the hard limit allows, so that the training keeps the room it had; where the hard
limit leaves no room for them at all, it stops the job at its start, saying how far to raise
the limit, with nothing in shared memory changed yet.
"""
from __future__ import annotations

import errno
import os
import resource
from typing import Sequence

from ftmem._common.logs import log
from ftmem.errors import OpenFileLimit

# What one gloo group takes besides a socket per peer (its device's event loop and wakeups),
# what an engine holds besides its groups (the SMP's socket, the store connections, the
# segments it maps), and what a flush holds open: measured on torch 2.13 with 2 to 6 ranks,
# and rounded up.
PER_GROUP = 3
ENGINE = 16
FLUSH = 8


def needed(group_sizes: Sequence[int], besides: int) -> int:
    """About how many descriptors a rank holds for gloo groups of ``group_sizes`` ranks and
    ``besides`` descriptors more."""
    return sum(size - 1 + PER_GROUP for size in group_sizes if size > 1) + besides


def in_use() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_room(need: int, what: str) -> None:
    """Raise the soft open-file limit by ``need`` (for ``what``) as far as the hard limit allows;
    raise :class:`OpenFileLimit` where even the hard limit leaves less than ``need`` free."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    wanted = soft + need  # the training keeps the room it had
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    held = in_use()
    if held + need > raised:
        raise OpenFileLimit(
            f"this process may hold {soft} open files (ulimit -n; its hard limit is "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}) and holds {held}: {what} take about "
            f"{need} more. Raise the limit to at least {held + need} (ulimit -n in the job's script, the "
            f"container's nofile ulimit, LimitNOFILE of a systemd unit); nothing in shared memory was changed.")
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        log.debug("raised the open-file limit from %d to %d for %s", soft, raised, what)


def ran_out(error: BaseException) -> bool:
    """Whether ``error`` (an OSError, or torch's and gloo's RuntimeError) says the process had no
    descriptor left."""
    if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
        return True
    return "Too many open files" in str(error)


def ran_out_message(what: str) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"{what}: this process ran out of open files (it may hold {soft}: ulimit -n). Raise the limit (ulimit "
            f"-n in the job's script, the container's nofile ulimit) and restart the job")
