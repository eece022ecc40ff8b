"""What the shared-memory directory holds, job by job, and freeing it.

Used by ``ftmem status`` and ``ftmem clean``; reads only the filesystem and /proc,
so it works whether or not the SMPs and trainers are alive. It sees this user's jobs
(``<shm_dir>/ftmem-<uid>``), and refuses, like the training side, a root or job directory
that another user owns or may write (:mod:`ftmem._shm.private`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from typing import Optional

from ftmem._common.identity import is_job_id, job_root, root_dir
from ftmem._shm.private import check_private_dir, read_private
from ftmem._shm.procs import pid_alive
from ftmem._shm.slots import RankStore, ranks_in
from ftmem._shm.smp_client import NODE_FILE, running_smp, stop_smp


def list_jobs(shm_dir: str) -> list[str]:
    """The jobs in ``shm_dir``: directories of ``<shm_dir>/ftmem-<uid>`` named by a valid job id
    (anything else there, a symbolic link included, is no job's: neither shown nor cleaned)."""
    root = root_dir(shm_dir)
    if not os.path.lexists(root):
        return []
    check_private_dir(root)
    paths = {name: os.path.join(root, name) for name in os.listdir(root)}
    return sorted(name for name, path in paths.items()
                  if is_job_id(name) and os.path.isdir(path) and not os.path.islink(path))


def node_dirs(shm_dir: str, job: str) -> list[tuple[int, str]]:
    job_dir = job_root(shm_dir, job)  # refuses an id that is no job's directory
    if not os.path.lexists(job_dir):
        return []
    check_private_dir(os.path.dirname(job_dir))
    check_private_dir(job_dir)
    nodes = []
    for name in os.listdir(job_dir):
        if name.startswith("node") and name[4:].isdigit():
            nodes.append((int(name[4:]), os.path.join(job_dir, name)))
    return sorted(nodes)


def recorded_ranks(path: str) -> Optional[list[int]]:
    """The ranks the node's SMP was started for (its node file); None where it cannot tell."""
    try:
        ranks = json.loads(read_private(os.path.join(path, NODE_FILE)))["ranks"]
    except (OSError, ValueError, KeyError, TypeError):  # missing, a link, or not what ftmem writes
        return None
    return ranks if isinstance(ranks, list) and all(type(r) is int for r in ranks) else None


def node_ranks(path: str) -> list[int]:
    recorded = recorded_ranks(path)
    return ranks_in(path) if recorded is None else recorded


def node_status(node: int, path: str) -> dict:
    """One node's entry of ``ftmem status --json`` (see docs/operations.md)."""
    stores = [RankStore(path, r) for r in node_ranks(path)]
    held = [set(s.committed()) for s in stores]
    protected = [s.read_protected() for s in stores]
    return {
        "node": node,
        "smp_pid": running_smp(path),
        "path": path,
        "ranks": [s.rank for s in stores],
        "versions": sorted(set.intersection(*held)) if held else [],
        # Protected: every EC group's parity for it was complete, and this node still holds it.
        "protected": None if not protected or None in protected else min(protected),
    }


def status(shm_dir: str, job: Optional[str] = None) -> dict:
    jobs = [job] if job else list_jobs(shm_dir)
    return {"jobs": [job_status(j, [node_status(n, p) for n, p in node_dirs(shm_dir, j)]) for j in jobs]}


def job_status(job: str, nodes: list[dict]) -> dict:
    """One job's entry of ``ftmem status --json``: its nodes, and the newest version every
    node holds whole next to the newest one protected on every node (protection runs behind
    the saves: the difference is how far)."""
    held = set.intersection(*(set(n["versions"]) for n in nodes)) if nodes else set()
    protected = [n["protected"] for n in nodes]
    return {"job": job, "newest_held": max(held, default=None),
            "newest_protected": None if not protected or None in protected else min(protected), "nodes": nodes}


def lose_node(shm_dir: str, job: str, node: int) -> None:
    """Do to a node's snapshots what losing the node does (docs/operations.md): SIGKILL its
    SMP and delete its shared memory. For failure drills and tests; the node's
    training ranks are expected to be dead already."""
    for n, path in node_dirs(shm_dir, job):
        if n == node:
            pid = running_smp(path)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                while pid_alive(pid):
                    time.sleep(0.005)
            shutil.rmtree(path)
            return
    raise FileNotFoundError(f"job {job} has no node {node} in {shm_dir}")


def clean(shm_dir: str, job: str) -> list[str]:
    """Stop the job's SMPs and delete its shared memory; returns the paths freed. Ranks of
    the job still running stop at their next save with SharedMemoryRemoved."""
    freed = [path for _, path in node_dirs(shm_dir, job)]
    for path in freed:
        free_node(path)
    try:
        os.rmdir(job_root(shm_dir, job))
    except OSError:
        pass
    return freed


def free_node(path: str) -> None:
    """Stop a node directory's SMP and delete the directory."""
    pid = running_smp(path)
    if pid is not None:
        stop_smp(pid)
    shutil.rmtree(path, ignore_errors=True)
