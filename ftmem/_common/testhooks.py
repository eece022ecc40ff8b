"""Fault-injection points for the crash tests, off unless FTMEM_TEST_HOOK is set.

``FTMEM_TEST_HOOK="<point>:<action>:rank=<r>:version=<v>"`` fires when rank r reaches
``point`` for version v. Actions: ``kill`` SIGKILLs the process; ``stop`` SIGSTOPs it (every
thread of it stops, as a hung host's processes do); ``pause`` creates
``$FTMEM_TEST_HOOK_DIR/paused.rank<r>.v<v>`` and sleeps until the process is killed;
``hold`` creates that file too, and goes on once ``$FTMEM_TEST_HOOK_DIR/resume.rank<r>.v<v>``
exists (the test kills something else meanwhile, an SMP say).
``version=N+`` fires once, at the first version >= N that reaches ``point`` (for points whose
versions depend on timing, as ``before_protect``'s do).
Points (any action at any point; tests/faults/test_fault_matrix.py crosses them):

* ``new_group``     starting the engine (v: the number of ftmem's groups this process has
  made so far): before it makes the next one (ftmem/_common/collective.py);
* ``mid_copy``      saving v: half of the tensors are copied into the slot, no marker;
* ``after_commit``  saving v: right after its commit marker (the copy thread), before any
  parity exists;
* ``before_protect`` protecting v: the job agreed to protect it and every rank holds it
  committed; before the column's exchange (the protection thread, ftmem/_engine/commit.py);
* ``mid_exchange``  saving v with erasure coding: after the column's first all_to_all
  of pieces (ftmem/_ec/protect.py), before its parity is encoded or recorded; also in a
  restore that rebuilt a rank, when the column encodes v's parity again;
* ``mid_flush``     flushing v to disk: once one file of it is written;
* ``mid_restore``   restoring: the job agreed on v (ftmem/_engine/restore.py), before anything
  is rebuilt or a tensor read;
* ``mid_rebuild``   restoring v onto a rank rebuilt from parity: its data is decoded and
  checked, the slot it goes into is emptied, nothing is written into it yet;
* ``finish``        when the job ends (v: its newest version), before the ranks agree
  on freeing its memory;
* ``smp_finished``  in the node's SMP (v: -1): rank r's "finished" is marked, the
  markers not yet counted.
"""
from __future__ import annotations

import os
import signal
import time

_spec = os.environ.get("FTMEM_TEST_HOOK", "")


_fired = False  # a hook for ``version=N+`` fires once


def at(point: str, rank: int, version: int) -> None:
    global _fired
    if not _spec:
        return
    hook_point, action, *conds = _spec.split(":")
    want = dict(c.split("=", 1) for c in conds)
    if hook_point != point or int(want["rank"]) != rank:
        return
    if want["version"].endswith("+"):
        if _fired or version < int(want["version"][:-1]):
            return
        _fired = True
    elif int(want["version"]) != version:
        return
    if action in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    elif action in ("pause", "hold"):
        hook_dir = os.environ["FTMEM_TEST_HOOK_DIR"]
        open(os.path.join(hook_dir, f"paused.rank{rank}.v{version}"), "w").close()
        # "hold" goes on once the test says so (it kills something else meanwhile); "pause" never does.
        resume = os.path.join(hook_dir, f"resume.rank{rank}.v{version}")
        while not (action == "hold" and os.path.exists(resume)):
            time.sleep(0.05 if action == "hold" else 3600)
    else:
        raise ValueError(f"unknown FTMEM_TEST_HOOK action {action!r}")
