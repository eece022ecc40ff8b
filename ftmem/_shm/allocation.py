"""Allocating a rank's slot files: the SMP's job, never a training process's.

The SMP grows the slots when a rank asks (its first save, or a bigger state), after
checking that the shared-memory filesystem can hold them, and reserves the pages at
once: a filesystem that is too small, or a memory limit (a container's) that leaves too
little room, fails at the first save with the numbers, not with SIGBUS or the OOM killer in
the middle of training (:mod:`ftmem._shm.memory_limit`).
"""
from __future__ import annotations

import os
from typing import Optional

from ftmem.errors import ShmBudgetError
from ftmem._shm import memory_limit
from ftmem._shm.private import open_private
from ftmem.config import SLOT_CHOICES
from ftmem._shm.slots import DATA, PARITY, RankStore
from ftmem._common.units import fmt_bytes


def allocate(store: RankStore, nbytes: int, parity_nbytes: int, node_ranks: int = 1,
             budget: Optional[int] = None) -> None:
    """Grow every data slot of ``store`` to ``nbytes`` and every parity slot to
    ``parity_nbytes``, after checking that the node's ``node_ranks`` ranks, each as large, fit
    the job's ``budget`` (bytes of the node's shared memory; None: no budget but the
    filesystem's free space). At the rank's first allocation, where three data slots do not
    fit the budget and two do, ``store.data_slots`` becomes 2; later, nothing held is
    dropped to make room: a state grown beyond the budget is refused."""
    if budget is not None:
        _fit_budget(store, nbytes, parity_nbytes, node_ranks, budget)
    growth = {kind: max(0, want - store.capacity(kind)) for kind, want in ((DATA, nbytes), (PARITY, parity_nbytes))}
    needed = sum(store.slots(kind) * grown for kind, grown in growth.items())
    if needed == 0:
        return
    st = os.statvfs(store.node_dir)
    free = st.f_bavail * st.f_frsize
    message = (
        f"shared memory too small: rank {store.rank} needs {fmt_bytes(needed)} more in {store.node_dir} "
        f"({store.slots(DATA)} versions x {fmt_bytes(nbytes)} data + {store.slots(PARITY)} x "
        f"{fmt_bytes(parity_nbytes)} parity), "
        f"but that filesystem has {fmt_bytes(free)} free. Enlarge it (docker run --shm-size=..., "
        f"or mount -o remount,size=... {os.path.dirname(os.path.dirname(os.path.dirname(store.node_dir)))}) "
        f"or set \"shm_dir\" to a larger tmpfs"
        + (f", or keep two versions (\"slots\": 2, --ftmem-slots 2: a save that comes while an older one is "
           f"protected is then skipped)." if store.slots(DATA) > 2 else ".")
    )
    if needed > free:
        raise ShmBudgetError(message)
    room = memory_limit.tightest()
    if room is not None and needed > room.free:
        raise ShmBudgetError(
            f"shared memory counts against the memory limit of {room.cgroup} ({room.limit_file}: "
            f"{fmt_bytes(room.limit)}, of which {fmt_bytes(room.working_set)} in use), and rank {store.rank} needs "
            f"{fmt_bytes(needed)} more ({store.slots(DATA)} versions x {fmt_bytes(nbytes)} data + "
            f"{store.slots(PARITY)} x {fmt_bytes(parity_nbytes)} parity) than the {fmt_bytes(room.free)} it leaves: "
            f"the kernel would kill a process of the job for it. Raise the memory limit (a Kubernetes container's "
            f"resources.limits.memory, docker run --memory, Slurm's --mem) by at least "
            f"{fmt_bytes(needed - room.free)} for this rank (each rank of the node reserves its own)"
            + (", or keep two versions (\"slots\": 2, --ftmem-slots 2)." if store.slots(DATA) > 2 else ".")
            + " Nothing held in memory was changed.")
    for kind, size in ((DATA, nbytes), (PARITY, parity_nbytes)):
        if not growth[kind]:
            continue
        for slot in range(store.slots(kind)):
            fd = open_private(store.slot_path(slot, kind), os.O_RDWR | os.O_CREAT)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ShmBudgetError(f"{message} (allocation failed: {e.strerror})") from e
            finally:
                os.close(fd)


def _fit_budget(store: RankStore, nbytes: int, parity_nbytes: int, node_ranks: int, budget: int) -> None:
    """Check the node's slots against ``budget``: two data slots where three do not fit at
    the rank's first allocation, else ShmBudgetError with the numbers and the knobs."""
    def node_bytes(slots: int) -> int:
        return node_ranks * (slots * nbytes + store.slots(PARITY) * parity_nbytes)

    first = not any(os.path.exists(store.slot_path(s)) for s in range(max(SLOT_CHOICES)))
    if node_bytes(store.data_slots) <= budget:
        return
    if first and store.data_slots > min(SLOT_CHOICES) and node_bytes(min(SLOT_CHOICES)) <= budget:
        store.data_slots = min(SLOT_CHOICES)
        return
    slots = store.data_slots if not first else min(SLOT_CHOICES)
    raise ShmBudgetError(
        f"the job's shared memory does not fit its budget: node {store.node_dir} needs {fmt_bytes(node_bytes(slots))} "
        f"({node_ranks} rank(s) x ({slots} versions x {fmt_bytes(nbytes)} data + {store.slots(PARITY)} x "
        f"{fmt_bytes(parity_nbytes)} parity)), but \"shm_budget\" (--ftmem-shm-budget) allows it {fmt_bytes(budget)}. "
        f"Raise the budget (a share of the shared-memory filesystem, \"90%\", or a size), give the job more nodes "
        f"(less state per rank), or a larger k (less parity). Nothing held in memory was changed.")
