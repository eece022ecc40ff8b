"""ftmem: in-memory, erasure-coded fault tolerance for large-model training.

What an application or a framework adapter uses is exported here; the submodules are
the engine's parts (see docs/design/architecture.md) and may change.
"""
from .config import DP_SHARD_CHOICES, FtmemConfig
from .destinations import RestoreTargets, TensorPlace
from .elastic import Adopted, OtherWorlds
from .engine import SnapshotEngine
from .errors import (CollectiveNotJoined, ConfigError, CorruptShard, EcGeometryMismatch, FtmemError,
                     JobAlreadyRunning, LayoutMismatch, NoRecoverableVersion, NotRecoverableFromMemory, ShmBudgetError,
                     SmpError, UnadmittedType, UnsafeSharedMemory, UnsupportedTensor)
from .format import FrameworkFormat
from .gc_deferral import collection_deferred
from .handle import SaveHandle
from .identity import world_in_words
from .logs import job_info, rank_info, restored_from_disk, restored_from_memory
from .ownership import ForeignVersions
from .parallel import ParallelLayout, gather_dp_groups
from .persist import flushed, save_atomically
from .restore import Restored, RestoreTimes
from .rng import rng_states, set_rng_states
from .runtime import DISK, MEMORY, SCRATCH, AdapterRuntime, Resumption, check_startup
from .private import write_atomically
from .rendezvous import everyone_joins

__all__ = [
    # the engine, for applications
    "SnapshotEngine", "FtmemConfig", "DP_SHARD_CHOICES", "ParallelLayout", "SaveHandle", "Restored", "RestoreTimes",
    "rng_states", "set_rng_states",
    # the adapter seam and runtime
    "FrameworkFormat", "AdapterRuntime", "Resumption", "Adopted", "OtherWorlds", "MEMORY", "DISK", "SCRATCH", "check_startup",
    "RestoreTargets",
    "TensorPlace", "collection_deferred",
    "gather_dp_groups", "flushed", "save_atomically", "write_atomically", "everyone_joins", "world_in_words",
    # logging and the contract lines
    "job_info", "rank_info", "restored_from_memory", "restored_from_disk",
    # errors
    "FtmemError", "ConfigError", "CorruptShard", "LayoutMismatch", "EcGeometryMismatch", "NoRecoverableVersion",
    "NotRecoverableFromMemory", "ShmBudgetError", "SmpError", "UnsupportedTensor", "UnadmittedType",
    "UnsafeSharedMemory", "ForeignVersions", "JobAlreadyRunning", "CollectiveNotJoined",
]
