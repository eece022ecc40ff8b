"""ftmem: in-memory, erasure-coded fault tolerance for large-model training."""
from .config import FtmemConfig
from .engine import Restored, SnapshotEngine
from .errors import (ConfigError, CorruptShard, FtmemError, NoRecoverableVersion, ShmBudgetError,
                     SmpError)

__all__ = ["FtmemConfig", "SnapshotEngine", "Restored", "FtmemError", "ConfigError", "CorruptShard",
           "NoRecoverableVersion", "ShmBudgetError", "SmpError"]
