"""The job's parallel layout, as the adapters describe it to the engine.

Only two things change what the engine does with a rank's bytes: which ranks are
data-parallel replicas of each other (their replicated tensors are identical, so
with DP sharding each keeps 1/D of them), and which tensors are replicated (the
``replicated`` predicate given to each save). The sizes of the other dimensions are
recorded with every version, so a restore under a different layout is refused with
the mismatch named instead of loading shards into the wrong ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch.distributed as dist

from ftmem._common.collective import new_group
from ftmem.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    # Every data-parallel group: the ranks holding replicas of each other's
    # replicated state. Together they cover the world, each rank once.
    dp_groups: tuple[tuple[int, ...], ...]
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    zero_stage: int = 0

    @classmethod
    def data_parallel(cls, world_size: int) -> "ParallelLayout":
        """Plain data parallelism: every rank a replica of every other."""
        return cls(dp_groups=(tuple(range(world_size)),))

    def validate(self, world_size: int) -> None:
        seen = sorted(r for g in self.dp_groups for r in g)
        if seen != list(range(world_size)):
            raise ConfigError(
                f"the DP groups {[list(g) for g in self.dp_groups]} must cover ranks 0..{world_size - 1} once each."
            )
        sizes = {len(g) for g in self.dp_groups}
        if len(sizes) != 1:
            raise ConfigError(f"all DP groups must have one size, got sizes {sorted(sizes)}.")
        model_parallel = self.tp_size * self.pp_size * self.cp_size
        if sizes.pop() * model_parallel != world_size:
            raise ConfigError(
                f"DP size {len(self.dp_groups[0])} x TP {self.tp_size} x PP {self.pp_size} x CP {self.cp_size} "
                f"does not make the world size {world_size}."
            )

    def dp_group_of(self, rank: int) -> tuple[int, ...]:
        return tuple(sorted(next(g for g in self.dp_groups if rank in g)))

    def mismatch(self, other: "ParallelLayout") -> Optional[str]:
        """What differs from ``other``, in words; None if they match."""
        diffs = [f"{f.name} {getattr(other, f.name)} -> {getattr(self, f.name)}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return "; ".join(diffs) or None


def gather_dp_groups(mine: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Every DP group of the job, from each rank's own (collective over all ranks)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(sorted(mine)))
    return tuple(sorted(set(everyone)))


def make_dp_groups(layout: ParallelLayout, rank: int, interface: Optional[str]):
    """Create a gloo group per DP group (collective: all ranks, same order), its bytes on the
    network ``interface`` (see :func:`new_group`); return ours."""
    mine = None
    for group in layout.dp_groups:
        pg = new_group(group, interface=interface)
        if rank in group:
            mine = pg
    return mine


def destroy_groups(*groups: Optional[dist.ProcessGroup]) -> None:
    """Destroy these groups (None skipped) while the interpreter is alive. A group's gloo
    threads end only with its last reference: the caller lets go of it too, or they end
    during interpreter shutdown, where they now and then abort the process ("terminate
    called without an active exception", seen at clean exits of ftmem jobs)."""
    for group in groups:
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
