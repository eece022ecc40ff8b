"""Process liveness checks that see through zombies (a killed SMP whose parent has
not reaped it yet still answers ``kill(pid, 0)``)."""
from __future__ import annotations

from typing import Optional

from ftmem._shm.private import read_private


def _stat_fields(pid: int) -> Optional[list[bytes]]:
    """The fields of /proc/<pid>/stat after the parenthesised command name (which may hold
    spaces): the state letter first; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def process_state(pid: int) -> Optional[str]:
    """The state letter /proc shows for a process (R, S, D, T stopped, Z ...); None if it is gone."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def pid_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def process_start(pid: int) -> Optional[int]:
    """When the process started (clock ticks since boot): with the pid, it names one process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def read_pid(path: str) -> Optional[int]:
    """The pid in a pid file of shared memory; None if it is missing, a link, or holds no pid."""
    try:
        return int(read_private(path).strip() or 0) or None
    except (OSError, ValueError):
        return None
