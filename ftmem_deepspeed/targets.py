"""Which tensors of a restarting DeepSpeed engine a restore from memory writes straight
into (:mod:`ftmem._state.destinations`), instead of into fresh memory that DeepSpeed then copies
from: the module's weights, and the ZeRO-1/2 optimizer's fp32 partitions and state. Each
is named only where ``load_checkpoint`` overwrites it from the checkpoint anyway: the
module unless a ``custom_load_fn`` decides what to load, and the optimizer only when its
state is loaded (not with ``load_optimizer_states=False`` or ``load_module_only``).
ZeRO-3 is left out: its module weights are partitioned, and it loads them its own way.
"""
from __future__ import annotations

from typing import Any, Optional

from ftmem.adapter import RestoreTargets


def restore_targets(engine, load_optimizer_states: bool, load_module_only: bool,
                    custom_load_fn: Any) -> Optional[RestoreTargets]:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if engine.zero_optimization_partition_weights():
        return None
    module = custom_load_fn is None
    optimizer = load_optimizer_states and not load_module_only and isinstance(engine.optimizer, DeepSpeedZeroOptimizer)
    if not (module or optimizer):
        return None

    def targets(state: Any) -> dict:
        files = {}
        for key, saved in state["files"].items():
            if not isinstance(saved, dict):
                continue
            named = {}
            if module and "module" in saved:
                named["module"] = engine.module.state_dict()
            if optimizer and "optimizer_state_dict" in saved:
                named["optimizer_state_dict"] = engine.optimizer.state_dict()
            files[key] = named
        return {"files": files}

    return targets
