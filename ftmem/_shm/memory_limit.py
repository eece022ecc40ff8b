"""The memory limit over the shared memory the SMP reserves: its memory cgroup's (a
container's, a Slurm job's).

A tmpfs page counts against the memory cgroup of the process that first touches it: the SMP,
which reserves the slots' pages (``posix_fallocate``). In a container whose memory limit
leaves less than the slots need, the kernel's OOM killer ends a process of the container
(the largest: a training process, usually) in the middle of the first save, and nothing says
why. So the SMP checks the room the limit leaves before it reserves, as it checks the file
system's free space, and refuses with the numbers instead.

The room is the limit less the working set (the usage less the inactive file cache, which the
kernel takes back before it kills: what a container's eviction counts too), over the cgroup
and each of its ancestors, whose limits hold too; cgroup v2 (``memory.max``) and v1
(``memory.limit_in_bytes``) alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional

CGROUP_ROOT = "/sys/fs/cgroup"
_V1_UNLIMITED = 1 << 62  # v1 says "no limit" with a number near 2**63, rounded to pages


@dataclass(frozen=True)
class Room:
    """What one memory cgroup's limit leaves."""

    cgroup: str  # its directory
    limit_file: str  # memory.max or memory.limit_in_bytes
    limit: int
    working_set: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.working_set)


def tightest() -> Optional[Room]:
    """The limit with the least room over this process's memory cgroup and its ancestors;
    None where none of them is limited (or the process sees no cgroup file system)."""
    return min(_limited(), key=lambda room: room.free, default=None)


def _limited() -> Iterator[Room]:
    root = CGROUP_ROOT
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1's memory hierarchy
            yield from _rooms(os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                              "total_inactive_file")
            return
    for line in lines:
        if line.startswith("0::") and os.path.exists(os.path.join(root, "cgroup.controllers")):  # v2, unified
            yield from _rooms(root, line[3:], "memory.max", "memory.current", "inactive_file")
            return


def _rooms(mount: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> Iterator[Room]:
    """The limited cgroups from ``path`` up to the hierarchy's root."""
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(mount, *parts[:depth])
        limit = _number(os.path.join(directory, limit_file))
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _number(os.path.join(directory, usage_file)) or 0
        yield Room(directory, limit_file, limit, max(0, usage - _stat(directory, inactive_key)))


def _number(path: str) -> Optional[int]:
    """The file's number; None where it is missing (the root of a hierarchy) or says ``max``."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _stat(directory: str, key: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, value = line.split()
                if name == key:
                    return int(value)
    except OSError:
        pass
    return 0
