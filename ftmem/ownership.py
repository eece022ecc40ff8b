"""Versions belong to the job that saved them.

Every version an adapter saves records its job's origin (the save directory). A job whose id collides with another job's (the same FTMEM_JOB_ID or
``job_id`` by mistake) finds that job's versions under its id: it must neither restore
them nor delete them with its first save, so it stops, naming both. Checked when the
engine starts, before anything is read or written.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .errors import CorruptShard, FtmemError
from .identity import RankIdentity
from .restore import gather_objects
from .slots import RankStore


class ForeignVersions(FtmemError):
    """Shared memory under this job's id holds versions another job saved."""


def foreign_versions(store: RankStore, origin: str) -> Optional[str]:
    """The versions this rank holds of another job, in words; None if all are this job's."""
    others: dict[Optional[str], list[int]] = {}
    for version in sorted(store.committed()):
        try:
            record = store.read_commit(version)
        except (CorruptShard, OSError):
            continue  # unreadable: restore counts it as lost
        if record.origin != origin:
            others.setdefault(record.origin, []).append(version)
    return "; ".join(f"versions {v} saved from {o}" for o, v in others.items()) or None


def refuse_foreign_versions(store: RankStore, identity: RankIdentity, group: Optional[dist.ProcessGroup]) -> None:
    """Stop, on every rank alike, if any rank holds another job's versions (collective).
    A job without an origin (the engine used directly) claims no versions and checks none."""
    if identity.origin is None:
        return
    found = next((f for f in gather_objects(foreign_versions(store, identity.origin), group) if f), None)
    if found:
        raise ForeignVersions(
            f"job id {identity.job}: shared memory in {identity.shm_dir} holds {found}: another job's, not this "
            f"job's ({identity.origin}). ftmem neither restores nor deletes them. Give this job its own id "
            f"(FTMEM_JOB_ID, the config's \"job_id\" or --ftmem-job-id), or, if that job is over, free its memory "
            f"with `ftmem clean --job {identity.job}`.")
