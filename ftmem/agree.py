"""Agreeing, across all ranks, on the one version the whole job restores."""
from __future__ import annotations

from typing import Iterable, Optional

import torch.distributed as dist

from .errors import NoRecoverableVersion


def gather_held(held: Iterable[int], group) -> list[list[int]]:
    """Every rank's intact versions, indexed by rank (just ours when ``group`` is None)."""
    mine = sorted(held)
    if group is None:
        return [mine]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def choose_version(everyone: list[list[int]], requested: Optional[int] = None) -> Optional[int]:
    """The newest version every rank holds intact (or ``requested``, if all hold it).

    Returns None when no version is common to all ranks: the caller falls back to
    disk. Never picks a version that some rank lacks, so the job never resumes from
    a mix of versions.
    """
    common = set(everyone[0]).intersection(*map(set, everyone[1:]))
    if requested is None:
        return max(common) if common else None
    if requested not in common:
        lacking = [r for r, held in enumerate(everyone) if requested not in held]
        raise NoRecoverableVersion(
            f"version {requested} is not held intact by rank(s) {lacking}; versions every rank holds: "
            f"{sorted(common) or 'none'}. Restore without naming a version to get the newest common one."
        )
    return requested
