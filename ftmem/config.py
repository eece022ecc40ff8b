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
    """Erasure coding across nodes: groups of ``k`` data and ``m`` parity nodes."""

    k: int = 2
    m: int = 1

    def __post_init__(self) -> None:
        for name in ("k", "m"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f'"ftmem.ec.{name}" must be a non-negative integer, got {value!r}.')
        if self.k < 1:
            raise ConfigError(f'"ftmem.ec.k" must be at least 1, got {self.k}.')

    @property
    def parity_fraction(self) -> float:
        """Parity bytes held per data byte (m/k)."""
        return self.m / self.k


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

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ConfigError(f'"ftmem.ranks_per_node" must be a positive integer, got {self.ranks_per_node!r}.')
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
