"""Restoring a version: agree job-wide on the newest version every rank can recover,
rebuild what lost nodes held from their EC column's parity, gather DP-sharded state
back from the replicas, and hand out private tensors.

Everything here is collective. A restore runs at restart, on the training thread, with
the DP gather in a thread beside its copy; the persistent tier's flush reads a version
through :meth:`Restorer.copy_out` too, on whichever thread flushes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ftmem._shm import integrity
from ftmem._common import testhooks, threads
from ftmem._state.reader import read_from_slot
from ftmem._state.destinations import destinations, saved_shape
from ftmem.errors import CorruptShard, FtmemError, LayoutMismatch, NotRecoverableFromMemory
from ftmem._common.collective import all_problems, gather
from ftmem._common.logs import rank_info, rank_warning
from ftmem._common.parallel import ParallelLayout
from ftmem._state.plan import SnapshotPlan
from ftmem._ec.protect import ColumnCoder, Geometry, Topology, with_slot
from ftmem._engine.recovery import choose_intact, rebuilt_problem
from ftmem._state.serialize import join_state
from ftmem._shm.slot_memory import SlotMemory
from ftmem._shm.slots import DATA, PARITY, CommitRecord, ParityRecord, RankStore, VersionRef


@dataclass
class RestoreTimes:
    """Where one rank's restore spent its time, in seconds (ftmem bench reports them)."""

    agree_s: float = 0.0  # choosing the version job-wide, this rank's bytes checked against their checksums
    rebuild_s: float = 0.0  # lost data rebuilt from parity and protected again; 0 with no node lost
    copy_s: float = 0.0  # this rank's own bytes copied out of shared memory into fresh private tensors
    gather_wait_s: float = 0.0  # then waiting for the DP replicas' slices (the gather runs beside the copy)

    @property
    def total_s(self) -> float:
        return self.agree_s + self.rebuild_s + self.copy_s + self.gather_wait_s


@dataclass
class Restored:
    version: int
    state: Any
    rebuilt: bool = False  # this rank's data was rebuilt from its EC group's parity
    times: RestoreTimes = field(default_factory=RestoreTimes)
    lineage: Optional[VersionRef] = None  # the version's CommitRecord.lineage
    uid: Optional[str] = None  # the version's save (CommitRecord.uid)
    timeline: Optional[str] = None  # the version's CommitRecord.timeline


def off_timeline(data: dict[int, CommitRecord], parity: dict[int, ParityRecord], timeline: str) -> set[int]:
    """The versions among held ``data`` and ``parity`` records that are not of ``timeline``."""
    return ({v for v, record in data.items() if record.timeline != timeline}
            | {v for v, record in parity.items() if any(r.timeline != timeline for r in record.records)})


@dataclass
class Chosen:
    """The version a restore agreed on, checked and rebuilt, not yet copied out (:meth:`Restorer.choose`)."""

    record: CommitRecord  # this rank's record of it
    rebuilt: bool  # this rank's data was rebuilt from its EC group's parity
    times: RestoreTimes
    _saved: Any = None

    @property
    def version(self) -> int:
        return self.record.version

    @property
    def saved(self) -> Any:
        """The version's state with a :class:`~ftmem._state.destinations.TensorPlace` for each
        saved tensor: what it holds, for the caller to name tensors to restore into (and to
        read its small values, such as the args it was saved with) before anything is copied."""
        if self._saved is None:
            self._saved = saved_shape(self.record.skeleton, len(self.record.plan.entries))
        return self._saved


@dataclass(frozen=True)
class DataParallelPeers:
    """This rank's DP replicas, as restore needs them to join DP-sharded state."""

    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup]  # gloo, None when the rank has no replica
    sharded: bool  # whether saves keep only this replica's slice of the replicated state


def gather_replicated(plan: SnapshotPlan, slot_bytes: torch.Tensor, peers: DataParallelPeers,
                      into: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The whole replicated stream, from every DP replica's slice (collective over the DP
    group). An entry with a tensor in ``into`` ends up in that tensor, gathered straight into
    it where every replica has one for it; its bytes of the returned stream are then never
    written (so never paged in)."""
    shard = plan.shard
    if not peers.sharded or shard.count != len(peers.ranks):
        raise LayoutMismatch(f"this version is DP-sharded over {shard.count} replicas, but the job now has "
                             f"DP sharding {'on' if peers.sharded else 'off'} over {len(peers.ranks)}.")
    mine = frozenset(i for i, e in enumerate(plan.entries) if e.replicated and into[i] is not None and e.nbytes)
    everyone = gather((shard.stream_nbytes, mine), peers.group)
    sizes = [size for size, _ in everyone]
    if len(set(sizes)) != 1:
        raise FtmemError(f"the replicas {list(peers.ranks)} saved different replicated state "
                         f"(stream sizes {sizes}): every replica must mark the same tensors replicated.")
    # Each replica broadcasts its slice straight into place: on gloo, D broadcasts
    # move the bytes about twice as fast as one all_gather, and need no staging. A slice
    # goes in pieces where entries have tensors of their own to land in; every broadcast
    # is a collective, so only at entries that every replica has such a tensor for.
    agreed = frozenset.intersection(*(held for _, held in everyone))
    own = sorted((plan.entries[i].offset, plan.entries[i].offset + plan.entries[i].nbytes, i) for i in agreed)
    stream = torch.empty(shard.stream_nbytes, dtype=torch.uint8)
    for d, src in enumerate(peers.ranks):
        start, end = shard.stream_nbytes * d // shard.count, shard.stream_nbytes * (d + 1) // shard.count
        for lo, hi, i in _pieces(start, end, own):
            target = stream[lo:hi] if i is None else \
                _bytes_of(into[i])[lo - plan.entries[i].offset: hi - plan.entries[i].offset]
            if d == shard.index:
                target.copy_(slot_bytes[shard.offset + lo - start: shard.offset + hi - start])
            dist.broadcast(target, src=src, group=peers.group)
    for i in mine - agreed:
        _bytes_of(into[i]).copy_(stream[plan.entries[i].offset: plan.entries[i].offset + plan.entries[i].nbytes])
    return stream


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, written without autograd (it may be a parameter)."""
    return t.detach().view(-1).view(torch.uint8)


def _pieces(start: int, end: int, own: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, Optional[int]]]:
    """Stream bytes [start, end) cut into (lo, hi, entry index) at the byte ranges of ``own``
    (sorted, disjoint): index None for what lies between them."""
    at = start
    for lo, hi, i in own:
        lo, hi = max(lo, start), min(hi, end)
        if lo >= hi:
            continue
        if at < lo:
            yield at, lo, None
        yield lo, hi, i
        at = hi
    if at < end:
        yield at, end, None


class Restorer:
    def __init__(self, store: RankStore, memory: SlotMemory, topology: Topology, column: Optional[ColumnCoder],
                 gloo: Optional[dist.ProcessGroup], peers: DataParallelPeers, layout: ParallelLayout):
        self.store, self.memory = store, memory
        self.topology, self._column, self._gloo = topology, column, gloo
        self.peers, self.layout = peers, layout

    @property
    def rank(self) -> int:
        return self.store.rank

    def forget_groups(self, peers: DataParallelPeers) -> None:
        """The engine closed and destroyed its groups: hold none of them (see engine._end_groups)."""
        self._gloo, self.peers = None, peers

    def held(self) -> tuple[dict[int, CommitRecord], dict[int, ParityRecord]]:
        """Held versions whose markers are intact: data and parity records. Their bytes are
        checked only once a restore is about to use them (:meth:`_check`), so a restart reads
        one version's bytes, not every held version's."""
        data, parity = {}, {}
        for v in sorted(self.store.committed()):
            try:
                data[v] = self.store.read_commit(v)
            except CorruptShard as e:
                self._lose_data(v, e, data, parity)
        for v in sorted(self.store.parity_held()):
            try:
                parity[v] = self.store.read_parity(v)
            except CorruptShard as e:
                self._lose_parity(v, e, parity)
        return data, parity

    # A damaged, missing or empty file loses its version on this rank, like a lost node:
    # damaged data takes the rank's parity of that version with it.
    def _lose_data(self, version: int, why: CorruptShard, data: dict, parity: dict) -> None:
        rank_warning(self.rank, "%s Treating it as lost.", why)
        self.store.drop(version)
        data.pop(version, None)
        parity.pop(version, None)

    def _lose_parity(self, version: int, why: CorruptShard, parity: dict) -> None:
        rank_warning(self.rank, "%s Treating it as lost.", why)
        self.store.drop_parity(version)
        parity.pop(version, None)

    def _check(self, version: int, data: dict, parity: dict, parity_needed: bool) -> bool:
        """Check this rank's bytes of ``version`` against their checksums (its parity too, when
        the restore rebuilds from it); whether any was damaged and is now dropped."""
        damaged = False
        try:
            if version in data:
                integrity.check_data(self.store, data[version], self.memory.bytes_of)
        except CorruptShard as e:
            self._lose_data(version, e, data, parity)
            damaged = True
        try:
            if parity_needed and version in parity:
                integrity.check_parity(self.store, parity[version], self.memory.bytes_of)
        except CorruptShard as e:
            self._lose_parity(version, e, parity)
            damaged = True
        return damaged

    def _choose_version(self, version: Optional[int], data: dict, parity: dict) -> Optional[tuple[int, list[int], list]]:
        """The job's choice (:func:`ftmem._engine.recovery.choose_intact`) from every rank's held
        versions, with the chosen version's bytes checked on every rank; a rank with damaged
        bytes drops them and the job chooses again. Returns None, or (chosen, to_rebuild, every
        rank's held)."""
        held = []

        def every_rank_s() -> tuple[list, list]:
            held[:] = gather(({v: r.plan.nbytes for v, r in data.items()},
                              {v: Geometry.of(p) for v, p in parity.items()}), self._gloo)
            return [d for d, _ in held], [p for _, p in held]

        def damaged(chosen: int, to_rebuild: list[int]) -> bool:
            return any(gather(self._check(chosen, data, parity, parity_needed=bool(to_rebuild)), self._gloo))

        decision = choose_intact(self.topology, every_rank_s, damaged, version)
        return None if decision is None else (*decision, held)

    def choose(self, version: Optional[int], timeline: Optional[str] = None) -> Optional[Chosen]:
        """The restore's first phase (collective): agree job-wide on the version (``version``,
        else the newest every rank can recover; of ``timeline`` only, where it is given), rebuild
        what lost nodes held from parity, and check its layout. Nothing is copied out yet: the
        caller may name the tensors to restore into from :attr:`Chosen.saved` before :meth:`read`.
        None if no rank holds a version. See :meth:`ftmem.SnapshotEngine.restore` for what it raises."""
        times, began = RestoreTimes(), time.perf_counter()
        on_entry = set(self.store.committed()) | set(self.store.parity_held())
        data, parity = self.held()
        if timeline is not None:  # the others are left as they are, neither candidates nor dropped
            for v in off_timeline(data, parity, timeline):
                data.pop(v, None)
                parity.pop(v, None)
                on_entry.discard(v)
        decision = self._choose_version(version, data, parity)
        times.agree_s = time.perf_counter() - began
        if decision is None:
            self._refuse_a_fresh_start(sorted(on_entry))
            return None
        chosen, to_rebuild, held = decision
        # The crash tests' "mid-restore": the job agreed on ``chosen``; nothing rebuilt or read yet.
        testhooks.at("mid_restore", self.rank, chosen)
        began = time.perf_counter()
        if to_rebuild:
            problem = None
            column_rebuilds = self._column is not None and any(r in to_rebuild for r in self._column_ranks())
            if column_rebuilds:
                problem = self._rebuild(chosen, held, data, parity)
            # Every rank takes the same way out, or the next collective would hang.
            problems = all_problems(problem, self._gloo)
            if problems:
                raise NotRecoverableFromMemory(f"version {chosen} cannot be rebuilt from memory: "
                                               f"{'; '.join(problems)}. Fall back to a disk checkpoint.")
            data = {chosen: integrity.verify(self.store, chosen)} if self.rank in to_rebuild else data
            stored = column_rebuilds and self._protect_rebuilt(data[chosen],
                                                               self.rank in to_rebuild or chosen not in parity)
            # For `ftmem status`: protected again once every rank holds its parity of it.
            if all(gather(chosen in parity or stored, self._gloo)) and \
                    (self.store.read_protected() or 0) < chosen:
                self.store.write_protected(chosen)
        times.rebuild_s = time.perf_counter() - began
        record = data[chosen]
        mismatch = record.layout and self.layout.mismatch(record.layout)
        if mismatch:
            raise LayoutMismatch(f"version {chosen} was saved under another parallel layout ({mismatch}). "
                                 f"Restart with the layout it was saved with, or restore from a disk checkpoint.")
        return Chosen(record=record, rebuilt=self.rank in to_rebuild, times=times)

    def read(self, chosen: Chosen, device: torch.device, into: Any = None, drop_newer: bool = True) -> Restored:
        """The restore's second phase (collective over the DP group): copy the chosen version
        out of shared memory into the tensors ``into`` names (:mod:`ftmem._state.destinations`),
        else fresh memory; drop the newer versions unless ``drop_newer`` is False."""
        record, times = chosen.record, chosen.times
        saved = chosen.saved if into is not None else None
        state = self.copy_out(record, self.memory.bytes_of(record.slot), device, times, saved, into)
        if drop_newer:
            self.store.drop_from(record.version + 1)
        rank_info(self.rank, "restore of version %d took %.3f s: agreeing and checking %.3f s, rebuilding %.3f s, "
                  "copying %.3f s, waiting for the DP gather %.3f s", record.version, times.total_s, times.agree_s,
                  times.rebuild_s, times.copy_s, times.gather_wait_s)
        return Restored(version=record.version, state=state, rebuilt=chosen.rebuilt, times=times,
                        lineage=record.lineage, uid=record.uid, timeline=record.timeline)

    def _refuse_a_fresh_start(self, on_entry: list[int]) -> None:
        """No rank has intact data of any version. That is a fresh job only if no rank held
        anything when the restore began: versions whose every copy was found damaged (and
        dropped) must not pass for a job that never saved."""
        held = sorted(set().union(*gather(on_entry, self._gloo)))
        if held:
            raise NotRecoverableFromMemory(
                f"memory held version(s) {held} of this job, but no rank has intact data of any of them (each "
                f"rank's log names the damaged files it dropped). Fall back to a disk checkpoint.")

    def copy_out(self, record: CommitRecord, slot_bytes: torch.Tensor, device: torch.device,
                 times: Optional[RestoreTimes] = None, saved: Any = None, into: Any = None,
                 peers: Optional[DataParallelPeers] = None) -> Any:
        """The whole state of a version, in private memory on ``device`` (into the tensors
        ``into`` names for the version's ``saved`` shape, where they fit:
        :mod:`ftmem._state.destinations`); a DP-sharded one is
        gathered back from the replicas (collective over the DP group: ``peers``', the
        flush's, else the restore's). With ``times``
        (restore, at start) the gather runs in a thread of its own while this one copies
        the rank's unique bytes out of the slot, and both are timed into ``times``. The flush
        does not: it may run at interpreter exit, where no new thread can start."""
        dests = destinations(saved, record.plan.entries, into)
        plan, began, peers = record.plan, time.perf_counter(), peers or self.peers
        if not plan.shard:
            tensors = read_from_slot(slot_bytes, plan, device, into=dests)
        elif times is None:
            tensors = read_from_slot(slot_bytes, plan, device,
                                     lambda: gather_replicated(plan, slot_bytes, peers, dests), dests)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="ftmem-gather", initializer=threads.block_signals) as pool:
                gathered = pool.submit(gather_replicated, plan, slot_bytes, peers, dests)

                def wait_for_gather() -> torch.Tensor:
                    waited = time.perf_counter()
                    stream = gathered.result()
                    times.gather_wait_s = time.perf_counter() - waited
                    return stream

                tensors = read_from_slot(slot_bytes, plan, device, wait_for_gather, dests)
        if times is not None:
            times.copy_s = time.perf_counter() - began - times.gather_wait_s
        return join_state(record.skeleton, tensors)

    def _column_ranks(self) -> list[int]:
        return self.topology.column_ranks(*self.topology.column_of(self.rank))

    def _rebuild(self, version: int, held, data: dict, parity: dict) -> Optional[str]:
        """Rebuild the lost members of this rank's column (collective over the column). A
        lost member stores its data only if it matches the checksum its writer took;
        returns why not, else None."""
        ranks = self._column_ranks()
        has_data = {pos for pos, r in enumerate(ranks) if version in held[r][0]}
        has_parity = {pos for pos, r in enumerate(ranks) if version in held[r][1]}
        mine = self.memory.bytes_of(data[version].slot).numpy() if version in data else None
        theirs = None
        if version in parity:
            theirs = (parity[version], self.memory.bytes_of(parity[version].slot, PARITY).numpy())
        rebuilt = self._column.rebuild(has_data, has_parity, mine, theirs)
        if rebuilt is None:
            return None
        record, raw = rebuilt
        problem = rebuilt_problem(record, raw)
        if problem is not None:
            return (f"rank {self.rank}'s data rebuilt from parity {problem} (the parity does not belong to the data "
                    f"the survivors hold)")
        # A failure here is this rank's alone: said as a problem, so that every rank stops
        # with the reason, not on a peer's exit (or waiting for a peer that caught it).
        try:
            self._store_rebuilt(version, record, raw)
        except (FtmemError, OSError) as e:  # no room on the replacement node, its memory gone again
            return f"rank {self.rank} could not store its rebuilt data ({e})"
        return None

    def _protect_rebuilt(self, record: CommitRecord, store: bool) -> bool:
        """Give the members of this column lacking their parity of the version (the rebuilt
        ones) that parity, encoded again from the column's data (collective over the column):
        else the version survived no further node loss until the next save. Whether stored."""
        slot = self.store.free_slot(PARITY)
        made, parity = self._column.encode_again(record, self.memory.bytes_of(record.slot).numpy(), slot)
        if not store:
            return False
        try:  # after the column's exchange: a failure here is this rank's alone
            self.memory.reserve(record.plan.nbytes, len(parity))
            self.store.drop_slot(slot, PARITY)
            self.memory.bytes_of(slot, PARITY).numpy()[: len(parity)] = parity
            self.store.write_parity(made)
        except (FtmemError, OSError) as e:
            rank_warning(self.rank, "cannot store its parity of version %d after the rebuild (%s): the version is "
                         "protected again at the next save", record.version, e)
        return record.version in self.store.parity_held()

    def _store_rebuilt(self, version: int, record: CommitRecord, raw) -> None:
        self.memory.reserve(record.plan.nbytes, self.store.capacity(PARITY))
        self.store.drop(version)
        slot = self.store.free_slot()
        self.store.drop_slot(slot)
        # The crash tests' "mid-rebuild": rebuilt and checked, the slot emptied, nothing written into it yet.
        testhooks.at("mid_rebuild", self.rank, version)
        self.memory.bytes_of(slot, DATA).numpy()[: len(raw)] = raw
        self.store.write_commit(with_slot(record, slot))
        rank_info(self.rank, "rebuilt version %d (%d bytes) from its EC group's parity", version, len(raw))
