"""Closing a rank's engine when its process exits, telling a clean end of the job
from a crash: only a clean end may free the job's memory (``close(job_finished=True)``);
after an uncaught exception the snapshots must stay for the restart."""
from __future__ import annotations

import atexit
import sys

from .engine import SnapshotEngine


def close_at_exit(snapshots: SnapshotEngine) -> None:
    crashed = False
    previous_hook = sys.excepthook

    def note_crash(*exc_info):
        nonlocal crashed
        crashed = True
        previous_hook(*exc_info)

    sys.excepthook = note_crash
    atexit.register(lambda: snapshots.close(job_finished=not crashed))
