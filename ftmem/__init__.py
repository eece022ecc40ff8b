"""ftmem: in-memory, erasure-coded fault tolerance for large-model training."""
from .config import FtmemConfig
from .engine import Restored, SnapshotEngine
from .errors import (ConfigError, CorruptShard, FtmemError, LayoutMismatch, NoRecoverableVersion,
                     NotRecoverableFromMemory, ShmBudgetError, SmpError)
from .handle import SaveHandle
from .parallel import ParallelLayout

__all__ = ["FtmemConfig", "SnapshotEngine", "Restored", "SaveHandle", "ParallelLayout", "FtmemError",
           "ConfigError", "CorruptShard", "LayoutMismatch", "NoRecoverableVersion", "NotRecoverableFromMemory",
           "ShmBudgetError", "SmpError"]
