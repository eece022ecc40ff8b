"""ftmem: in-memory, erasure-coded fault tolerance for large-model training.

What an application or a framework adapter uses is exported here; the submodules are
the engine's parts (see the README's architecture section) and may change.
"""
from .config import DP_SHARD_CHOICES, FtmemConfig
from .engine import SnapshotEngine
from .errors import (ConfigError, CorruptShard, FtmemError, LayoutMismatch, NoRecoverableVersion,
                     NotRecoverableFromMemory, ShmBudgetError, SmpError, UnsupportedTensor)
from .format import FrameworkFormat
from .handle import SaveHandle
from .logs import job_info, rank_info, restored_from_disk, restored_from_memory
from .parallel import ParallelLayout, gather_dp_groups
from .persist import flushed, save_atomically
from .restore import Restored
from .rng import rng_states, set_rng_states
from .runtime import DISK, MEMORY, SCRATCH, AdapterRuntime, Resumption
from .slots import write_atomically

__all__ = ["FtmemConfig", "DP_SHARD_CHOICES", "SnapshotEngine", "Restored", "SaveHandle", "ParallelLayout", "gather_dp_groups",
           "FrameworkFormat", "AdapterRuntime", "job_info", "rank_info", "restored_from_memory", "restored_from_disk", "rng_states", "set_rng_states", "Resumption", "MEMORY", "DISK", "SCRATCH", "flushed",
           "save_atomically", "write_atomically", "FtmemError", "ConfigError", "CorruptShard", "LayoutMismatch",
           "NoRecoverableVersion", "NotRecoverableFromMemory", "ShmBudgetError", "SmpError", "UnsupportedTensor"]
