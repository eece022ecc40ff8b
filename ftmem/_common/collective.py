"""The job-wide collectives every part of ftmem uses to make all ranks take the same way
out: gather what each rank has, take the first problem any rank found, vote. A rank that
decides alone (to fall back, to refuse, to stop) while the others go on leaves them
waiting in the next collective; these helpers give every rank the same answer.

Each is a collective over ``group`` (a gloo group of ftmem's, never a framework's);
without a group (one rank) it answers from this rank alone.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

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


def vote(yes: bool, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether every rank says ``yes`` (a tensor all-reduce: cheaper than a gather of objects)."""
    if group is None:
        return yes
    ballot = torch.tensor([int(yes)], dtype=torch.int64)
    dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=group)
    return bool(ballot.item())
