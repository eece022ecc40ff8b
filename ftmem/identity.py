"""Who this process is in the job: the job's identity, its node, and where that
node's snapshots live in shared memory.

Layout of the shared-memory filesystem (DESIGN.md §5)::

    <shm_dir>/ftmem/<job>/node<i>/     one directory per (virtual) node, owned by its SMP
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Optional

from .config import FtmemConfig
from .errors import ConfigError

ROOT_NAME = "ftmem"
_JOB_ID_OK = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def resolve_job_id(config_job_id: Optional[str], world_size: int) -> str:
    """The job identity: FTMEM_JOB_ID, else the config's job_id, else
    TORCHELASTIC_RUN_ID, else a stable value from MASTER_ADDR, MASTER_PORT and the
    world size. A restarted job with the same identity finds its snapshots."""
    elastic_run = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic_run == "none":  # torchrun's placeholder with static rendezvous: not an identity
        elastic_run = None
    job = os.environ.get("FTMEM_JOB_ID") or config_job_id or elastic_run
    if not job:
        seed = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '')}:{world_size}"
        job = "job-" + hashlib.sha1(seed.encode()).hexdigest()[:12]
    if not _JOB_ID_OK.match(job):
        raise ConfigError(
            f"job id {job!r} is not usable as a directory name: use 1-128 characters "
            f"from letters, digits, '.', '_' and '-'."
        )
    return job


def resolve_ranks_per_node(configured: Optional[int], world_size: int) -> int:
    """Ranks per (virtual) node: the config, else the launcher's LOCAL_WORLD_SIZE."""
    rpn = configured or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_size
    if world_size % rpn:
        raise ConfigError(
            f"world size {world_size} is not a multiple of ranks_per_node {rpn}: every node "
            f"must hold the same number of ranks. Set \"ranks_per_node\" to a divisor of {world_size}."
        )
    return rpn


def job_root(shm_dir: str, job: str) -> str:
    return os.path.join(shm_dir, ROOT_NAME, job)


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

    @classmethod
    def resolve(cls, config: FtmemConfig, rank: int, world_size: int) -> "RankIdentity":
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside the world of size {world_size}.")
        return cls(
            job=resolve_job_id(config.job_id, world_size),
            rank=rank,
            world_size=world_size,
            ranks_per_node=resolve_ranks_per_node(config.ranks_per_node, world_size),
            shm_dir=config.shm_dir,
        )

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node_dir(self) -> str:
        return node_dir(self.shm_dir, self.job, self.node)
