"""Errors ftmem raises. Each message says what is wrong and what to do about it."""

__all__ = [
    "FtmemError", "ConfigError", "ShmBudgetError", "SmpError", "SmpUnresponsive", "SharedMemoryRemoved",
    "NoRecoverableVersion", "NotRecoverableFromMemory", "CorruptShard", "LayoutMismatch", "EcGeometryMismatch",
    "UnsupportedTensor", "JobAlreadyRunning", "UnsafeSharedMemory", "UnadmittedType", "ForeignVersions",
    "CollectiveNotJoined", "OpenFileLimit",
]


class FtmemError(RuntimeError):
    """Base class of every error ftmem raises on purpose."""


class ConfigError(FtmemError, ValueError):
    """A configuration value or key is wrong."""


class ShmBudgetError(FtmemError):
    """The shared-memory filesystem cannot hold the snapshots this rank needs."""


class SmpError(FtmemError):
    """The node's snapshot management process could not be reached or started."""


class SmpUnresponsive(SmpError):
    """The node's SMP runs but did not answer within the bound (stopped, hung or starved)."""


class SharedMemoryRemoved(FtmemError):
    """The job's shared-memory directory was removed (``ftmem clean``) while the job ran."""


class NoRecoverableVersion(FtmemError):
    """No version is held, intact, by every rank of the job."""


class NotRecoverableFromMemory(NoRecoverableVersion):
    """Versions are held, but none can be rebuilt for every rank: fall back to disk."""


class CorruptShard(FtmemError):
    """A held shard's bytes do not match the checksum taken when it was saved."""


class LayoutMismatch(FtmemError):
    """A held version was saved under another parallel layout than the job runs now."""


class EcGeometryMismatch(LayoutMismatch):
    """Lost data could be rebuilt only from parity written under another EC geometry (k, m,
    nodes) than the job runs now: a change of configuration, refused as a layout change
    is, not a loss for the disk to make up for (so not a NotRecoverableFromMemory)."""


class UnsupportedTensor(FtmemError, TypeError):
    """A tensor kind a snapshot cannot hold (a subclass such as DTensor, sparse, quantized, meta)."""


class JobAlreadyRunning(SmpError):
    """Another live process already runs this rank of the job: two jobs share one id."""


class UnsafeSharedMemory(FtmemError):
    """A directory or file in shared memory that another user could have planted or may change."""


class UnadmittedType(FtmemError, TypeError):
    """A state holds an object of a type that a snapshot's skeleton does not admit."""


class ForeignVersions(FtmemError):
    """Shared memory under this job's id holds versions another job saved."""


class CollectiveNotJoined(FtmemError):
    """A collective (a read of every rank's snapshot) that some ranks did not join in time."""


class OpenFileLimit(FtmemError):
    """The process's open-file limit leaves no room for ftmem's groups and connections."""
