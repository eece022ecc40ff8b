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
import importlib
from typing import Any

# Where each public name lives. They are imported when first used (PEP 562): a process that
# needs one module of ftmem's, the SMP above all, does not import the whole library and torch
# with it (``import ftmem._shm.smp`` runs this file first).
_PUBLIC = {
    "ftmem._common.logs": ("restored_from_disk", "restored_from_memory"),
    "ftmem._common.parallel": ("ParallelLayout",),
    "ftmem._engine.engine": ("SnapshotEngine",),
    "ftmem._engine.handle": ("SaveHandle",),
    "ftmem._engine.restore": ("Restored", "RestoreTimes"),
    "ftmem._state.destinations": ("RestoreTargets", "TensorPlace"),
    "ftmem._state.rng": ("rng_states", "set_rng_states"),
    "ftmem.config": ("DP_SHARD_CHOICES", "FAILURE_TIMEOUT_S", "PREEMPTION_GRACE_S", "PREEMPTION_SIGNALS",
                     "SLOT_CHOICES", "FtmemConfig"),
    "ftmem.errors": ("CollectiveNotJoined", "ConfigError", "CorruptShard", "EcGeometryMismatch", "ForeignVersions",
                     "FtmemError", "JobAlreadyRunning", "LayoutMismatch", "NoRecoverableVersion",
                     "NotRecoverableFromMemory", "OpenFileLimit", "SharedMemoryRemoved", "ShmBudgetError", "SmpError",
                     "SmpUnresponsive", "UnadmittedType", "UnsafeSharedMemory", "UnsupportedTensor"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'ftmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


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
    "CollectiveNotJoined", "OpenFileLimit",
]
