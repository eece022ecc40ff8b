"""ftmem: in-memory, erasure-coded fault tolerance for large-model training.

The public API, in three namespaces (everything else is internal and may change):

* ``ftmem``: what an application uses to snapshot and restore its state directly;
* ``ftmem.adapter``: what a framework adapter uses (the seam and the runtime around the engine);
* ``ftmem.errors``: the errors, also exported here.

The layers inside, from the bottom (docs/design/architecture.md walks through them):
``_common`` (identity, parallel layout, log lines), ``_state`` (state <-> bytes), ``_shm``
(shared memory and the SMP), ``_ec`` (erasure coding), ``_disk`` (persistent tier and
export), ``_engine`` (save and restore), then ``adapter``; ``cli`` is the command.
"""
from ftmem._common.logs import restored_from_disk, restored_from_memory
from ftmem._common.parallel import ParallelLayout
from ftmem._engine.engine import SnapshotEngine
from ftmem._engine.handle import SaveHandle
from ftmem._engine.restore import Restored, RestoreTimes
from ftmem._state.destinations import RestoreTargets, TensorPlace
from ftmem._state.rng import rng_states, set_rng_states
from ftmem.config import DP_SHARD_CHOICES, FAILURE_TIMEOUT_S, PREEMPTION_GRACE_S, PREEMPTION_SIGNALS, SLOT_CHOICES, FtmemConfig
from ftmem.errors import (CollectiveNotJoined, ConfigError, CorruptShard, EcGeometryMismatch, ForeignVersions,
                          FtmemError, JobAlreadyRunning, LayoutMismatch, NoRecoverableVersion, NotRecoverableFromMemory,
                          SharedMemoryRemoved, ShmBudgetError, SmpError, SmpUnresponsive, UnadmittedType,
                          UnsafeSharedMemory, UnsupportedTensor)

__all__ = [
    "SnapshotEngine", "FtmemConfig", "DP_SHARD_CHOICES", "SLOT_CHOICES", "PREEMPTION_SIGNALS", "PREEMPTION_GRACE_S", "FAILURE_TIMEOUT_S", "ParallelLayout", "SaveHandle", "Restored",
    "RestoreTimes",
    "rng_states", "set_rng_states",
    # what a restore writes into, instead of new memory (SnapshotEngine.restore's into=)
    "RestoreTargets", "TensorPlace",
    # the contract's log lines, for an application that restores by itself
    "restored_from_memory", "restored_from_disk",
    # errors
    "FtmemError", "ConfigError", "CorruptShard", "LayoutMismatch", "EcGeometryMismatch", "NoRecoverableVersion",
    "NotRecoverableFromMemory", "ShmBudgetError", "SmpError", "SmpUnresponsive", "SharedMemoryRemoved",
    "UnsupportedTensor", "UnadmittedType", "UnsafeSharedMemory", "ForeignVersions", "JobAlreadyRunning",
    "CollectiveNotJoined",
]
