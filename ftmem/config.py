"""The ftmem configuration: the ``"ftmem"`` section of a DeepSpeed JSON config, or
the ``--ftmem-*`` Megatron flags, parsed into one validated object.

Every key declares what it accepts in its field's metadata (an :class:`Allowed`), and
one validator walks the fields, so each rejection names the key as the user wrote it
(``"ftmem.persist.interval"``), the value given and what is allowed. JSON's types stay
apart: ``true`` is not an integer, nor is ``2.5``, and ``null`` is accepted only where
a key is optional. What the schema cannot say (keys that go together, paths that must
exist) each section checks in its ``check``.

Unknown keys are errors (a misspelt key that is silently ignored would run a job
without the protection its user asked for).
"""
from __future__ import annotations

import difflib
import json
import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

from ftmem.errors import ConfigError
from ftmem._common.identity import JOB_ID_RULE, is_job_id

DP_SHARD_CHOICES = ("auto", "on", "off")
# Data slots per rank (versions in memory): the newest protected version, the one being
# protected, and the newest copy, which a crash of processes restores. Two give up the newest
# copy: a save that comes while a protection runs is then skipped (ftmem._engine.commit).
DATA_SLOTS = 3
SLOT_CHOICES = (2, 3)
_ALLOWED = "ftmem.allowed"  # the metadata key of a field's Allowed


@dataclass(frozen=True)
class Allowed:
    """What one config key accepts."""

    kind: Any  # bool, int, str, a tuple of them, or the dataclass of a section
    optional: bool = False  # null (None) is accepted
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    choices: tuple = ()
    rule: Optional[Callable[[Any], bool]] = None  # a further test, described by ``rule_text``
    rule_text: str = ""

    def describe(self) -> str:
        if self.choices:
            what = "one of " + ", ".join(json.dumps(c) for c in self.choices)
        elif self.rule_text:
            what = self.rule_text
        elif self.kind is bool:
            what = "true or false"
        elif self.kind is int and self.maximum is not None:
            what = f"an integer from {self.minimum} to {self.maximum:,}"
        elif self.kind is int:
            what = "an integer" + (f" >= {self.minimum}" if self.minimum is not None else "")
        elif self.kind is str:
            what = "a string"
        else:
            what = f"an object with the keys {', '.join(f.name for f in fields(self.kind))}"
        return what + (" (or leave it out)" if self.optional else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) and self.kind is not bool:  # bool is an int subclass; JSON's true is not a number
            return False
        return (isinstance(value, self.kind)
                and (self.minimum is None or value >= self.minimum)
                and (self.maximum is None or value <= self.maximum)
                and (not self.choices or value in self.choices)
                and (self.rule is None or self.rule(value)))

    def check(self, key: str, value: Any) -> None:
        if not self.accepts(value):
            raise ConfigError(f'"{key}" must be {self.describe()}, got {_shown(value)}.')


def _key(default: Any = None, **allowed: Any) -> Any:
    """A config key: its default and what it accepts (see :class:`Allowed`)."""
    if isinstance(default, type):  # a section: its defaults
        return field(default_factory=default, metadata={_ALLOWED: Allowed(default, **allowed)})
    return field(default=default, metadata={_ALLOWED: Allowed(**allowed)})


def _shown(value: Any) -> str:
    """A value as the user wrote it: JSON where it is JSON."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _reject_unknown(section: str, given: Mapping[str, Any], known: list[str]) -> None:
    for key in given:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"unknown key {key!r} in the {section} config.{did_you_mean} "
                f"Known keys: {', '.join(known)}."
            )


class _Section:
    """A section of the config: a frozen dataclass whose fields are made by :func:`_key`."""

    KEY: ClassVar[str]  # the section's name in the user's config

    def __post_init__(self) -> None:
        for f in fields(self):
            f.metadata[_ALLOWED].check(f"{self.KEY}.{f.name}", getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """What the keys' schema cannot say: how they go together, what the paths hold."""

    @classmethod
    def parse(cls, given: Optional[Mapping[str, Any]]):
        """The section from the user's mapping; ``None`` gives the defaults."""
        if given is None:
            return cls()
        if not isinstance(given, Mapping):
            raise ConfigError(f'"{cls.KEY}" must be an object with the keys {", ".join(f.name for f in fields(cls))}, '
                              f"got {_shown(given)}.")
        _reject_unknown(f'"{cls.KEY}"', given, [f.name for f in fields(cls)])
        values = {}
        for f in fields(cls):
            if f.name in given:
                kind = f.metadata[_ALLOWED].kind
                section = isinstance(kind, type) and issubclass(kind, _Section)
                values[f.name] = kind.parse(given[f.name]) if section else given[f.name]
        return cls(**values)


# Reed-Solomon over GF(2^8) (ISA-L's Cauchy matrices): at most 255 pieces per stripe.
MAX_EC_NODES = 255
# A bound on every count a config takes where nothing else bounds it: far above any real
# value, it keeps a typo's 10**30 from reaching code that takes it as a size or a time.
MAX_COUNT = 10**9
# The longest wait a config sets (a grace, a timeout): a day. Longer ones are typos, and
# Python's own waits refuse past about 292 years (threading.TIMEOUT_MAX).
MAX_WAIT_S = 86_400


@dataclass(frozen=True)
class ECConfig(_Section):
    """Erasure coding across nodes: groups of ``k`` data and ``m`` parity nodes.

    Leave both unset for defaults that fit the node count (see :meth:`resolve`).
    """

    KEY: ClassVar[str] = "ftmem.ec"

    k: Optional[int] = _key(kind=int, optional=True, minimum=1, maximum=MAX_EC_NODES - 1)
    m: Optional[int] = _key(kind=int, optional=True, minimum=0, maximum=MAX_EC_NODES - 1)

    def check(self) -> None:
        if (self.k is None) != (self.m is None):
            raise ConfigError(
                f'"ftmem.ec" needs both "k" and "m" (got k={self.k}, m={self.m}), or neither for '
                f"defaults that fit the node count."
            )
        if self.k is not None and self.k + self.m > MAX_EC_NODES:
            raise ConfigError(
                f'"ftmem.ec" k={self.k}, m={self.m} makes groups of {self.k + self.m} nodes; the code (Reed-Solomon '
                f"over GF(2^8)) takes at most k+m = {MAX_EC_NODES}."
            )
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
class PersistConfig(_Section):
    """Background flushes of protected versions to disk."""

    KEY: ClassVar[str] = "ftmem.persist"

    dir: Optional[str] = _key(kind=str, optional=True)
    interval: int = _key(0, kind=int, minimum=0, maximum=MAX_COUNT)
    keep: int = _key(2, kind=int, minimum=1, maximum=MAX_COUNT)
    # Each flush is on the disk (fsync) before it is published and older ones deleted
    # (ftmem._disk.durable); off where that is pointless (a RAM disk).
    fsync: bool = _key(True, kind=bool)

    def check(self) -> None:
        if bool(self.dir) != (self.interval > 0):
            raise ConfigError(
                f'"ftmem.persist" needs both "dir" and "interval" >= 1 (got dir={self.dir!r}, '
                f"interval={self.interval}): every interval-th protected version is flushed to dir."
            )
        # Whether the directory takes files is checked at the job's start
        # (ftmem._disk.persist.check_writable, which may create it); a file in its place is wrong now.
        if self.dir and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ConfigError(f'"ftmem.persist.dir" {self.dir!r} is a file, not a directory: point it at a '
                              f"directory (it is created if missing) to flush checkpoints into.")


# The signals a preemption's warning may come as (Slurm's --signal, a scheduler's own choice).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
# torchrun stops its workers 30 s after its own SIGTERM (SIGKILL then): a flush must end sooner.
PREEMPTION_GRACE_S = 25


@dataclass(frozen=True)
class PreemptionConfig(_Section):
    """What a rank does when its job is told to stop (ftmem._engine.preemption): on ``signal``
    to every rank, the newest version is flushed to the persistent tier within ``grace_s``,
    then the process ends as that signal ends it."""

    KEY: ClassVar[str] = "ftmem.preemption"

    signal: Optional[str] = _key("SIGTERM", kind=str, optional=True, choices=PREEMPTION_SIGNALS)  # None: off
    grace_s: int = _key(PREEMPTION_GRACE_S, kind=int, minimum=1, maximum=MAX_WAIT_S)


# How long a rank may go without a heartbeat before the job counts it lost: well above what a busy
# but healthy node shows (a slow step, a long flush, a straggler), and far below the collective
# timeout the survivors wait for without a detector (NCCL's 10 minutes, gloo's 30).
FAILURE_TIMEOUT_S = 60
# Sets it where the config does not (an operator's or a test suite's tuning).
FAILURE_TIMEOUT_ENV = "FTMEM_FAILURE_TIMEOUT_S"


@dataclass(frozen=True)
class FailureDetectionConfig(_Section):
    """Heartbeats between the job's ranks (ftmem._engine.failure_detector): a rank that stops
    answering for ``timeout_s`` ends every other rank, so that the launcher restarts the job
    at once instead of after the training collective's timeout."""

    KEY: ClassVar[str] = "ftmem.failure_detection"

    enabled: bool = _key(True, kind=bool)
    # None: FTMEM_FAILURE_TIMEOUT_S, else 60
    timeout_s: Optional[int] = _key(kind=int, optional=True, minimum=1, maximum=MAX_WAIT_S)

    def resolve(self) -> Optional[float]:
        """The timeout in seconds; None where detection is off."""
        if not self.enabled:
            return None
        if self.timeout_s is not None:
            return float(self.timeout_s)
        return seconds_from_env(FAILURE_TIMEOUT_ENV, FAILURE_TIMEOUT_S, minimum=1,
                                what="how long a rank may go without a heartbeat before the job counts it lost")


# Names ftmem's network interface where the config does not (GLOO_SOCKET_IFNAME's counterpart).
INTERFACE_ENV = "FTMEM_SOCKET_IFNAME"
INTERFACE_RULE = "a network interface's name (1-15 characters, without '/', ':' or white space)"


def is_interface_name(name: str) -> bool:
    """Whether ``name`` can name a network interface (the kernel's rule for the names it takes)."""
    return 0 < len(name) <= 15 and name not in (".", "..") and not any(c in "/:" or c.isspace() for c in name)


def host_interfaces() -> list[str]:
    """The names of this host's network interfaces (those of this process's network namespace)."""
    return [name for _, name in socket.if_nameindex()]


@dataclass(frozen=True)
class NetworkConfig(_Section):
    """The network ftmem's own gloo groups move their bytes over; the training's groups keep
    theirs (GLOO_SOCKET_IFNAME, NCCL's own settings)."""

    KEY: ClassVar[str] = "ftmem.network"

    # None: FTMEM_SOCKET_IFNAME, else where gloo goes by itself (GLOO_SOCKET_IFNAME, else the
    # address the host name resolves to), as the training's gloo groups do.
    interface: Optional[str] = _key(kind=str, optional=True, rule=is_interface_name, rule_text=INTERFACE_RULE)

    def resolve(self) -> Optional[str]:
        """The interface ftmem's groups bind to on this host: the config's, else
        FTMEM_SOCKET_IFNAME's, else None (gloo's own choice). A name the host does not have
        is refused now, naming the ones it has, rather than by gloo at the first group."""
        if self.interface is not None:
            name, given = self.interface, f'"{self.KEY}.interface"'
        else:
            name, given = os.environ.get(INTERFACE_ENV) or None, INTERFACE_ENV
        if name is None:
            return None
        present = host_interfaces()
        if name not in present:
            raise ConfigError(
                f"{given} names the network interface {name!r}, which this host ({socket.gethostname()}) does not "
                f"have; its interfaces are {', '.join(present)}. Name the interface of the network ftmem's "
                f"traffic is meant to take, as it is called on every node (or leave it out: ftmem's groups then "
                f"take the network gloo picks, as the training's gloo groups do)."
            )
        return name


# File systems whose files live in memory: the only ones where a snapshot costs no disk write.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
# Set to 1 to keep shared memory on another file system anyway (a test bed, a RAM disk of another kind).
ANY_FILESYSTEM_ENV = "FTMEM_SHM_ANY_FILESYSTEM"


def filesystem_of(path: str) -> Optional[str]:
    """The type of the file system ``path`` is on (the mount that holds it); None if unknown."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for parts in mounts:
        if len(parts) < 3:
            continue
        # The kernel writes a space in a mount point as \040 (and tab, newline, backslash so too).
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def shm_dir_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot hold the jobs' shared memory, or None if it can."""
    if not os.path.isdir(path):
        return f"{path!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path!r} is not writable by this user"
    kind = filesystem_of(path)
    if kind is not None and kind not in MEMORY_FILESYSTEMS and os.environ.get(ANY_FILESYSTEM_ENV) != "1":
        return (f"{path!r} is on {kind}, a file system not kept in memory ({', '.join(MEMORY_FILESYSTEMS)}): "
                f"every snapshot would be written to its disk (to use it anyway, set {ANY_FILESYSTEM_ENV}=1)")
    return None


SHM_DIR_ADVICE = "point it at a tmpfs (usually /dev/shm) that exists on every node and this user can write"


_SIZE = re.compile(r"(?i)\s*([0-9]*\.?[0-9]+)\s*(%|b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*")
_SIZE_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BUDGET_RULE = ('a share of the shared-memory filesystem\'s size ("80%") or a size ("64GiB", "500MB", or a number of '
               'bytes: "1000000" or 1000000), per node')
MAX_BUDGET_BYTES = 2**60  # an exbibyte: past any node's memory


def budget_bytes(spec: Union[str, int], filesystem_bytes: int) -> Optional[int]:
    """The bytes the budget ``spec`` allows a node on a shared-memory filesystem of
    ``filesystem_bytes``; None where ``spec`` is no budget (see BUDGET_RULE)."""
    if isinstance(spec, int):  # a JSON number: bytes
        return spec if 1 <= spec <= MAX_BUDGET_BYTES else None
    match = _SIZE.fullmatch(spec)
    if not match:
        return None
    number, unit = float(match[1]), (match[2] or "").lower() or None
    if unit == "%":
        return int(filesystem_bytes * number / 100) if 0 < number <= 100 else None
    size = int(number * _SIZE_UNITS[unit])
    return size if 1 <= number and size <= MAX_BUDGET_BYTES else None


@dataclass(frozen=True)
class FtmemConfig(_Section):
    """Validated ftmem settings. Build it with :meth:`from_dict` from user input."""

    KEY: ClassVar[str] = "ftmem"

    ec: ECConfig = _key(ECConfig)
    # Ranks per (virtual) node; None means the launcher's LOCAL_WORLD_SIZE.
    ranks_per_node: Optional[int] = _key(kind=int, optional=True, minimum=1, maximum=MAX_COUNT)
    shm_dir: str = _key("/dev/shm", kind=str)
    dp_shard: str = _key("auto", kind=str, choices=DP_SHARD_CHOICES)
    persist: PersistConfig = _key(PersistConfig)
    network: NetworkConfig = _key(NetworkConfig)
    preemption: PreemptionConfig = _key(PreemptionConfig)
    failure_detection: FailureDetectionConfig = _key(FailureDetectionConfig)
    slots: int = _key(DATA_SLOTS, kind=int, choices=SLOT_CHOICES)
    # What the job's slots may take of each node's shared memory (None: what the filesystem has free).
    shm_budget: Union[str, int, None] = _key(kind=(str, int), optional=True, rule_text=BUDGET_RULE,
                                             rule=lambda spec: budget_bytes(spec, 1 << 40) is not None)
    job_id: Optional[str] = _key(kind=str, optional=True, rule=is_job_id, rule_text=JOB_ID_RULE)
    # Memory holds a version of another layout, model or args: load the disk checkpoint
    # instead of stopping (AdapterRuntime.plan_resume).
    allow_disk_fallback: bool = _key(False, kind=bool)

    def check(self) -> None:
        problem = shm_dir_problem(self.shm_dir)
        if problem:
            raise ConfigError(f'"ftmem.shm_dir" {problem}: {SHM_DIR_ADVICE}.')

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]]) -> "FtmemConfig":
        """Parse the ``"ftmem"`` section of a user config; ``None`` gives the defaults."""
        return cls.parse(section)


def seconds_from_env(name: str, default: float, minimum: float, what: str) -> float:
    """A duration an environment variable may set (tuning, not job config): ``name``'s
    value in seconds, from ``minimum`` to MAX_WAIT_S; ``default`` when it is unset. ``what``
    says what the seconds are, for the error a bad value gets."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not minimum <= value <= MAX_WAIT_S:  # NaN fails too
        raise ConfigError(f"{name}={raw!r}: give {what}, in seconds (from {minimum:g} to {MAX_WAIT_S:,}).")
    return value
