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
