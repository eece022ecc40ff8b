"""The job-wide collectives every part of ftmem uses to make all ranks take the same way
out: gather what each rank has, take the first problem any rank found. A rank that
decides alone (to fall back, to refuse, to stop) while the others go on leaves them
waiting in the next collective; these helpers give every rank the same answer.

Each is a collective over ``group`` (a gloo group of ftmem's, never a framework's);
without a group (one rank) it answers from this rank alone. Those groups are made by
:func:`new_group`, in a bounded time, bound to the network interface the job names for
ftmem's traffic (``"ftmem.network.interface"``) where it names one. A collective that ranks
reach on threads of their own (the protection's) waits through :class:`Arrivals`, bounded,
naming the ranks that did not come.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from ftmem._common import compat, open_files, testhooks, threads
from ftmem._common.agreement import Decision
from ftmem._common.job_store import StandingConnection
from ftmem.config import INTERFACE_ENV, seconds_from_env
from ftmem.errors import CollectiveNotJoined, ConfigError, OpenFileLimit

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
# How long a rank waits in a collective of its own before it says on the job's store that it
# came: a collective that every rank reaches within this says nothing on the store at all.
NOTE_AFTER_S = 2.0
# Bytes a second below which a transfer between ranks counts as stuck: far below any network a
# job runs on, a loaded one included.
NETWORK_FLOOR_BYTES_PER_S = 10e6


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


@contextlib.contextmanager
def posted_within(group: dist.ProcessGroup, bound_s: float) -> Iterator[float]:
    """Collectives posted on ``group`` inside time out in gloo itself after ``bound_s`` (gloo
    takes a group's timeout when an operation is posted): one that runs out ends there, so
    that the group can still be destroyed (its destructor joins threads that would otherwise
    wait for the stuck operation all of the group's own timeout). Yields when they were posted."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=bound_s), group)
    try:
        yield time.monotonic()
    finally:
        dist.distributed_c10d._set_pg_timeout(OPERATION_TIMEOUT, group)


class Arrivals:
    """The bounded wait of collectives that ranks reach on threads of their own (the
    protection's rounds; a column's exchanges), which names the ranks that did not come: a rank
    that has waited NOTE_AFTER_S for its n-th collective of the kind says so in a
    :class:`~ftmem._common.agreement.Decision` of that collective on the job's store, and one whose
    wait runs out names the ranks of ``ranks`` that had not. Every rank of ``ranks`` must make the
    same collectives of the kind, in one order.

    It says so over ``connection``, made at the engine's start: when one rank is late, every
    other rank notes it within the same second, and connections made then would all reach the
    store at once (see :class:`~ftmem._common.job_store.StandingConnection`)."""

    def __init__(self, connection: StandingConnection, key: str, rank: int, ranks: Sequence[int]):
        """``key`` names the run and the kind (the decisions' prefix)."""
        self.rank, self.ranks, self._key = rank, list(ranks), key.rstrip("/")
        self._connection = connection
        self._made = 0

    def wait(self, works: Sequence[dist.Work], what: str, bound_s: float, posted: float) -> None:
        """Until every one of ``works`` (this rank's part of the collective, posted at
        ``posted`` within ``bound_s``: :func:`posted_within`) is done: CollectiveNotJoined naming
        the ranks that had not come when they ran out; a work that failed sooner (a peer's
        connection closed) raises its own error.

        Each work is waited for once, up to the bound: a gloo send or receive whose wait runs
        out closes its connection to the peer, so a wait cut short at NOTE_AFTER_S could not be
        resumed. The note is made meanwhile on a thread of ftmem's (this wait may run on the
        training thread), joined before this returns, so the connection is never used by two
        threads at once."""
        self._made += 1
        deadline = posted + bound_s
        done = threading.Event()
        note = threads.start(lambda: done.wait(NOTE_AFTER_S) or self._note(), "ftmem-arrivals-note")
        ran_out = False
        try:
            for work in works:
                work.wait(timeout=_until(deadline))
        except RuntimeError:
            if time.monotonic() < deadline:  # it failed: no wait for latecomers
                raise
            ran_out = True
        finally:
            done.set()
            note.join()
        if ran_out:
            raise CollectiveNotJoined(
                f"{what}: {self._named()} did not come within {bound_s:g} s ({TIMEOUT_ENV} sets how far "
                f"apart the ranks may come); they died, hang, or no longer save the same versions. The "
                f"failure detector ends a job whose rank died or hangs; restart the job.")

    def _arrivals(self) -> Decision:
        """The decision of this rank's current collective of the kind."""
        return Decision(self._connection.take(NOTE_AFTER_S), f"{self._key}/{self._made}", self.rank, len(self.ranks),
                        self.ranks)

    def _note(self) -> None:
        try:
            self._arrivals().arrive()
        except Exception:  # no store to say it on (one rank, a store gone): the wait names nobody
            pass

    def _named(self) -> str:
        try:
            return _named(self._arrivals())
        except Exception:  # no connection to the store: nothing to tell
            return "some ranks"


def _until(deadline: float) -> timedelta:
    """A work's wait timeout that ends at ``deadline`` (time.monotonic()) or just after: torch
    counts it in whole milliseconds, and one that ended a fraction before would be taken for a
    work that failed. At least a millisecond: a wait of 0 has no bound."""
    return timedelta(milliseconds=max(math.ceil((deadline - time.monotonic()) * 1000), 1))


def gather_bytes(payload: bytes, group: dist.ProcessGroup, arrivals: Arrivals, what: str) -> list[bytes]:
    """Every member's ``payload``, by rank in ``group``, as ``all_gather_object`` gives it for
    bytes but waited for through ``arrivals`` (two all-gathers: the lengths, then the bytes)."""
    members, bound_s = dist.get_world_size(group), collective_timeout_s()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(members)]
    with posted_within(group, bound_s) as posted:
        work = dist.all_gather(lengths, length, group=group, async_op=True)
    arrivals.wait([work], what, bound_s, posted)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(members)]
    with posted_within(group, bound_s) as posted:
        work = dist.all_gather(everyone, mine, group=group, async_op=True)
    arrivals.wait([work], what, bound_s, posted)
    return [bytes(t[: int(n)].numpy()) for t, n in zip(everyone, lengths)]


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
    # On the default store, whose prefix is the launch attempt's (the engine's run has no id yet).
    arrivals = Decision(dist.distributed_c10d._get_default_store(), f"ftmem/group_arrivals/{made}", dist.get_rank(),
                        dist.get_world_size())
    arrivals.arrive()
    wait_s = collective_timeout_s()
    try:
        group = dist.new_group(ranks=sorted(ranks) if ranks is not None else None,
                               backend="gloo" if options is None else BOUND_GLOO, pg_options=options,
                               timeout=timedelta(seconds=wait_s))
    except Exception as e:  # torch's store barrier or gloo's connect ran out (DistStoreError, RuntimeError)
        if open_files.ran_out(e):  # not a rank that did not come
            raise OpenFileLimit(open_files.ran_out_message("ftmem's process groups could not be made")) from e
        who = _named(arrivals)
        raise CollectiveNotJoined(
            f"ftmem's process groups could not be made: {who} did not come within {wait_s:g} s ({TIMEOUT_ENV} sets "
            f"the wait), as a rank that died or hangs during the job's start does. Nothing in shared memory was "
            f"changed; restart the job ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
    if ranks is None or dist.get_rank() in ranks:  # a rank outside the group gets a placeholder
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return group


def _bound_to(interface: str) -> dist.ProcessGroupGloo._Options:
    """The options of a gloo group whose bytes take ``interface`` (for :data:`BOUND_GLOO`)."""
    compat.require_for(compat.GLOO_BINDING, "torch")
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


def _named(arrivals: Decision) -> str:
    """The ranks that did not come to ``arrivals``, in words (as far as the store can tell)."""
    try:
        missing = arrivals.missing()
    except Exception:  # the store itself is gone (its host died): nothing to tell
        missing = []
    return f"ranks {missing}" if missing else "some ranks"
