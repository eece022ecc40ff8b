"""The ftmem configuration: the ``"ftmem"`` section of a DeepSpeed JSON config, or
the ``--ftmem-*`` Megatron flags, parsed into one validated object.

Unknown keys are errors (a misspelt key that is silently ignored would run a job
without the protection its user asked for).
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from .errors import ConfigError

DP_SHARD_CHOICES = ("auto", "on", "off")


def _reject_unknown(section: str, given: Mapping[str, Any], known: list[str]) -> None:
    for key in given:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"unknown key {key!r} in the {section} config.{did_you_mean} "
                f"Known keys: {', '.join(known)}."
            )


@dataclass(frozen=True)
class ECConfig:
    """Erasure coding across nodes: groups of ``k`` data and ``m`` parity nodes.

    Leave both unset for defaults that fit the node count (see :meth:`resolve`).
    """

    k: Optional[int] = None
    m: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.k is None) != (self.m is None):
            raise ConfigError(
                f'"ftmem.ec" needs both "k" and "m" (got k={self.k}, m={self.m}), or neither for '
                f"defaults that fit the node count."
            )
        if self.k is None:
            return
        for name in ("k", "m"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f'"ftmem.ec.{name}" must be a non-negative integer, got {value!r}.')
        if self.k < 1:
            raise ConfigError(f'"ftmem.ec.k" must be at least 1, got {self.k}.')
        if self.m == 0 and self.k > 1:
            raise ConfigError(
                f'"ftmem.ec" k={self.k}, m=0 asks for erasure coding without parity, which protects '
                f"nothing. Set m >= 1, or k=1, m=0 to keep each snapshot on its own node only."
            )

    def resolve(self, num_nodes: int) -> tuple[int, int]:
        """(k, m) for a job of ``num_nodes`` nodes; the defaults are k=min(2, N-1), m=1
        (a mirror on 2 nodes, no cross-node protection on 1)."""
        if self.k is None:
            return (1, 0) if num_nodes == 1 else (min(2, num_nodes - 1), 1)
        if self.k + self.m > num_nodes:
            raise ConfigError(
                f'"ftmem.ec" k={self.k}, m={self.m} needs groups of {self.k + self.m} nodes, but the job has '
                f"{num_nodes} node(s) (ranks_per_node sets how ranks form nodes). Use k+m <= {num_nodes}, "
                f"or leave \"ec\" out for defaults that fit."
            )
        return self.k, self.m


@dataclass(frozen=True)
class PersistConfig:
    """Background flushes of protected versions to disk."""

    dir: Optional[str] = None
    interval: int = 0
    keep: int = 2

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep < 1:
            raise ConfigError(
                f'"ftmem.persist": interval must be >= 0 and keep >= 1, got interval={self.interval}, keep={self.keep}.'
            )
        if bool(self.dir) != (self.interval > 0):
            raise ConfigError(
                f'"ftmem.persist" needs both "dir" and "interval" >= 1 (got dir={self.dir!r}, '
                f"interval={self.interval}): every interval-th protected version is flushed to dir."
            )


@dataclass(frozen=True)
class FtmemConfig:
    """Validated ftmem settings. Build it with :meth:`from_dict` from user input."""

    ec: ECConfig = field(default_factory=ECConfig)
    # Ranks per (virtual) node; None means the launcher's LOCAL_WORLD_SIZE.
    ranks_per_node: Optional[int] = None
    shm_dir: str = "/dev/shm"
    dp_shard: str = "auto"
    persist: PersistConfig = field(default_factory=PersistConfig)
    job_id: Optional[str] = None
    # Memory holds a version of another layout, model or args: load the disk checkpoint
    # instead of stopping (AdapterRuntime.restore).
    allow_disk_fallback: bool = False

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ConfigError(f'"ftmem.ranks_per_node" must be a positive integer, got {self.ranks_per_node!r}.')
        if not isinstance(self.allow_disk_fallback, bool):
            raise ConfigError(f'"ftmem.allow_disk_fallback" must be true or false, got {self.allow_disk_fallback!r}.')
        if self.dp_shard not in DP_SHARD_CHOICES:
            raise ConfigError(f'"ftmem.dp_shard" must be one of {DP_SHARD_CHOICES}, got {self.dp_shard!r}.')
        if not os.path.isdir(self.shm_dir):
            raise ConfigError(
                f'"ftmem.shm_dir" {self.shm_dir!r} is not a directory. Point it at a tmpfs '
                f"(usually /dev/shm) that exists on every node."
            )

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]]) -> "FtmemConfig":
        """Parse the ``"ftmem"`` section of a user config; ``None`` gives the defaults."""
        section = dict(section or {})
        _reject_unknown('"ftmem"', section, [f.name for f in fields(cls)])
        ec = section.pop("ec", None) or {}
        persist = section.pop("persist", None) or {}
        _reject_unknown('"ftmem.ec"', ec, [f.name for f in fields(ECConfig)])
        _reject_unknown('"ftmem.persist"', persist, [f.name for f in fields(PersistConfig)])
        return cls(ec=ECConfig(**ec), persist=PersistConfig(**persist), **section)
