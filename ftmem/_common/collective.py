"""The job-wide collectives every part of ftmem uses to make all ranks take the same way
out: gather what each rank has, take the first problem any rank found. A rank that
decides alone (to fall back, to refuse, to stop) while the others go on leaves them
waiting in the next collective; these helpers give every rank the same answer.

Each is a collective over ``group`` (a gloo group of ftmem's, never a framework's);
without a group (one rank) it answers from this rank alone. Those groups are made by
:func:`new_group`, in a bounded time, bound to the network interface the job names for
ftmem's traffic (``"ftmem.network.interface"``) where it names one.
"""
from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Optional, Sequence, TypeVar

import torch.distributed as dist

from ftmem._common import testhooks
from ftmem.config import INTERFACE_ENV, seconds_from_env
from ftmem.errors import CollectiveNotJoined, ConfigError

TIMEOUT_ENV = "FTMEM_COLLECTIVE_TIMEOUT_S"
TIMEOUT_S = 120.0  # how far apart the ranks may arrive at a collective that some may never join
# How long one collective on a group of ftmem's may take once every rank is in it: the
# transfers of a large state over a slow network (gloo's own default).
OPERATION_TIMEOUT = timedelta(minutes=30)
_groups_made = itertools.count(1)  # every rank makes ftmem's groups in the same order
# torch's gloo backend takes its network from GLOO_SOCKET_IFNAME, read as each group is made,
# and ignores new_group's pg_options (torch 2.13's _new_process_group_helper). A backend
# registered under a name of ftmem's makes gloo groups from the pg_options each new_group passes
# it, so that ftmem's groups bind to their own interface while the training's gloo groups keep
# GLOO_SOCKET_IFNAME (setting that variable around ftmem's groups instead would change it for
# whatever else reads it meanwhile). The registration is torch's, for the whole process; the
# interface is not: each group is given its own.
BOUND_GLOO = "ftmem_gloo"

T = TypeVar("T")


def gather(obj: Any, group: Optional[dist.ProcessGroup]) -> list:
    """Every rank's ``obj``, indexed by rank in ``group``."""
    if group is None:
        return [obj]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def first_problem(problem: Optional[T], group: Optional[dist.ProcessGroup]) -> Optional[T]:
    """The problem of the lowest rank that has one (None on every rank if none has)."""
    return next((p for p in gather(problem, group) if p is not None), None)


def all_problems(problem: Optional[T], group: Optional[dist.ProcessGroup]) -> list[T]:
    """Every rank's problem, by rank, those without one left out."""
    return [p for p in gather(problem, group) if p is not None]


def collective_timeout_s() -> float:
    return seconds_from_env(TIMEOUT_ENV, TIMEOUT_S, minimum=1,
                            what="the time a rank waits for the others to join a collective of ftmem's")


def new_group(ranks: Optional[Sequence[int]] = None, *, interface: Optional[str],
              timeout: timedelta = OPERATION_TIMEOUT) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` (all if None), made collectively by every rank of the job,
    in the same order. Its bytes take the network ``interface`` (None: where gloo goes by
    itself, GLOO_SOCKET_IFNAME or the host name's address). Making it waits for every rank
    (torch's store barrier, then gloo's connections) at most :func:`collective_timeout_s`, not
    the group's own ``timeout`` for its operations (30 minutes): a rank that dies or hangs
    during ftmem's start then stops the others in bounded time, with CollectiveNotJoined
    naming the ranks that did not come."""
    options = None if interface is None else _bound_to(interface)
    made = next(_groups_made)
    testhooks.at("new_group", dist.get_rank(), made - 1)
    _arrived(made)
    wait_s = collective_timeout_s()
    try:
        group = dist.new_group(ranks=sorted(ranks) if ranks is not None else None,
                               backend="gloo" if options is None else BOUND_GLOO, pg_options=options,
                               timeout=timedelta(seconds=wait_s))
    except Exception as e:  # torch's store barrier or gloo's connect ran out (DistStoreError, RuntimeError)
        missing = _behind(made)
        who = f"ranks {missing}" if missing else "some ranks"
        raise CollectiveNotJoined(
            f"ftmem's process groups could not be made: {who} did not come within {wait_s:g} s ({TIMEOUT_ENV} sets "
            f"the wait), as a rank that died or hangs during the job's start does. Nothing in shared memory was "
            f"changed; restart the job ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
    if ranks is None or dist.get_rank() in ranks:  # a rank outside the group gets a placeholder
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return group


def _bound_to(interface: str) -> dist.ProcessGroupGloo._Options:
    """The options of a gloo group whose bytes take ``interface`` (for :data:`BOUND_GLOO`)."""
    if BOUND_GLOO not in dist.Backend.backend_list:  # the tensors gloo takes (CUDA's too, copied through the CPU)
        dist.Backend.register_backend(BOUND_GLOO, _make_bound_gloo, extended_api=True,
                                      devices=list(dist.Backend.backend_capability[dist.Backend.GLOO]))
    options = dist.ProcessGroupGloo._Options()
    try:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    except RuntimeError as e:  # gloo finds no address on it ("Unable to find address for: <name>")
        raise ConfigError(
            f"ftmem's network interface {interface!r} (\"ftmem.network.interface\", {INTERFACE_ENV}) has no address "
            f"gloo can bind to: give it one, or name an interface that has one "
            f"({' '.join(str(e).split())[:200]}).") from e
    return options


def _make_bound_gloo(made: "dist.distributed_c10d._DistributedBackendOptions",
                     options: dist.ProcessGroupGloo._Options) -> dist.ProcessGroupGloo:
    """torch's gloo backend, made from ``options`` (:func:`_bound_to`) as torch makes it from
    the environment (two threads per device)."""
    options._timeout = made.timeout
    options._threads = 2 * len(options._devices)
    group = dist.ProcessGroupGloo(made.store, made.group_rank, made.group_size, options)
    group.options.global_ranks_in_group = made.global_ranks_in_group
    group.options.group_name = made.group_id
    group._set_sequence_number_for_group()
    return group


def _key(rank: int) -> str:
    return f"ftmem/group_arrivals/{rank}"


def _arrived(made: int) -> None:
    """Say on the job's store that this rank has come to make ftmem's ``made``-th group."""
    dist.distributed_c10d._get_default_store().set(_key(dist.get_rank()), str(made))


def _behind(made: int) -> list[int]:
    """The other ranks that have not come to make the ``made``-th group (as far as the store can tell)."""
    store = dist.distributed_c10d._get_default_store()
    behind = []
    for rank in range(dist.get_world_size()):
        try:
            done = int(store.get(_key(rank))) if store.check([_key(rank)]) else 0
        except Exception:  # the store itself is gone (its host died): nothing to tell
            return []
        if done < made and rank != dist.get_rank():
            behind.append(rank)
    return behind
