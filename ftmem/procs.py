"""Process liveness checks that see through zombies (a killed SMP whose parent has
not reaped it yet still answers ``kill(pid, 0)``)."""
from __future__ import annotations

from typing import Optional


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state letter follows the parenthesised command name.
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")


def process_start(pid: int) -> Optional[int]:
    """When the process started (clock ticks since boot): with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def process_state(pid: int) -> Optional[str]:
    """The state letter /proc shows for a process (R, S, D, T stopped, Z ...); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode()


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def read_pid(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0) or None
    except (FileNotFoundError, ValueError):
        return None
