"""Who this process is in the job: the job's identity, its node, and where that
node's snapshots live in shared memory.

Layout of the shared-memory filesystem (see docs/design/protocols.md)::

    <shm_dir>/ftmem-<uid>/<job>/node<i>/     one directory per (virtual) node, owned by its SMP

The root is per user (the effective uid): a shared-memory filesystem is open to every
local user, and each keeps its jobs in a directory of its own, 0700 (:mod:`ftmem._shm.private`).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ftmem.errors import ConfigError

if TYPE_CHECKING:  # the config checks job ids with is_job_id: it imports this module
    from ftmem.config import FtmemConfig

ROOT_PREFIX = "ftmem-"
_JOB_ID_CHARS = re.compile(r"[A-Za-z0-9._-]{1,128}")
JOB_ID_RULE = "a job id of 1-128 letters, digits, '.', '_' and '-', other than '.' and '..'"


def is_job_id(job: object) -> bool:
    """Whether ``job`` names a directory of its own under the root: no
    separator, and not '.' or '..' (which name the root itself or its parent)."""
    return isinstance(job, str) and _JOB_ID_CHARS.fullmatch(job) is not None and job not in (".", "..")


def check_job_id(job: object, source: str = "job id") -> str:
    """``job`` if it is a usable job id; else a ConfigError that says where it came from
    (``source``) and what is allowed. Every job id, from the training side or a command,
    passes here before it becomes a path."""
    if not is_job_id(job):
        raise ConfigError(f"{source} {job!r} is not usable as a directory name: use {JOB_ID_RULE}.")
    return job


def default_origin() -> str:
    """Where a job comes from when its adapter names no save directory (the engine used
    directly): the working directory and the script, which a relaunch of the same
    command reproduces."""
    return f"{os.path.realpath(os.getcwd())} {os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ''}"


def resolve_job_id(config_job_id: Optional[str], world_size: int, ranks_per_node: int, origin: str) -> str:
    """The job identity: FTMEM_JOB_ID, else the config's job_id, else derived from facts a
    relaunch of the *same* job reproduces and an unrelated job does not: its origin (the
    save directory) and its world layout. Launcher values do not qualify: torchrun draws a
    new TORCHELASTIC_RUN_ID at every launch, and unrelated jobs share MASTER_ADDR/PORT."""
    if os.environ.get("FTMEM_JOB_ID"):
        return check_job_id(os.environ["FTMEM_JOB_ID"], "FTMEM_JOB_ID")
    if config_job_id:
        return check_job_id(config_job_id)
    seed = f"{origin}|world={world_size}|ranks_per_node={ranks_per_node}"
    return "job-" + hashlib.sha1(seed.encode()).hexdigest()[:12]


def resolve_ranks_per_node(configured: Optional[int], world_size: int) -> int:
    """Ranks per (virtual) node: the config, else the launcher's LOCAL_WORLD_SIZE."""
    rpn = configured or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_size
    if world_size % rpn:
        raise ConfigError(
            f"world size {world_size} is not a multiple of ranks_per_node {rpn}: every node "
            f"must hold the same number of ranks. Set \"ranks_per_node\" to a divisor of {world_size}."
        )
    return rpn


def world_in_words(world_size: int, ranks_per_node: int) -> str:
    """``4 ranks (2 nodes of 2)``: a job's world, as refusals name what a relaunch changed."""
    nodes = world_size // ranks_per_node
    return f"{world_size} rank{'s' * (world_size != 1)} ({nodes} node{'s' * (nodes != 1)} of {ranks_per_node})"


def root_dir(shm_dir: str) -> str:
    """``<shm_dir>/ftmem-<uid>``: where this user's jobs keep their memory."""
    return os.path.join(shm_dir, f"{ROOT_PREFIX}{os.geteuid()}")


def job_root(shm_dir: str, job: str) -> str:
    """``<shm_dir>/ftmem-<uid>/<job>``, refused unless it is a directory of its own there: a
    valid job id, and no symbolic link leading elsewhere (ftmem clean deletes what is in it)."""
    root = root_dir(shm_dir)
    path = os.path.join(root, check_job_id(job))
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(root):
        raise ConfigError(f"{path} leads outside {root} (to {os.path.realpath(path)}): ftmem keeps a job's "
                          f"memory only in a directory of its own there. Remove the link.")
    return path


def node_dir(shm_dir: str, job: str, node: int) -> str:
    return os.path.join(job_root(shm_dir, job), f"node{node}")


@dataclass(frozen=True)
class RankIdentity:
    """One rank's place in the job: which job, which node, where its node keeps memory."""

    job: str
    rank: int
    world_size: int
    ranks_per_node: int
    shm_dir: str
    # Where the job comes from (its save directory, as the adapter says): recorded in every
    # version, so that a job never restores, nor deletes, the versions of another job that
    # shares its id. None for the engine used directly, which checks no ownership.
    origin: Optional[str]

    @classmethod
    def resolve(cls, config: FtmemConfig, rank: int, world_size: int, origin: Optional[str] = None) -> "RankIdentity":
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside the world of size {world_size}.")
        rpn = resolve_ranks_per_node(config.ranks_per_node, world_size)
        return cls(job=resolve_job_id(config.job_id, world_size, rpn, origin or default_origin()), rank=rank,
                   world_size=world_size, ranks_per_node=rpn, shm_dir=config.shm_dir, origin=origin)

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_ranks(self) -> list[int]:
        """The ranks of this rank's node."""
        return list(range(self.node * self.ranks_per_node, (self.node + 1) * self.ranks_per_node))

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node_dir(self) -> str:
        return node_dir(self.shm_dir, self.job, self.node)


def check_node_layout(config: FtmemConfig, rank: int, world_size: int) -> None:
    """Fail now, with the reason, if the config's nodes or EC groups cannot fit the world
    (for adapters that start the engine later than the job)."""
    identity = RankIdentity.resolve(config, rank, world_size, origin="")
    config.ec.resolve(identity.num_nodes)
