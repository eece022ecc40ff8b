"""Where a load from memory spends its time, as the adapter benchmarks report it (issue 17).

The breakdown is one rank's (:class:`ftmem._engine.restore.RestoreTimes`, which the restore also
logs). Beside it, measured in the same run, what copying into fresh memory costs on this
machine against copying into memory already touched: a restore hands out fresh private
tensors, so its copy pays a page fault per page of them, and on a VM those faults can
cost several times the copy itself. The default engine's load pays the same faults
(``torch.load`` reads into fresh memory too).
"""
from __future__ import annotations

import time

import torch

from ftmem._engine.restore import RestoreTimes

PHASES = ("agree", "rebuild", "copy", "gather_wait")
PROBE_BYTES = 256 << 20  # above glibc's mmap threshold: every fresh buffer is new pages
KEYS = tuple(f"ftmem_restore_{phase}_s" for phase in PHASES) + ("copy_fresh_gbps", "copy_touched_gbps")


def figures(times: RestoreTimes) -> dict:
    """The breakdown as figures: ``ftmem_restore_<phase>_s``."""
    return {f"ftmem_restore_{phase}_s": getattr(times, f"{phase}_s") for phase in PHASES}


def copy_bandwidths(repeat: int = 3) -> dict:
    """GB/s of a copy into fresh memory and into memory already touched (best of ``repeat``)."""
    source = torch.ones(PROBE_BYTES, dtype=torch.uint8)
    touched = source.clone()

    def best(copy) -> float:
        took = []
        for _ in range(repeat):
            began = time.perf_counter()
            copy()
            took.append(time.perf_counter() - began)
        return PROBE_BYTES / min(took) / 1e9

    return {"copy_fresh_gbps": best(lambda: torch.empty_like(source).copy_(source)),
            "copy_touched_gbps": best(lambda: touched.copy_(source))}


def describe(f: dict) -> str:
    """One line for a benchmark's output, from :func:`figures` and :func:`copy_bandwidths`."""
    return (f"  ftmem's load from memory (rank 0): agreeing and checking {f['ftmem_restore_agree_s']:.3f} s, "
            f"rebuilding {f['ftmem_restore_rebuild_s']:.3f} s, copying {f['ftmem_restore_copy_s']:.3f} s, "
            f"waiting for the DP gather {f['ftmem_restore_gather_wait_s']:.3f} s; the rest is the engine's start "
            f"and the framework's load. "
            f"A copy runs at {f['copy_fresh_gbps']:.1f} GB/s into fresh memory here, "
            f"{f['copy_touched_gbps']:.1f} GB/s into touched memory (first-touch page faults)")
