"""Joining a collective that some ranks may never call, with a bounded wait.

Reading every rank's part of a snapshot is a collective, but the code that triggers it
is not always called on every rank: DeepSpeed's ``load_checkpoint`` reads on all ranks,
while a user's script may call zero_to_fp32 on rank 0 only. Entered by one rank alone,
a gloo collective waits for the others until the group's timeout (30 minutes) and
leaves a receive pending. So each rank first checks in on the job's store and waits,
bounded, for the others. The outcome is decided once, atomically (``compare_set``), and
every rank follows it, whenever it arrives: all go into the collective, or all raise
:class:`~ftmem.errors.CollectiveNotJoined`. A rank that comes late to an abandoned
rendezvous raises at once instead of waiting for ranks that have given up.
"""
from __future__ import annotations

import itertools

import torch.distributed as dist

from ftmem._common.agreement import Decision
from ftmem._common.collective import TIMEOUT_ENV, collective_timeout_s
from ftmem.errors import CollectiveNotJoined

_GO, _ABANDONED = "go", "abandoned"
_calls = itertools.count()  # every rank joins the same rendezvous in the same order


def everyone_joins(what: str, advice: str) -> None:
    """Return once every rank of the job has called this (its n-th call on each rank
    meets the others' n-th); raise CollectiveNotJoined, naming the ranks that did not
    come, if some did not within :func:`collective_timeout_s`. ``what`` names the
    collective, ``advice`` says what to do instead."""
    # On the default store, whose prefix is the launch attempt's: the call counter names the rest.
    decision = Decision(dist.distributed_c10d._get_default_store(), f"ftmem/rendezvous/{next(_calls)}",
                        dist.get_rank(), dist.get_world_size())
    timeout_s = collective_timeout_s()
    if decision.arrive() == decision.world_size:
        held = decision.propose(_GO)
    else:
        held = decision.wait(timeout_s) or decision.propose(_ABANDONED)
    if held == _GO:
        # The last rank through takes the rendezvous's keys off the store: no rank waits on
        # them any more. (An abandoned one keeps its few keys: a late rank reads the answer.)
        if decision.read() == decision.world_size:
            decision.forget()
        return
    missing = decision.missing()
    raise CollectiveNotJoined(
        f"{what} is a collective: every rank of the job must make it at the same point, as load_checkpoint does, "
        f"but {'ranks ' + str(missing) if missing else 'some ranks'} did not within {timeout_s:g} s "
        f"({TIMEOUT_ENV} sets the wait). {advice}")
