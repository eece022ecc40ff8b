"""Fault-injection points for the crash tests, off unless FTMEM_TEST_HOOK is set.

``FTMEM_TEST_HOOK="<point>:<action>:rank=<r>:version=<v>"`` fires once when rank r
reaches ``point`` while saving version v:

* ``mid_copy:pause``     after half of the tensors are copied, create
  ``$FTMEM_TEST_HOOK_DIR/paused.rank<r>.v<v>`` and sleep until killed;
* ``after_commit:kill``  SIGKILL this process right after the commit marker of v;
* ``mid_flush:kill``     SIGKILL it once its flush of v to disk has written one file.
"""
from __future__ import annotations

import os
import signal
import time

_spec = os.environ.get("FTMEM_TEST_HOOK", "")


def at(point: str, rank: int, version: int) -> None:
    if not _spec:
        return
    hook_point, action, *conds = _spec.split(":")
    want = dict(c.split("=", 1) for c in conds)
    if hook_point != point or int(want["rank"]) != rank or int(want["version"]) != version:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "pause":
        marker = os.path.join(os.environ["FTMEM_TEST_HOOK_DIR"], f"paused.rank{rank}.v{version}")
        open(marker, "w").close()
        while True:
            time.sleep(3600)
    else:
        raise ValueError(f"unknown FTMEM_TEST_HOOK action {action!r}")
