"""Adopting a version that another job saved on another world: the elastic restart.

A relaunch on fewer (or more) nodes, after a node loss with no spare at hand, is
another job: its id derives from the save dir and the world (:mod:`ftmem._common.identity`).
The job it replaces left its versions in the shared memory of the machines it ran on.
Where the framework's loader reads a checkpoint saved at another DP size (DeepSpeed's
ZeRO loader reads every old rank's files), the new job resumes from that memory:

1. every new rank lists the node directories that other jobs of its origin left in its
   machine's shared memory; each old node is read by the lowest new rank that sees it;
2. the old job's world and EC groups come from its records (the commit records' DP
   groups, the parity records' k, m and nodes), and the version is chosen as a restore
   chooses one (:func:`ftmem._ec.protect.plan_recovery`, under the old topology): the newest
   that every old rank holds or can rebuild from its old column's parity;
3. each reader checks its old ranks' bytes against their checksums (a damaged copy
   counts as lost, and the version is chosen again) and sends them, point to point over
   the job's gloo group, to the new ranks that need them: a new rank needs the bytes of
   the old ranks it loads (:class:`OtherWorlds`), of their DP replicas (a DP-sharded
   rank's replicated bytes lie across them), and, where one of those was lost, its
   column's data and parity;
4. every new rank decodes the lost old ranks it needs (checked against the checksum
   their writer took), joins their old DP groups' replicated slices, and so holds the
   state of each old rank it loads: every one for DeepSpeed (its elastic loader reads
   every old rank's files), one for Megatron (its place's old DP group with the
   distributed optimizer).

The old job's memory is the only copy of the version until the new job protects one of
its own; only then is it freed (:meth:`Adopted.free`), each reader its own old nodes.
A relaunch that dies before that leaves two old jobs of the origin in memory, one
descending from the other (each version records the job and version its line was adopted
from: ``CommitRecord.lineage``); the next relaunch adopts from the newest of the line
that can give its version back, and frees the older ones with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ftmem._shm import integrity
from ftmem._ec.codec import Codec
from ftmem._state.reader import joined_stream, read_from_slot
from ftmem.errors import CorruptShard, EcGeometryMismatch, LayoutMismatch, NotRecoverableFromMemory
from ftmem._common.identity import RankIdentity, job_root, world_in_words
from ftmem._shm.jobs import free_node, node_ranks
from ftmem._common.logs import job_info, rank_info
from ftmem._engine.ownership import other_jobs_of_origin, readable_records
from ftmem._common.parallel import ParallelLayout
from ftmem._ec.placement import ECGroup
from ftmem._ec.protect import Geometry, Topology, decode_member, member_piece
from ftmem._engine.recovery import choose_intact, rebuilt_problem
from ftmem._common.collective import first_problem, gather
from ftmem._state.serialize import join_state
from ftmem._shm.slots import (DATA, PARITY, CommitRecord, ParityRecord, RankStore, VersionRef, decode_record,
                              encode_record)


@dataclass(frozen=True)
class OtherWorlds:
    """How an adapter loads a version that another world saved."""

    # Why it cannot load a version saved under this (old) layout; None if it can.
    refuse: Callable[[ParallelLayout], Optional[str]]
    # The old ranks whose state this rank loads, under this (old) layout; None: every one.
    loads: Callable[[ParallelLayout], Optional[list[int]]] = lambda layout: None


@dataclass
class Adopted:
    """Another job's version, as every new rank holds it after :func:`adopt`."""

    job: str  # the job that saved it
    version: int
    uid: str  # of that save (CommitRecord.uid)
    timeline: str  # the version's (CommitRecord.timeline), which this job carries on
    world: str  # that job's world, in words
    layout: ParallelLayout  # its parallel layout
    states: list  # every old rank's state, by old rank; None for those this rank does not load
    rebuilt: list[int]  # the old ranks whose data was rebuilt from parity
    read_here: list[str]  # the old node directories this rank read, and frees
    # The old jobs that the adopted one descends from (:func:`line_of_jobs`): {job: the node
    # directories of it that this rank frees with the adopted job's}.
    superseded: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ref(self) -> VersionRef:
        return VersionRef(self.job, self.version, self.uid, self.timeline)

    def __str__(self) -> str:
        rebuilt = f", its rank(s) {self.rebuilt} rebuilt from parity" if self.rebuilt else ""
        return f"saved by job {self.job} on {self.world}{rebuilt}"

    def free(self, shm_dir: str) -> None:
        """Free the old nodes this rank read (their SMPs stopped, their memory deleted), and
        those of the superseded jobs: only once the new job holds a protected version of its
        own."""
        _free_nodes(shm_dir, self.job, self.read_here, f"this job adopted its version {self.version} and now "
                                                       f"holds a protected version of its own")
        for job, paths in self.superseded.items():
            _free_nodes(shm_dir, job, paths, f"it holds nothing newer than version {self.version}, which this job "
                                             f"adopted from job {self.job} and has now replaced with a protected "
                                             f"version of its own")


def _free_nodes(shm_dir: str, job: str, paths: list[str], why: str) -> None:
    for path in paths:
        free_node(path)
    try:
        os.rmdir(job_root(shm_dir, job))  # the last reader to free its nodes removes the job
    except OSError:
        pass
    if paths:
        job_info("freed job %s's memory on nodes %s: %s", job, [os.path.basename(p) for p in paths], why)


def adopt(identity: RankIdentity, group: Optional[dist.ProcessGroup], format_name: str,
          other_worlds: OtherWorlds, timeline: Optional[str] = None) -> Adopted:
    """The newest version that the other jobs of this job's origin can give back, on every
    rank (collective over ``group``, the job's gloo group); with ``timeline``, a version of
    that timeline, from a job whose newest version is of it (the others are stale: an earlier
    run's, left as they are). There are several where a
    relaunch that adopted a version died before it had freed the job it adopted from: the
    newest job of that line is tried first, then the jobs it descends from, while what a
    job holds cannot be rebuilt (:func:`line_of_jobs`). Where ``other_worlds.refuse`` says
    why the adapter cannot load a version saved under the old layout: LayoutMismatch, as
    for a version it saved itself with another layout, before any byte moves.
    NotRecoverableFromMemory where no job can give a version back."""
    rank = dist.get_rank() if group is not None else 0
    here, seen, heads = _other_jobs(identity, group)
    if timeline is not None:
        stale = sorted(job for job, head in heads.items() if head.timeline != timeline)
        if stale:
            job_info("not adopting from job(s) %s: their newest versions are of another run than the save dir's "
                     "newest checkpoint (stale memory, left as it is: `ftmem clean --job JOB --shm-dir %s` frees "
                     "each)", stale, identity.shm_dir)
        heads = {job: head for job, head in heads.items() if head.timeline == timeline}
    if not heads:
        raise NotRecoverableFromMemory("no other job of this save dir holds a version of the run that the save "
                                       "dir's newest checkpoint is of." if timeline is not None else
                                       "the other jobs' memory went away before it could be read (ftmem clean?).")
    line, problems = line_of_jobs(heads), []
    for i, old in enumerate(line):
        try:
            adopted = _adopt_from(old, identity, seen, here, rank, group, format_name, other_worlds,
                                  heads[old].timeline)
        except (NotRecoverableFromMemory, EcGeometryMismatch) as e:
            job_info("not adopting from job %s: %s Trying the job it descends from, if any.", old, e)
            problems.append(str(e))
            continue
        adopted.superseded = {job: sorted(_read_by(rank, job, seen, here).values()) for job in line[i + 1:]}
        return adopted
    raise NotRecoverableFromMemory(" ".join(problems))


def ancestors(identity: RankIdentity, group: Optional[dist.ProcessGroup], lineage: Optional[VersionRef],
              version: int) -> dict[str, tuple[list[str], str]]:
    """This job resumed its own ``version``, of a line adopted from ``lineage`` (None: a line
    of its own, and nothing to do): that job, and the jobs it descends from, where the
    origin's memory still holds them with nothing else, each with the node directories this
    rank frees and why (collective where there is a lineage, which is the version's, the same
    on every rank; each old node is freed by the lowest rank that sees it: :func:`free_jobs`,
    once this job holds a protected version of its own). A relaunch that adopted a version
    and was killed before it freed them (:meth:`Adopted.free`), restarted in its own world,
    would otherwise leave them held until ``ftmem clean``, though nothing would read them
    again: a restart of this job restores its own memory, never theirs, and a relaunch on
    another world adopts from the newest job of the line. A job whose newest version is not
    the very save the line descends from (an earlier or later run of the same command saved
    that number again) is kept, and the log says how to free it. Other jobs of the origin are
    left alone."""
    if lineage is None:
        return {}
    rank = dist.get_rank() if group is not None else 0
    here, seen, heads = _other_jobs(identity, group)
    ref, found = lineage, {}
    while ref is not None and ref.job in heads and ref.job not in found:
        head = heads[ref.job]
        if head.uid != ref.uid:
            job_info("kept job %s's memory: its newest version %d is not the save of version %d that this job's "
                     "line descends from (another run of the same save dir saved it); `ftmem clean --job %s "
                     "--shm-dir %s` frees it", ref.job, head.version, ref.version, ref.job, identity.shm_dir)
            break
        found[ref.job] = (sorted(_read_by(rank, ref.job, seen, here).values()),
                          f"this job's line descends from its version {ref.version}, this job resumed its own "
                          f"version {version} and now holds a protected version of its own")
        ref = head.lineage
    return found


def free_jobs(shm_dir: str, found: dict[str, tuple[list[str], str]]) -> None:
    """Free what :func:`ancestors` found (no collective: each rank its own node directories)."""
    for job, (paths, why) in found.items():
        _free_nodes(shm_dir, job, paths, why)


@dataclass(frozen=True)
class _Head:
    """A job's newest version held (on one node, or on any) and what its record says."""

    version: int  # -1: none
    lineage: Optional[VersionRef] = None
    uid: Optional[str] = None
    timeline: Optional[str] = None


def _other_jobs(identity: RankIdentity, group: Optional[dist.ProcessGroup]) -> tuple[dict, list, dict]:
    """The other jobs of this job's origin in memory (collective): the node directories this
    rank sees ({job: {node: path}}), what every rank sees ({job: {node: (ranks, head)}}, by
    rank) and each job's head ({job: its newest version's :class:`_Head`})."""
    here = other_jobs_of_origin(identity)
    seen = gather({job: {node: (len(node_ranks(path)), _head(path, identity.origin))
                                 for node, path in dirs.items()} for job, dirs in here.items()}, group)
    heads: dict[str, _Head] = {}
    for held in seen:
        for job, nodes in held.items():
            heads[job] = max([heads.get(job, _Head(-1)), *(head for _, head in nodes.values())],
                             key=lambda h: h.version)
    return here, seen, heads


def line_of_jobs(heads: dict[str, _Head]) -> list[str]:
    """The old jobs of an origin to adopt from, in the order to try them, from each job's
    newest version (``heads``): the job that no other descends from, then the job it
    descends from, and so on; a job descends from another whose newest version is the very
    save its lineage names. LayoutMismatch where the jobs are not one such line (two
    unrelated jobs, or two relaunches of one job): ftmem cannot tell which one this job
    continues, and version numbers alone do not say (a relaunch that fell back to an older
    disk checkpoint starts a line of its own)."""
    parents = {job: head.lineage.job for job, head in heads.items()
               if head.lineage and head.lineage.job in heads and heads[head.lineage.job].uid == head.lineage.uid}
    newest = [job for job in heads if job not in parents.values()]
    if len(newest) != 1:
        described = ", ".join(f"{job} (newest version {heads[job].version}"
                              + (f", adopted from job {parents[job]})" if job in parents else ")")
                              for job in sorted(heads))
        raise LayoutMismatch(f"the memory of several jobs is held ({described}), and they are not one line of "
                             f"relaunches, each adopting from the one before: ftmem cannot tell which one this "
                             f"job continues (free the others first)")
    line = newest
    while line[-1] in parents and parents[line[-1]] not in line:
        line = line + [parents[line[-1]]]
    return line


def _head(path: str, origin: str) -> _Head:
    """The newest version of ``origin`` that a node directory holds a readable record of."""
    records = [record for rank in node_ranks(path) for record in readable_records(RankStore(path, rank))
               if record.origin == origin]
    newest = max(records, key=lambda record: record.version, default=None)
    return _Head(-1) if newest is None else _Head(newest.version, newest.lineage, newest.uid, newest.timeline)


def _readers(job: str, seen: list) -> dict[int, int]:
    """{old node: the new rank that reads it}: the lowest that sees it."""
    readers: dict[int, int] = {}
    for new_rank, held in enumerate(seen):
        for node in held.get(job, {}):
            readers.setdefault(node, new_rank)
    return readers


def _read_by(rank: int, job: str, seen: list, here: dict) -> dict[int, str]:
    """{old node: its directory} of ``job``'s nodes that ``rank`` reads (and frees)."""
    readers = _readers(job, seen)
    return {node: path for node, path in here.get(job, {}).items() if readers[node] == rank}


def _adopt_from(old: str, identity: RankIdentity, seen: list, here: dict, rank: int,
                group: Optional[dist.ProcessGroup], format_name: str, other_worlds: OtherWorlds,
                timeline: Optional[str]) -> Adopted:
    """The newest version of ``timeline`` that job ``old`` can give back (collective; see :func:`adopt`)."""
    readers = _readers(old, seen)
    read_here = _read_by(rank, old, seen, here)
    stores = {r: RankStore(path, r) for path in read_here.values() for r in node_ranks(path)}
    commits, parities = _records_of(stores, identity.origin, timeline, group)
    layout = _loadable_layout(old, commits, format_name, other_worlds)
    world = sum(len(g) for g in layout.dp_groups)
    per_node = max(n for held in seen for n, _ in held.get(old, {}).values())
    loads = other_worlds.loads(layout)
    mine = set(range(world) if loads is None else loads)
    loaded_by = gather(mine, group)  # each new rank's
    # A DP-sharded rank's replicated bytes lie across its DP replicas (a job shards all or none).
    sharded = any(record.plan.shard is not None for held in commits.values() for record in held.values())

    def needed_for(loaded: set[int]) -> set[int]:
        return {q for r in loaded for q in (layout.dp_group_of(r) if sharded else [r])}

    topology = Topology(world, per_node, _old_groups(world // per_node, parities))
    needed = needed_for(set().union(*loaded_by))  # by some new rank
    chosen, lost, read = _choose(topology, stores, commits, parities, group, old, needed)
    wants = [_wanted(topology, lost, needed_for(loaded), chosen, commits, parities) for loaded in loaded_by]

    def nbytes(r: int, kind: str) -> int:  # a rank may hold no parity (no EC group, or its parity damaged)
        if kind == DATA:
            return commits[r][chosen].plan.nbytes
        return parities[r][chosen].piece_size * len(parities[r][chosen].checksums)

    held = _exchange(wants, rank, read, lambda r: readers[r // per_node], group, nbytes)
    del read
    data = {r: buffer for (r, kind), buffer in held.items() if kind == DATA}
    parity = {r: buffer for (r, kind), buffer in held.items() if kind == PARITY}
    records, received = {r: commits[r][chosen] for r in data}, len(data)
    rebuilt_here = sorted(r for r in lost if r in needed_for(mine))
    _rebuild_here(rebuilt_here, topology, chosen, records, data, parity, parities, old, group)
    states = _old_states(records, data, mine, world)
    if loads is not None:
        rank_info(rank, "takes old rank(s) %s's state of job %s's version %d (the data of %d of its %d old ranks "
                  "received, %d rebuilt)", sorted(mine), old, chosen, received, world, len(rebuilt_here))
    uid = next(held[chosen].uid for held in commits.values() if chosen in held)
    return Adopted(job=old, version=chosen, uid=uid, timeline=timeline, world=world_in_words(world, per_node),
                   layout=layout, states=states,
                   rebuilt=sorted(r for r in lost if r in needed), read_here=sorted(read_here.values()))


def _loadable_layout(old: str, commits: dict, format_name: str, other_worlds: OtherWorlds) -> ParallelLayout:
    """The layout job ``old`` saved its versions under, once the adapter said it can load it
    (LayoutMismatch with the adapter's reason, or the format's, where it cannot)."""
    sample = next((record for held in commits.values() for record in held.values()), None)
    if sample is None:
        raise NotRecoverableFromMemory(f"job {old}'s memory holds no readable version.")
    if sample.format != format_name:
        raise LayoutMismatch(f"job {old}'s versions were saved by the {sample.format} adapter, and this job runs "
                             f"{format_name}")
    refusal = other_worlds.refuse(sample.layout)
    if refusal:
        raise LayoutMismatch(refusal)
    return sample.layout


def _rebuild_here(lost: list[int], topology: Topology, chosen: int, records: dict, data: dict, parity: dict,
                  parities: dict, old: str, group: Optional[dist.ProcessGroup]) -> None:
    """Rebuild the old ranks ``lost`` that this rank rebuilds, into ``records`` and ``data``
    (collective: every rank says whether its own rebuilds worked, and all raise the first
    problem, NotRecoverableFromMemory, alike)."""
    problem = None
    try:
        for r in lost:
            records[r], data[r] = _rebuild(topology, r, chosen, data, parity, parities, old)
    except NotRecoverableFromMemory as e:
        problem = str(e)
    except Exception as e:  # any failure: the other ranks wait in the gather below for this one's verdict
        problem = f"job {old}'s lost ranks could not be rebuilt ({type(e).__name__}: {e})."
    problem = first_problem(problem, group)  # each rank rebuilds its own
    if problem is not None:
        raise NotRecoverableFromMemory(problem)


def _old_states(records: dict, data: dict, mine: set[int], world: int) -> list:
    """The state of each old rank this rank loads (None for the others), out of its data: a
    DP-sharded one's replicated stream joined from its old DP group's, once per group."""
    streams: dict[tuple, torch.Tensor] = {}

    def stream_of(r: int) -> torch.Tensor:
        replicas = tuple(sorted(records[r].layout.dp_group_of(r), key=lambda q: records[q].plan.shard.index))
        if replicas not in streams:
            streams[replicas] = joined_stream([(data[q], records[q].plan) for q in replicas])
        return streams[replicas]

    return [join_state(records[r].skeleton, read_from_slot(data[r], records[r].plan, torch.device("cpu"),
                                                           lambda r=r: stream_of(r))) if r in mine else None
            for r in range(world)]


def _records_of(stores: dict[int, RankStore], origin: str, timeline: Optional[str],
                group: Optional[dist.ProcessGroup]) -> tuple[dict[int, dict], dict[int, dict]]:
    """Every old rank's intact commit and parity records of the origin's versions of
    ``timeline``, by old rank and version, as every new rank sees them (gathered as their
    plain encoding)."""
    def readable(read, versions) -> dict[int, bytes]:
        found = {}
        for v in versions:
            try:
                found[v] = encode_record(read(v))
            except (CorruptShard, OSError):
                continue  # a damaged marker: that copy is lost, as for a restore
        return found

    mine = {r: (readable(s.read_commit, s.committed()), readable(s.read_parity, s.parity_held()))
            for r, s in stores.items()}
    commits: dict[int, dict] = {}
    parities: dict[int, dict] = {}
    for held in gather(mine, group):
        for r, (data, parity) in held.items():
            commits[r] = {v: c for v, c in ((v, decode_record(CommitRecord, b)) for v, b in data.items())
                          if c.origin == origin and c.timeline == timeline}
            parities[r] = {v: p for v, p in ((v, decode_record(ParityRecord, b)) for v, b in parity.items())
                           if all(c.timeline == timeline for c in p.records)}
    return commits, parities


def _old_groups(nodes: int, parities: dict[int, dict]) -> tuple[ECGroup, ...]:
    """The old job's EC groups, as its parity records name them; a node that no parity
    record names was a group of its own (no EC), whose loss nothing rebuilds."""
    groups = {(p.nodes, p.m) for held in parities.values() for p in held.values()}
    named = {node for node_group, _ in groups for node in node_group}
    groups |= {((node,), 0) for node in range(nodes) if node not in named}
    return tuple(sorted((ECGroup(nodes=tuple(n), m=m) for n, m in groups), key=lambda g: g.nodes))


def _to_move(topology: Topology, lost: list[int], needed: set[int]) -> tuple[set[int], set[tuple[int, int]]]:
    """The old ranks whose data, and the columns whose parity, the new ranks need: the
    ``needed`` ranks' data and, where one of them was lost, its column's data and parity."""
    columns = {topology.column_of(r) for r in lost if r in needed}
    return needed | {r for r in range(topology.world_size) if topology.column_of(r) in columns}, columns


def _wanted(topology: Topology, lost: list[int], needed: set[int], version: int, commits: dict,
            parities: dict) -> set[tuple[int, str]]:
    """The bytes of ``version`` (old rank, DATA or PARITY) that a new rank needing the old
    ranks ``needed`` must hold: theirs and, for a lost one, its column's (:func:`_to_move`)."""
    moved, columns = _to_move(topology, lost, needed)
    return ({(r, DATA) for r in moved if version in commits.get(r, {})}
            | {(r, PARITY) for r in range(topology.world_size) if r not in lost and topology.column_of(r) in columns
               and version in parities.get(r, {})})


def _choose(topology: Topology, stores: dict[int, RankStore], commits: dict, parities: dict,
            group: Optional[dist.ProcessGroup], old: str, needed: set[int]) -> tuple[int, list[int], dict]:
    """The version to adopt (:func:`ftmem._engine.recovery.choose_intact`), the old ranks lost
    from it, and the bytes of it this rank reads for the ``needed`` old ranks ({(old rank,
    DATA or PARITY): bytes}), read into private memory and checked first (before any rank waits
    in a broadcast for them): a damaged or unreadable copy counts as lost, on every rank
    alike, and the version is chosen again."""
    read: dict = {}

    def every_old_rank_s() -> tuple[list, list]:
        ranks = range(topology.world_size)
        return ([{v: c.plan.nbytes for v, c in commits.get(r, {}).items()} for r in ranks],
                [{v: Geometry.of(p) for v, p in parities.get(r, {}).items()} for r in ranks])

    def damaged(chosen: int, lost: list[int]) -> bool:
        moved, columns = _to_move(topology, lost, needed)
        read.clear()
        found = []
        for r, store in stores.items():
            wanted = [(DATA, commits.get(r, {}).get(chosen))] if r in moved else []
            if topology.column_of(r) in columns:
                wanted.append((PARITY, parities.get(r, {}).get(chosen)))
            for kind, record in wanted:
                try:
                    if record is not None:
                        read[(r, kind)] = _read_checked(store, record, kind)
                except CorruptShard as e:
                    found.append((r, kind, str(e)))
        found = [d for each in gather(found, group) for d in each]
        for r, kind, why in found:
            job_info("job %s: %s Treating it as lost.", old, why)
            parities[r].pop(chosen, None)  # damaged data takes its rank's parity with it, as in a restore
            if kind == DATA:
                commits[r].pop(chosen, None)
        return bool(found)

    decision = choose_intact(topology, every_old_rank_s, damaged, needed=needed)
    if decision is None:
        raise NotRecoverableFromMemory(f"job {old}'s memory holds no intact version.")
    chosen, lost = decision
    return chosen, sorted(lost), read


def _read_checked(store: RankStore, record, kind: str) -> torch.Tensor:
    """A slot's bytes of ``record``'s version, in private memory, checked against the
    checksums their writer took (CorruptShard if they do not match, or cannot be read)."""
    nbytes = record.plan.nbytes if kind == DATA else record.piece_size * len(record.checksums)
    try:
        with store.map_slot(record.slot, writable=False, kind=kind) as mm:
            raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=min(nbytes, len(mm))).copy())
    except (OSError, ValueError) as e:  # missing, or empty (mmap refuses a zero-length file)
        raise CorruptShard(f"rank {store.rank} version {record.version}: {store.slot_path(record.slot, kind)} "
                           f"cannot be read ({e}).") from e
    check = integrity.check_data if kind == DATA else integrity.check_parity
    check(store, record, lambda slot, kind: raw)
    return raw


def _exchange(wants: list[set[tuple[int, str]]], rank: int, read: dict, reader: Callable[[int], int],
              group: Optional[dist.ProcessGroup], nbytes: Callable[[int, str], int]) -> dict[tuple[int, str], torch.Tensor]:
    """The bytes this new rank wants (``wants[rank]``), each from the new rank that read it
    (``reader(old rank)``; in ``read`` where this rank did), point to point: each reader sends
    what it read to the ranks that want it, and nothing else moves (collective over ``group``)."""
    held, transfers = {}, []

    def peer(new_rank: int) -> int:
        return dist.get_global_rank(group, new_rank)

    def tag(key: tuple[int, str]) -> int:  # one per old rank and kind: the bytes of a pair arrive in any order
        return 2 * key[0] + (key[1] == PARITY)

    for key in sorted(wants[rank]):
        if key in read:
            held[key] = read[key]
            continue
        held[key] = torch.empty(nbytes(*key), dtype=torch.uint8)
        if len(held[key]):
            transfers.append(dist.irecv(held[key], src=peer(reader(key[0])), group=group, tag=tag(key)))
    for other, wanted in enumerate(wants):
        if other == rank:
            continue
        for key in sorted(wanted & read.keys()):
            if len(read[key]):
                transfers.append(dist.isend(read[key], dst=peer(other), group=group, tag=tag(key)))
    for transfer in transfers:
        transfer.wait()
    return held


def _rebuild(topology: Topology, r: int, version: int, data: dict[int, torch.Tensor], parity: dict[int, torch.Tensor],
             parities: dict, old: str) -> tuple[CommitRecord, torch.Tensor]:
    """Old rank ``r``'s record and data, decoded from its old column's data and parity
    (every piece at hand) and checked against the checksum its writer took."""
    gi, local = topology.column_of(r)
    ec, column = topology.groups[gi], topology.column_ranks(gi, local)
    has_data = {pos for pos, q in enumerate(column) if q in data}
    has_parity = {pos for pos, q in enumerate(column) if q in parity}
    held = parities[next(q for q in column if q in parity)][version]
    piece = held.piece_size

    def piece_of(stripe: int, code: int) -> np.ndarray:
        src = (ec.data_members(stripe) + ec.parity_members(stripe))[code]
        q = column[src]
        return member_piece(ec, src, stripe, code, piece, data[q].numpy() if q in data else None, held.lengths[src],
                            parity[q].numpy() if q in parity else None, np.empty(piece, dtype=np.uint8))

    pos = column.index(r)
    raw = decode_member(Codec(ec.k, ec.m), ec, pos, held, has_data, has_parity, piece_of)
    record = held.records[pos]
    problem = "is of another version" if record.version != version else rebuilt_problem(record, raw)
    if problem is not None:
        raise NotRecoverableFromMemory(f"job {old}'s rank {r} (lost with its node) could not be rebuilt from its EC "
                                       f"group's parity: the rebuilt data {problem}. Fall back to a disk checkpoint.")
    return record, torch.from_numpy(raw)
