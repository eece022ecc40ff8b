"""The ``--ftmem-*`` flags (docs/configuration.md) and their validation together with Megatron's
``--non-persistent-ckpt-type in_memory`` and ``--non-persistent-save-interval``.

``add_ftmem_args`` has the signature of Megatron-LM's ``extra_args_provider``; the
patch in ``patches/`` and the driver (``examples/megatron/pretrain_gpt.py``) call it too. Call
``validate_ftmem_args(args)`` once ``args.world_size`` is set.
"""
from __future__ import annotations

import argparse

from ftmem import DP_SHARD_CHOICES, FAILURE_TIMEOUT_S, PREEMPTION_GRACE_S, PREEMPTION_SIGNALS, SLOT_CHOICES, ConfigError, FtmemConfig

# Megatron-LM's non-persistent checkpoint types; ftmem implements "in_memory".
NON_PERSISTENT_TYPES = ("global", "local", "in_memory")
IN_MEMORY = "in_memory"

# (flag, dest, FtmemConfig field) of every --ftmem-* flag that configures the engine.
FTMEM_FLAGS = (
    ("--ftmem-ec-k", "ftmem_ec_k", "ec.k"),
    ("--ftmem-ec-m", "ftmem_ec_m", "ec.m"),
    ("--ftmem-ranks-per-node", "ftmem_ranks_per_node", "ranks_per_node"),
    ("--ftmem-shm-dir", "ftmem_shm_dir", "shm_dir"),
    ("--ftmem-dp-shard", "ftmem_dp_shard", "dp_shard"),
    ("--ftmem-job-id", "ftmem_job_id", "job_id"),
    ("--ftmem-slots", "ftmem_slots", "slots"),
    ("--ftmem-shm-budget", "ftmem_shm_budget", "shm_budget"),
    ("--ftmem-network-interface", "ftmem_network_interface", "network.interface"),
    ("--ftmem-preemption-signal", "ftmem_preemption_signal", "preemption.signal"),
    ("--ftmem-preemption-grace-s", "ftmem_preemption_grace_s", "preemption.grace_s"),
    ("--ftmem-failure-detection", "ftmem_failure_detection", "failure_detection.enabled"),
    ("--ftmem-failure-detection-timeout-s", "ftmem_failure_detection_timeout_s", "failure_detection.timeout_s"),
    ("--ftmem-persist-fsync", "ftmem_persist_fsync", "persist.fsync"),
)

# The words a flag takes where the config takes null or a boolean.
FLAG_WORDS = {"preemption.signal": {"none": None}, "failure_detection.enabled": {"on": True, "off": False},
              "persist.fsync": {"on": True, "off": False}}


def add_ftmem_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("ftmem", "in-memory, erasure-coded checkpoints "
                                               "(--non-persistent-ckpt-type in_memory)")
    group.add_argument("--ftmem-ec-k", type=int, default=None,
                       help="data nodes per erasure-coding group (default: min(2, nodes - 1))")
    group.add_argument("--ftmem-ec-m", type=int, default=None,
                       help="parity nodes per group: the node losses a group survives (default: 1)")
    group.add_argument("--ftmem-ranks-per-node", type=int, default=None,
                       help="ranks per node (default: the launcher's LOCAL_WORLD_SIZE)")
    group.add_argument("--ftmem-shm-dir", default=None, help="shared-memory directory (default: /dev/shm)")
    group.add_argument("--ftmem-dp-shard", choices=DP_SHARD_CHOICES, default=None,
                       help="keep state that is identical on data-parallel replicas once across them (default: auto)")
    group.add_argument("--ftmem-job-id", default=None,
                       help="job identity a restart finds its snapshots by (default: FTMEM_JOB_ID, else derived "
                            "from the --save directory and the world layout)")
    group.add_argument("--ftmem-slots", type=int, choices=SLOT_CHOICES, default=None,
                       help="versions each rank keeps in memory: 3 (default) keeps the newest snapshot while an "
                            "older one is being protected; 2 needs less memory and skips a save that comes while "
                            "a protection runs")
    group.add_argument("--ftmem-shm-budget", default=None,
                       help="what the job's snapshots may take of each node's shared memory: a share of the "
                            "filesystem (\"80%%\") or a size (\"64GiB\"); three versions that do not fit it run "
                            "as two (default: what the filesystem has free)")
    group.add_argument("--ftmem-network-interface", default=None,
                       help="network interface ftmem's own gloo groups bind to, apart from the training's "
                            "(default: FTMEM_SOCKET_IFNAME, else the one gloo picks)")
    group.add_argument("--ftmem-preemption-signal", choices=PREEMPTION_SIGNALS + ("none",), default=None,
                       help="the signal that tells the job it will be stopped: every rank flushes the newest "
                            "version to --save first, within the grace (default: SIGTERM; none: off)")
    group.add_argument("--ftmem-preemption-grace-s", type=int, default=None,
                       help=f"seconds that flush may take before the process ends anyway (default: "
                            f"{PREEMPTION_GRACE_S}, under torchrun's 30 s)")
    group.add_argument("--ftmem-failure-detection", choices=("on", "off"), default=None,
                       help="heartbeats between the ranks: a node that dies or hangs ends every rank, so that the "
                            "launcher restarts the job at once instead of after the collective's timeout (default: "
                            "on; off for a rank paused in a debugger)")
    group.add_argument("--ftmem-failure-detection-timeout-s", type=int, default=None,
                       help=f"seconds without a heartbeat after which a rank counts as lost (default: "
                            f"FTMEM_FAILURE_TIMEOUT_S, else {FAILURE_TIMEOUT_S})")
    group.add_argument("--ftmem-persist-fsync", choices=("on", "off"), default=None,
                       help="the persistent checkpoints ftmem writes to --save are on the disk (fsync) before they "
                            "are published and older ones deleted (default: on; off where that is pointless, a RAM "
                            "disk)")
    group.add_argument("--ftmem-allow-disk-fallback", action="store_true",
                       help="when memory holds a version this job cannot use (another parallel layout or model), "
                            "load the persistent checkpoint from --load instead of stopping with the reason")
    return parser


def add_non_persistent_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's own flags, for drivers that do not have them (Megatron-LM does)."""
    group = parser.add_argument_group("non-persistent checkpoints")
    group.add_argument("--non-persistent-ckpt-type", choices=NON_PERSISTENT_TYPES, default=None)
    group.add_argument("--non-persistent-save-interval", type=int, default=None)
    return parser


def _given_ftmem_flags(args) -> list[str]:
    flags = [flag for flag, dest, _ in FTMEM_FLAGS if getattr(args, dest, None) is not None]
    if getattr(args, "ftmem_allow_disk_fallback", False):
        flags.append("--ftmem-allow-disk-fallback")
    return flags


def in_memory(args) -> bool:
    return getattr(args, "non_persistent_ckpt_type", None) == IN_MEMORY


def validate_ftmem_args(args) -> FtmemConfig:
    """Check the flags together; returns the engine configuration. Errors name the
    flags and say what to pass instead."""
    given = _given_ftmem_flags(args)
    if not in_memory(args):
        if given:
            raise ConfigError(f"{', '.join(given)} only apply to in-memory checkpoints, but "
                              f"--non-persistent-ckpt-type is {getattr(args, 'non_persistent_ckpt_type', None)!r}. "
                              f"Add --non-persistent-ckpt-type in_memory, or drop them.")
        return FtmemConfig()
    _check_megatron_flags(args)
    config = _config_of(args)
    _check_the_layout(config, args.world_size)
    return config


def _check_megatron_flags(args) -> None:
    """Megatron's own flags that in-memory checkpoints need, or do not go with."""
    interval = getattr(args, "non_persistent_save_interval", None)
    if not interval or interval < 1:
        raise ConfigError(f"--non-persistent-ckpt-type in_memory needs --non-persistent-save-interval N "
                          f"(N >= 1 iterations between in-memory checkpoints), got {interval!r}.")
    if getattr(args, "async_save", False):
        # Megatron-LM's --async-save hands its own torch_dist saves to a background worker; an
        # in-memory save is asynchronous by itself, and so are the persistent checkpoints ftmem
        # writes from memory. Both at once is not tested with ftmem, so it is not accepted.
        raise ConfigError("--async-save does not go with --non-persistent-ckpt-type in_memory: ftmem's in-memory "
                          "saves already run in the background (the loop waits for the copy only), and with "
                          "--ckpt-format torch so do the persistent checkpoints it writes from memory. Drop "
                          "--async-save.")
    if not getattr(args, "save", None) or not getattr(args, "load", None):
        raise ConfigError("--non-persistent-ckpt-type in_memory needs --save and --load (usually the same "
                          "directory): Megatron takes non-persistent checkpoints only when --save is set and "
                          "restores only with --load, and that is where a disk fallback comes from.")


def _config_of(args) -> FtmemConfig:
    """The engine's configuration from the --ftmem-* flags, checked by the config's own schema;
    its errors name the flags the user wrote, not the config's keys."""
    if (args.ftmem_ec_k is None) != (args.ftmem_ec_m is None):
        raise ConfigError(f"--ftmem-ec-k and --ftmem-ec-m go together (got k={args.ftmem_ec_k}, "
                          f"m={args.ftmem_ec_m}); pass both, or neither for defaults that fit the node count.")
    section = {"ec": {"k": args.ftmem_ec_k, "m": args.ftmem_ec_m} if args.ftmem_ec_k is not None else {}}
    for _, dest, key in FTMEM_FLAGS:
        value = getattr(args, dest, None)
        if value is None or key.startswith("ec."):  # (k and m go together, above)
            continue
        section_name, _, name = key.rpartition(".")
        (section.setdefault(section_name, {}) if section_name else section)[name] = \
            FLAG_WORDS.get(key, {}).get(value, value)
    section["allow_disk_fallback"] = bool(getattr(args, "ftmem_allow_disk_fallback", False))
    try:
        config = FtmemConfig.from_dict(section)  # the config's schema checks every value
        config.network.resolve()  # on every rank, so on every host: an interface one lacks stops the job now
    except ConfigError as e:
        message = str(e)
        for flag, _, key in FTMEM_FLAGS:
            message = message.replace(f'"ftmem.{key}"', flag)
        raise ConfigError(message) from None
    return config


def _check_the_layout(config: FtmemConfig, world_size: int) -> None:
    """Ranks per node and the EC groups against the world size."""
    rpn = config.ranks_per_node
    if rpn is not None and world_size % rpn:
        raise ConfigError(f"--ftmem-ranks-per-node {rpn} does not divide the world size {world_size}: every node "
                          f"holds the same number of ranks.")
    if rpn is not None and config.ec.k is not None:
        nodes = world_size // rpn
        if config.ec.k + config.ec.m > nodes:
            raise ConfigError(f"--ftmem-ec-k {config.ec.k} --ftmem-ec-m {config.ec.m} needs groups of "
                              f"{config.ec.k + config.ec.m} nodes, but {world_size} ranks at "
                              f"{rpn} per node make {nodes}. Use k + m <= {nodes}, or leave both out.")
