"""Capacity planning (``ftmem plan``): for a model and a cluster, the bytes ftmem keeps per
rank and per node for each version, the parity and the host memory per node, the time to
protect a version, how far protection lags training, and the probability that a version
survives node failures; beside the same figures for 2x replication.

A rank's state, per version. The parameters are split evenly over TP x PP (a rank holds
ceil(params / (TP x PP)) of them; a real pipeline's first and last stages hold the
embeddings too, so give their share if they are the largest). Each parameter takes its
dtype's bytes, and Adam's two moments 8 bytes (fp32); fp32 master weights take 4 bytes more
where the parameters are 16-bit, and under ZeRO 1-3 or Megatron's distributed optimizer
whatever the dtype (their optimizers keep an fp32 partition of the weights). What is
replicated over the DP group and what is unique to the rank follows the framework:

* ZeRO 0, or Megatron without the distributed optimizer: weights and optimizer replicated;
* ZeRO 1 and 2, Megatron's distributed optimizer: weights replicated, the optimizer's
  partition (1/D of it) unique;
* ZeRO 3: the optimizer's partition alone, unique (the module's state holds the partitioned
  weights as empty tensors: they are made from the optimizer's fp32 partition).

With DP sharding (REFT: ``"dp_shard"`` on, or ``auto`` with D > 1) a rank keeps its 1/D
slice of the replicated bytes, as :class:`ftmem._state.plan.SnapshotPlan` lays them out;
without it, all of them. The engine allocates a little more than these figures: each
tensor's bytes are aligned to 64 bytes (``ALIGN``), the slice too, and a snapshot also
holds the rank's RNG states (about 5 KiB) and the optimizer's step counters.

Protection. Under erasure coding each rank's data is cut into k pieces of ``piece_size``
bytes; every piece goes to the m parity holders of its stripe, and each node holds m
pieces of parity per rank (:mod:`ftmem._ec.protect`). So per version a node sends, and
receives, m x k x piece bytes per rank, about m times its data. 2x replication (DLRover's
backup to another node, NVRx's clique replication with 2 members, Gemini's group placement
with 2 copies) sends each node's data whole to one partner and holds the partner's copy:
it is ftmem's k=1, m=1 in memory and traffic, and its survival is that of Gemini's group
placement (:func:`ftmem._ec.survival.replication_survival`). Both keep ``slots`` data
versions and 2 of parity or copies: the protected version's and the one being protected's.

The time to protect a version is the traffic over the network alone, a node sending and
receiving at ``net_gbps`` GB/s each way at once: the copy into shared memory before it, the
encoding (ISA-L, several GB/s per core, overlapped with the transfers) and the latency are
left out, and gloo over TCP may not reach the line rate (``ftmem bench protect`` measures it).

Lag. Protection runs behind training: a version saved at iteration v is protected T
seconds later, and saves come every N iterations, I = N x step_s seconds apart. It is the
newest protected version from the first save after that on, ceil(T / I) x N iterations
after its own: at each save, the newest protected version is that many iterations older than
the one just saved, which a restart that lost a node redoes beyond what one that lost none does.
Training never waits for a protection: with 3 data slots the newest copy waits in the third
slot while another version is protected, and a newer save replaces it, so when T > I only
about every ceil(T / I)-th save gets protected. With 2 (``slots=2``) the lag is the same, but
the saves made during a protection are skipped (:mod:`ftmem._engine.commit`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ftmem.config import DP_SHARD_CHOICES, FAILURE_TIMEOUT_S, SLOT_CHOICES, ECConfig
from ftmem._common.agreement import REQUESTS_PER_DECISION
from ftmem._common.job_store import PROBE_REQUESTS
from ftmem._engine.failure_detector import REQUESTS_PER_BEAT, interval_s
from ftmem.errors import ConfigError
from ftmem._ec import survival
from ftmem._ec.placement import ec_groups
from ftmem._ec.protect import piece_size
from ftmem._shm.slots import PARITY_SLOTS

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MOMENTS_BYTES = 8  # Adam's exp_avg and exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Job:
    """The training job: its model, how it is split over ranks, and how ranks fill nodes."""

    params: int
    dtype: str
    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    zero: int = 0  # DeepSpeed's ZeRO stage
    distributed_optimizer: bool = False  # Megatron's
    dp_shard: str = "auto"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def check(self) -> None:
        if self.dtype not in PARAM_BYTES:
            raise ConfigError(f"the parameters' dtype must be one of {', '.join(PARAM_BYTES)}, got {self.dtype!r}.")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"the ZeRO stage must be 0, 1, 2 or 3, got {self.zero}.")
        if self.dp_shard not in DP_SHARD_CHOICES:
            raise ConfigError(f"dp_shard must be one of {', '.join(DP_SHARD_CHOICES)}, got {self.dp_shard!r}.")
        if self.distributed_optimizer and self.zero:
            raise ConfigError(f"Megatron's distributed optimizer and DeepSpeed's ZeRO stage {self.zero} are two "
                              f"frameworks' ways to shard the optimizer: give one of them (the distributed "
                              f"optimizer is Megatron's ZeRO 1).")
        if min(self.params, self.tp, self.pp, self.dp, self.ranks_per_node) < 1:
            raise ConfigError(f"parameters, TP, PP, DP and GPUs per node must be at least 1, got {self.params}, "
                              f"{self.tp}, {self.pp}, {self.dp} and {self.ranks_per_node}.")
        if self.params < self.tp * self.pp:
            raise ConfigError(f"{self.params} parameters cannot be split over TP x PP = {self.tp * self.pp} "
                              f"model-parallel ranks: give the model's whole parameter count.")
        if self.world % self.ranks_per_node:
            raise ConfigError(
                f"TP x PP x DP = {self.tp} x {self.pp} x {self.dp} = {self.world} ranks do not fill whole nodes of "
                f"{self.ranks_per_node} GPUs (ftmem's nodes all hold the same number of ranks): give a GPU count "
                f"per node that divides {self.world}, or a DP size that makes TP x PP x DP a multiple of "
                f"{self.ranks_per_node}.")
        if self.nodes < 2:
            raise ConfigError(f"the job's {self.world} ranks fill {self.nodes} node of {self.ranks_per_node} GPUs: "
                              f"ftmem protects a version on other nodes, and a job of one node has none. Plan a job "
                              f"of 2 nodes or more.")


@dataclass(frozen=True)
class Schedule:
    """How often the job saves, how fast it trains, and the network it protects over."""

    net_gbps: float  # GB/s per node, each way
    step_s: float  # seconds per iteration
    save_interval: int = 1  # iterations between saves
    slots: int = 3  # data versions kept per rank

    def check(self) -> None:
        if not (0 < self.net_gbps < math.inf and 0 < self.step_s < math.inf):
            raise ConfigError(f"the network throughput and the step time must be positive numbers, got "
                              f"{self.net_gbps} GB/s and {self.step_s} s.")
        if self.save_interval < 1:
            raise ConfigError(f"the save interval must be at least 1 iteration, got {self.save_interval}.")
        if self.slots not in SLOT_CHOICES:
            raise ConfigError(f"ftmem keeps {' or '.join(map(str, SLOT_CHOICES))} data versions per rank, "
                              f"got {self.slots}.")


@dataclass(frozen=True)
class RankBytes:
    """One rank's state per version (see the module's docstring)."""

    params: int  # parameters the rank holds: ceil(params / (TP x PP))
    master_weights: bool  # whether the optimizer keeps fp32 master weights
    dp_sharded: bool  # whether ftmem keeps 1/D of the replicated bytes
    replicated_bytes: int  # what its DP replicas hold alike
    unique_bytes: int  # what only it holds
    kept_bytes: int  # what ftmem keeps of them: the unique bytes, and the replicated ones or, DP-sharded, 1/D of them


@dataclass(frozen=True)
class Protection:
    """What protecting every node's data costs each node, per version, and how safe it is."""

    redundancy_bytes: int  # parity (EC) or the partner's copy (replication) a node holds per version
    memory_bytes: int  # a node's host memory: slots x data + PARITY_SLOTS x redundancy
    sent_bytes: int  # what a node sends, and receives, to protect a version
    protect_s: float  # sent_bytes over the network
    lag_iterations: int  # iterations from a version's save to the first save at which it is protected
    survival: dict[int, float]  # failures -> probability that a version survives that many node failures


@dataclass(frozen=True)
class ControlPlane:
    """What ftmem asks of the job's store, the one TCP store every rank talks to."""

    failure_timeout_s: float  # the failure detector's timeout ("ftmem.failure_detection")
    beats_per_s: float  # the detector's requests per second, the whole job's, all along
    decision_requests: int  # a preemption's decision, or the vote at the job's end: the whole job's, once


@dataclass(frozen=True)
class CapacityPlan:
    job: Job
    schedule: Schedule
    k: int
    m: int
    nodes: int
    rank: RankBytes
    node_bytes: int  # a node's data per version: ranks_per_node x rank.kept_bytes
    ec: Protection
    replication: Protection
    control_plane: ControlPlane


def control_plane(job: Job, failure_timeout_s: float) -> ControlPlane:
    """The job's store's load from ftmem (docs/design/control-plane.md): each node's beater
    beats for its node every :func:`~ftmem._engine.failure_detector.interval_s`; in a decision
    of the whole job, each node's speaker makes a few requests for its node, on a connection it
    made at the engine's start (checked as it is taken). The node's other ranks ask nothing."""
    beats = job.nodes * REQUESTS_PER_BEAT / interval_s(failure_timeout_s)
    return ControlPlane(failure_timeout_s=failure_timeout_s, beats_per_s=beats,
                        decision_requests=job.nodes * (REQUESTS_PER_DECISION + PROBE_REQUESTS))


def rank_bytes(job: Job) -> RankBytes:
    params = math.ceil(job.params / (job.tp * job.pp))
    weights = PARAM_BYTES[job.dtype]
    sharded_optimizer = job.zero >= 1 or job.distributed_optimizer
    master = MASTER_BYTES if weights < MASTER_BYTES or sharded_optimizer else 0
    optimizer = MOMENTS_BYTES + master
    partition = math.ceil(params / job.dp)
    if job.zero == 3:
        replicated, unique = 0, partition * optimizer
    elif sharded_optimizer:
        replicated, unique = params * weights, partition * optimizer
    else:
        replicated, unique = params * (weights + optimizer), 0
    dp_shard = job.dp_shard == "on" or (job.dp_shard == "auto" and job.dp > 1)
    kept = unique + (math.ceil(replicated / job.dp) if dp_shard else replicated)
    return RankBytes(params=params, master_weights=bool(master), dp_sharded=dp_shard, replicated_bytes=replicated,
                     unique_bytes=unique, kept_bytes=kept)


def _lag(protect_s: float, schedule: Schedule) -> int:
    """The lag in iterations; see the module's docstring."""
    if protect_s == 0:  # nothing to protect (m = 0): a version is as safe as it gets at once
        return 0
    return math.ceil(protect_s / (schedule.save_interval * schedule.step_s)) * schedule.save_interval


def _protection(schedule: Schedule, ranks_per_node: int, data_per_rank: int, group_shapes: set[tuple[int, int]],
                survives: dict[int, float]) -> Protection:
    """The figures of a scheme whose groups have the (k, m) of ``group_shapes``: those of
    the node that holds and sends the most."""
    pieces = [(k, m, piece_size([data_per_rank], k)) for k, m in group_shapes]
    redundancy = ranks_per_node * max(m * piece for _, m, piece in pieces)
    sent = ranks_per_node * max(m * k * piece for k, m, piece in pieces)
    protect_s = sent / (schedule.net_gbps * 1e9)
    return Protection(redundancy_bytes=redundancy,
                      memory_bytes=schedule.slots * ranks_per_node * data_per_rank + PARITY_SLOTS * redundancy,
                      sent_bytes=sent, protect_s=protect_s, lag_iterations=_lag(protect_s, schedule),
                      survival=survives)


def _ec_config(k: Optional[int], m: Optional[int], nodes: int) -> tuple[int, int]:
    """(k, m), ftmem's defaults for the node count where both are None; checked as the
    "ec" config is, in the words of the command's flags."""
    if (k is None) != (m is None):
        raise ConfigError(f"give both --k and --m (got k={k}, m={m}), or neither for ftmem's defaults that fit the "
                          f"node count.")
    if m == 0 and k > 1:
        raise ConfigError(f"k={k}, m=0 asks for erasure coding without parity, which protects nothing: give m >= 1, "
                          f"or k=1, m=0 to keep each version on its own node only.")
    if k is not None and k + m > nodes:
        raise ConfigError(f"k={k}, m={m} needs EC groups of {k + m} nodes, but the job fills {nodes} nodes: give "
                          f"k+m <= {nodes}, or plan more nodes.")
    return ECConfig(k=k, m=m).resolve(nodes)


def failures_shown(nodes: int, m: int) -> list[int]:
    """The failure counts a plan gives survival for: from 1 to two beyond what m survives surely."""
    return list(range(1, min(nodes, max(m, 1) + 2, survival.MAX_FAILURES) + 1))


def plan(job: Job, schedule: Schedule, k: Optional[int] = None, m: Optional[int] = None,
         failure_timeout_s: float = FAILURE_TIMEOUT_S) -> CapacityPlan:
    """The capacity plan of ``job`` saving on ``schedule``, erasure coded with ``k`` and
    ``m`` (ftmem's defaults for its node count where both are None), beside 2x replication,
    and the load on the job's store with the failure detector's timeout ``failure_timeout_s``."""
    job.check()
    schedule.check()
    nodes = job.nodes
    if nodes > survival.MAX_NODES:
        raise ConfigError(f"the job fills {nodes:,} nodes; this planner counts survival for at most "
                          f"{survival.MAX_NODES:,}: check TP, PP, DP and the GPUs per node.")
    k, m = _ec_config(k, m, nodes)
    rank = rank_bytes(job)
    failures = failures_shown(nodes, m)
    ec = _protection(schedule, job.ranks_per_node, rank.kept_bytes, {(g.k, g.m) for g in ec_groups(nodes, k, m)},
                     {f: float(survival.ec_survival(nodes, k, m, f)) for f in failures})
    replication = _protection(schedule, job.ranks_per_node, rank.kept_bytes, {(1, 1)},
                              {f: float(survival.replication_survival(nodes, 1, f)) for f in failures})
    return CapacityPlan(job=job, schedule=schedule, k=k, m=m, nodes=nodes, rank=rank,
                        node_bytes=job.ranks_per_node * rank.kept_bytes, ec=ec, replication=replication,
                        control_plane=control_plane(job, failure_timeout_s))
