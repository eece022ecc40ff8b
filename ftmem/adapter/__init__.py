"""What a framework adapter uses: the seam (:class:`FrameworkFormat`, :class:`RestoreTargets`),
the runtime around the engine (:class:`AdapterRuntime` and its resume decision), and the
helpers every adapter needs. An adapter imports from here, from ``ftmem`` and from
``ftmem.errors``, never from an internal package (tests/unit/test_structure.py checks it).
"""
from ftmem._common.compat import CPU_SUPPORT, DISTRIBUTED_OPTIMIZER, check as check_versions, require_for
from ftmem._common.logs import job_info, rank_info, restored_from_disk, restored_from_memory
from ftmem._common.parallel import ParallelLayout, gather_dp_groups
from ftmem._disk.durable import Written
from ftmem._disk.format import FrameworkFormat
from ftmem._disk.persist import flushed, save_atomically
from ftmem._engine.elastic import Adopted, OtherWorlds
from ftmem._engine.handle import SaveHandle
from ftmem._engine.rendezvous import everyone_joins
from ftmem._engine.restore import Restored, RestoreTimes
from ftmem._shm.private import write_atomically
from ftmem._shm.slots import VersionRef
from ftmem._state.destinations import RestoreTargets, TensorPlace
from ftmem._state.gc_deferral import with_collection_deferred
from ftmem._state.serialize import elements, refuse_unless_weights_only
from ftmem._state.tree import apply_map_location, holds_tensors, leaves, lowest_rank_first, map_tree, tensors
from ftmem.adapter._runtime import (DISK, MEMORY, SCRATCH, AdapterRuntime, DiskCheckpoint, ResumeSource, Resumption,
                                    check_startup)
from ftmem.config import DP_SHARD_CHOICES, FtmemConfig

__all__ = [
    "AdapterRuntime", "Resumption", "ResumeSource", "MEMORY", "DISK", "SCRATCH", "DiskCheckpoint", "check_startup",
    "check_versions", "require_for", "CPU_SUPPORT", "DISTRIBUTED_OPTIMIZER",
    "FrameworkFormat", "RestoreTargets", "TensorPlace", "Adopted", "OtherWorlds",
    "FtmemConfig", "DP_SHARD_CHOICES", "ParallelLayout", "SaveHandle", "Restored", "RestoreTimes", "VersionRef",
    "with_collection_deferred", "gather_dp_groups", "flushed", "save_atomically", "write_atomically", "Written",
    "everyone_joins",
    "map_tree", "leaves", "tensors", "elements", "holds_tensors", "apply_map_location", "lowest_rank_first",
    "refuse_unless_weights_only",
    "job_info", "rank_info", "restored_from_memory", "restored_from_disk",
]
