"""Versions belong to the job, and the node layout, that saved them.

Every version an adapter saves records its job's origin (the save directory). A job whose id collides with another job's (the same FTMEM_JOB_ID or
``job_id`` by mistake) finds that job's versions under its id: it must neither restore
them nor delete them with its first save, so it stops, naming both. Checked when the
engine starts, before anything is read or written.

The other way round, a relaunch at another world size (or ranks per node) derives another
job id from the same save dir, unless FTMEM_JOB_ID or ``job_id`` fixes it, and finds
nothing under it. Loading an older disk checkpoint, or starting from scratch, would then
silently drop what the first job holds: where this job holds nothing, the restore names
the versions other jobs saved from its origin (:func:`versions_of_other_jobs`).

A node directory is laid out for the ranks its node had (``node<i>`` holds ranks
i*R .. i*R+R-1). A relaunch of the same job with another number of ranks per node would
look for each rank's versions on another node, find some and miss others, and take the
node's SMP for one serving other ranks: it stops before it starts the SMP, naming the
change (:func:`refuse_another_node_layout`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from ftmem.errors import CorruptShard, ForeignVersions, FtmemError, LayoutMismatch
from ftmem._common.identity import RankIdentity, world_in_words
from ftmem._shm.jobs import list_jobs, node_dirs, node_ranks, recorded_ranks
from ftmem._common.collective import gather
from ftmem._shm.slots import CommitRecord, RankStore, ranks_in


def foreign_versions(store: RankStore, origin: str) -> Optional[str]:
    """The versions this rank holds of another job, in words; None if all are this job's."""
    others: dict[Optional[str], list[int]] = {}
    for record in readable_records(store):
        if record.origin != origin:
            others.setdefault(record.origin, []).append(record.version)
    return "; ".join(f"versions {v} saved from {o}" for o, v in others.items()) or None


def refuse_foreign_versions(store: RankStore, identity: RankIdentity, group: Optional[dist.ProcessGroup]) -> None:
    """Stop, on every rank alike, if any rank holds another job's versions (collective).
    A job without an origin (the engine used directly) claims no versions and checks none."""
    if identity.origin is None:
        return
    found = next((f for f in gather(foreign_versions(store, identity.origin), group) if f), None)
    if found:
        raise ForeignVersions(
            f"job id {identity.job}: shared memory in {identity.shm_dir} holds {found}: another job's, not this "
            f"job's ({identity.origin}). ftmem neither restores nor deletes them. Give this job its own id "
            f"(FTMEM_JOB_ID, the config's \"job_id\" or --ftmem-job-id), or, if that job is over, free its memory "
            f"with `ftmem clean --job {identity.job}`.")


def node_layout_change(identity: RankIdentity) -> Optional[str]:
    """How this rank's node directory was laid out for other ranks, in words; None if for
    this node's ranks, or not there yet."""
    path = identity.node_dir
    if not os.path.isdir(path):
        return None
    ours = identity.node_ranks
    recorded = recorded_ranks(path)
    written = sorted(set(recorded or ()) | set(ranks_in(path)))
    if (recorded is None or recorded == ours) and set(written) <= set(ours):
        return None
    return f"node {identity.node} ({path}) holds memory of ranks {written}, where this launch places ranks {ours}"


def refuse_another_node_layout(identity: RankIdentity, group: Optional[dist.ProcessGroup]) -> None:
    """Stop, on every rank alike, if any node directory was laid out for other ranks
    (collective; before any rank starts its node's SMP)."""
    found = next((f for f in gather(node_layout_change(identity), group) if f), None)
    if found:
        raise LayoutMismatch(
            f"job {identity.job}: {found} (ranks per node now {identity.ranks_per_node}, world size "
            f"{identity.world_size}): the node layout changed since this job's memory was written. ftmem restores "
            f"from memory only onto the node layout it saved with. Relaunch with that layout (ranks per node: the "
            f"launcher's LOCAL_WORLD_SIZE, \"ranks_per_node\" or --ftmem-ranks-per-node), or, to load from disk "
            f"instead, free the job's memory first: ftmem clean --job {identity.job} --shm-dir {identity.shm_dir}")


def other_jobs_of_origin(identity: RankIdentity) -> dict[str, dict[int, str]]:
    """{job: {node: node directory}} of the jobs under other ids whose memory, as far as
    this rank's shared memory shows it, holds versions saved from this job's origin."""
    found: dict[str, dict[int, str]] = {}
    if identity.origin is None:
        return found
    for job in list_jobs(identity.shm_dir):
        if job == identity.job:
            continue
        try:
            dirs = dict(node_dirs(identity.shm_dir, job))
            if any(record.origin == identity.origin for path in dirs.values() for rank in ranks_in(path)
                   for record in readable_records(RankStore(path, rank))):
                found[job] = dirs
        except (FtmemError, OSError):
            continue  # not this user's to read, or going away (ftmem clean): no version of ours
    return found


def versions_of_other_jobs(identity: RankIdentity) -> Optional[str]:
    """The versions that jobs under other ids saved from this job's origin, as far as this
    rank's shared memory shows them, in words; None if there are none (or no origin)."""
    found: dict[str, list[int]] = {}
    worlds: dict[str, str] = {}  # each job's world, where its records and node files tell it
    for job, dirs in other_jobs_of_origin(identity).items():
        ours = [record for path in dirs.values() for rank in ranks_in(path)
                for record in readable_records(RankStore(path, rank)) if record.origin == identity.origin]
        found[job] = sorted({record.version for record in ours})
        layout = next((record.layout for record in ours if record.layout is not None), None)
        if layout is not None:  # its DP groups cover the world, each rank once
            world = sum(len(group) for group in layout.dp_groups)
            worlds[job] = f" on {world_in_words(world, len(node_ranks(next(iter(dirs.values())))))}"
    if not found:
        return None
    held = "; ".join(f"job {job}{worlds.get(job, '')}: versions {vs}" for job, vs in sorted(found.items()))
    return (f"this job ({identity.job}, on {world_in_words(identity.world_size, identity.ranks_per_node)}) holds no "
            f"version in memory, but other jobs saved from its origin ({identity.origin}) hold some ({held}).")


def other_worlds_refused(identity: RankIdentity, held: str, why: str) -> str:
    """The refusal of the versions ``held`` (:func:`versions_of_other_jobs`), for ``why``."""
    jobs = " ".join(sorted(other_jobs_of_origin(identity)))
    return (f"{held} A relaunch at another world size or ranks per node derives another job id unless FTMEM_JOB_ID "
            f"or \"job_id\" sets it, and {why}. Relaunch as those versions were saved; or, to load from disk (or start "
            f"over) at this layout, free them first: ftmem clean --job {jobs} --shm-dir {identity.shm_dir}.")


def readable_records(store: RankStore) -> list[CommitRecord]:
    """The commit records ``store`` holds that can be read, oldest first."""
    records = []
    for version in sorted(store.committed()):
        try:
            records.append(store.read_commit(version))
        except (CorruptShard, OSError):
            continue  # unreadable: restore counts it as lost
    return records
