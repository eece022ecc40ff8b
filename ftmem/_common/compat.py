"""The versions of torch and the frameworks that ftmem was tested with, and the names of
theirs that ftmem relies on without their promise to keep them.

ftmem reaches into a few private names of torch, DeepSpeed and Megatron (the job's store,
gloo's options, the weights-only unpickler's allow-lists, DeepSpeed's optimizer step) and into
interfaces that appeared in a given release (DeepSpeed's checkpoint-engine factory). Each is
declared here once, with what ftmem does where it is missing. What uses a package checks it
as it starts (:func:`check`): one warning line where the installed version is not one ftmem
was tested with, and a refusal, naming the missing names and what to install, where a name it
cannot run without is gone, rather than an AttributeError at the first save or restore.
``docs/compatibility.md`` is the users' table of the same.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from ftmem.errors import FtmemError

logger = logging.getLogger("ftmem")

# Minor releases `make test-compat` ran its smoke tier on (docs/compatibility.md has the
# dates and the sets), by distribution.
TESTED = {
    "torch": ("2.5", "2.13"),
    "deepspeed": ("0.17", "0.18", "0.19"),
    "megatron-core": ("0.12", "0.13", "0.14", "0.16"),
}
# The oldest releases ftmem runs on (pyproject.toml's floors; docs/compatibility.md says why).
FLOORS = {"torch": "2.5", "deepspeed": "0.17.1", "megatron-core": "0.12"}


# What needs a name, where not all of ftmem does (ForeignName.needed_by).
EVERYWHERE = "ftmem"
GLOO_BINDING = "ftmem.network.interface"
CPU_SUPPORT = "ftmem_megatron.cpu"
DISTRIBUTED_OPTIMIZER = "in-memory checkpoints with --use-distributed-optimizer"
JSON_ALONE = "the DeepSpeed JSON alone"


@dataclass(frozen=True)
class ForeignName:
    """A name of another package that ftmem uses, and what of ftmem needs it: where that is not
    all of ftmem, ``missing`` says what ftmem does where the name is absent."""
    package: str  # the distribution that defines it
    module: str
    attribute: str  # dotted, from the module
    use: str
    needed_by: str = EVERYWHERE
    missing: str = "ftmem refuses to start, naming it"

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.attribute}"

    def present(self) -> bool:
        try:
            found = importlib.import_module(self.module)
        except ImportError:
            return False
        for part in self.attribute.split("."):
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True


_C10D = "torch.distributed.distributed_c10d"
_BINDING = dict(needed_by=GLOO_BINDING, missing="the setting is refused at the job's start, naming the name; "
                                                "without it, ftmem's groups use the training's network")
_CPU = dict(needed_by=CPU_SUPPORT, missing="the CPU support (megatron-core over gloo, no GPU) refuses to switch on, "
                                           "naming the name; on a GPU it is not used")
_DISTRIBUTED = dict(needed_by=DISTRIBUTED_OPTIMIZER, missing="refused at the job's start, naming the name")
NAMES = (
    ForeignName("torch", _C10D, "_get_default_store", "the job's store: the failure detector's beats, the "
                "preemption's decision, agreements between ranks"),
    ForeignName("torch", _C10D, "_set_pg_timeout", "bounding the wait for ftmem's own groups to form"),
    ForeignName("torch", "torch.distributed", "ProcessGroupGloo._Options", "gloo groups bound to ftmem's own "
                "network interface", **_BINDING),
    ForeignName("torch", "torch.distributed", "ProcessGroupGloo._Options._devices", "the same", **_BINDING),
    ForeignName("torch", "torch.distributed", "ProcessGroupGloo._Options._threads", "the same", **_BINDING),
    ForeignName("torch", "torch.distributed", "ProcessGroupGloo._Options._timeout", "the same", **_BINDING),
    ForeignName("torch", "torch.distributed", "ProcessGroupGloo._set_sequence_number_for_group", "the same",
                **_BINDING),
    ForeignName("torch", "torch._weights_only_unpickler", "Unpickler", "loading a snapshot's skeleton with only "
                "admitted types"),
    ForeignName("torch", "torch._weights_only_unpickler", "_get_allowed_globals", "the types torch.load("
                "weights_only=True) admits, which ftmem admits too"),
    ForeignName("torch", "torch._weights_only_unpickler", "_get_user_allowed_globals", "the types a user admitted "
                "with torch.serialization.add_safe_globals"),
    ForeignName("torch", "torch._C", "DisableTorchFunction", "the save call's look at its tensors, untouched by a "
                "torch-function mode the training has on"),
    ForeignName("torch", "torch", "_foreach_copy_", "the snapshot's copy, many tensors per call"),
    ForeignName("torch", "torch", "_import_device_backends", "calling the torch.backends entry points at `import "
                "torch`, through which the DeepSpeed JSON alone switches ftmem on (torch >= 2.5)", JSON_ALONE,
                "a warning at the engine's start: a script must `import ftmem_deepspeed` before "
                "deepspeed.initialize, or DeepSpeed ignores the engine's name and saves with torch.save"),
    ForeignName("deepspeed", "deepspeed.runtime.engine", "create_checkpoint_engine", "selecting ftmem's engine "
                "from the JSON config (DeepSpeed >= 0.17.1)"),
    ForeignName("deepspeed", "deepspeed.runtime.checkpoint_engine.checkpoint_engine", "CheckpointCommitInfo",
                "the checkpoint engine's create/commit interface (DeepSpeed >= 0.17.1)"),
    ForeignName("deepspeed", "deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step", "waiting for the "
                "snapshot's copy before the optimizer step writes the state"),
    ForeignName("deepspeed", "deepspeed.utils.groups", "_get_sequence_data_parallel_group", "the DP groups "
                "DeepSpeed formed, sequence parallelism included"),
    ForeignName("megatron-core", "megatron.core.optimizer.distrib_optimizer",
                "DistributedOptimizer._init_optimizer_states_with_dummy_values", "giving a fresh "
                "DistributedOptimizer over torch's Adam the state its load describes (megatron-core >= 0.14)",
                **_DISTRIBUTED),
    ForeignName("megatron-core", "megatron.core.optimizer.distrib_optimizer",
                "DistributedOptimizer.get_parameter_state_dp_reshardable", "the distributed optimizer's format that "
                "keeps each DP rank's shard as it is, with no gathering (megatron-core >= 0.15)", **_DISTRIBUTED),
    ForeignName("megatron-core", "megatron.core.optimizer.distrib_optimizer",
                "DistributedOptimizer._build_model_and_main_param_groups", "CPU tensors accepted where "
                "megatron-core asks for CUDA ones", **_CPU),
    ForeignName("megatron-core", "megatron.core.optimizer.distrib_optimizer",
                "DistributedOptimizer._set_main_param_and_optimizer_states", "torch's Adam keeps its per-parameter "
                "step through a load of the distributed optimizer's state", **_CPU),
    ForeignName("megatron-core", "megatron.core.tensor_parallel.random", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
                "the CPU RNG tracker's default name", **_CPU),
    ForeignName("megatron-lm", "megatron.training.arguments", "_add_checkpointing_args", "adding the --ftmem-* "
                "flags to Megatron-LM's parser"),
    ForeignName("megatron-lm", "megatron.training.arguments", "_print_args", "printing the --ftmem-* flags "
                "with Megatron-LM's"),
    ForeignName("megatron-lm", "megatron.training.checkpointing", "_get_non_persistent_iteration", "telling "
                "Megatron-LM's disk load that memory held nothing newer", "Megatron-LM's non-persistent checkpoints",
                "nothing: a Megatron-LM without it does not look for non-persistent checkpoints of its own"),
    ForeignName("megatron-lm", "megatron.training.initialize", "_initialize_distributed", "making the "
                "model-parallel groups without a CUDA device", **_CPU),
    ForeignName("megatron-lm", "megatron.training.initialize", "_set_random_seed", "seeding without a CUDA "
                "device", **_CPU),
)

_checked: set[str] = set()


def version(package: str) -> Optional[str]:
    """The installed version of a distribution (a local suffix such as ``+cpu`` dropped); None
    where it is not installed as one (Megatron-LM runs from its source tree)."""
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def _minor(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split(".")[:2] if p.isdigit())


def _at_least(installed: str, floor: str) -> bool:
    def parts(v):
        return tuple(int(p) if p.isdigit() else 0 for p in v.split(".")[:3])
    return parts(installed) >= parts(floor)


def require(names: list[ForeignName]) -> None:
    """Raise FtmemError naming each of ``names`` that is absent, and what to install."""
    gone = [n for n in names if not n.present()]
    if gone:
        package = gone[0].package
        installed = version(package)
        floor = FLOORS.get(package)
        raise FtmemError(
            f"ftmem needs {', '.join(n.dotted for n in gone)} ({'; '.join(n.use for n in gone)}), which this "
            f"{package}{' ' + installed if installed else ''} does not have. Install a {package} that ftmem was "
            f"tested with ({_tested_text(package)}){f', {floor} at the least' if floor else ''}; "
            f"docs/compatibility.md lists every name ftmem needs and the versions tested.")


def require_for(feature: str, package: str) -> None:
    """:func:`require` for the names of ``package`` that ``feature`` needs (a ``needed_by``):
    as that part of ftmem starts."""
    require([n for n in NAMES if n.needed_by == feature and n.package == package])


def check(package: str) -> None:
    """At the start of what uses ``package`` (once per process): FtmemError where it is older
    than ftmem's floor or lacks a name all of ftmem needs; a warning line where its version is
    not among those tested, and one for each missing name that a part of ftmem needs, saying
    what ftmem does without it."""
    if package in _checked:
        return
    installed = version(package)
    floor = FLOORS.get(package)
    if installed is not None and floor is not None and not _at_least(installed, floor):
        raise FtmemError(f"ftmem needs {package} >= {floor}; this process has {installed}. Install {package} "
                         f"{_tested_text(package)} (docs/compatibility.md says why {floor}).")
    require([n for n in NAMES if n.package == package and n.needed_by == EVERYWHERE])
    if installed is not None and package in TESTED and _minor(installed) not in {_minor(t) for t in TESTED[package]}:
        logger.warning("ftmem was not tested with %s %s (tested: %s); see docs/compatibility.md", package, installed,
                       _tested_text(package))
    for name in NAMES:
        if name.package == package and name.needed_by != EVERYWHERE and not name.present():
            logger.warning("%s%s has no %s, which %s needs: %s", package, f" {installed}" if installed else "",
                           name.dotted, name.needed_by, name.missing)
    _checked.add(package)


def installed() -> str:
    """The packages of the matrix installed here, each with whether ftmem was tested with its
    release (``ftmem --version``)."""
    found = []
    for package in TESTED:
        release = version(package)
        if release is not None:
            tested = _minor(release) in {_minor(t) for t in TESTED[package]}
            found.append(f"{package} {release} ({'tested' if tested else 'not tested'})")
    return ", ".join(found)


def _tested_text(package: str) -> str:
    return ", ".join(f"{t}.x" for t in TESTED.get(package, ())) or "no release tested"
