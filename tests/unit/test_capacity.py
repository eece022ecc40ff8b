"""``ftmem plan``: the bytes it plans per rank are those the engine plans for the state a job
saves, its per-node figures follow ftmem's EC layout, and bad inputs are refused with the reason.
(The DeepSpeed tests check its figure against what real ZeRO 0-3 jobs allocate:
test_deepspeed.py::test_resume_after_losing_a_node_is_bitwise.)"""
import json
import math

import pytest
import torch

from examples.deepspeed.gpt import GPT, GPTConfig
from ftmem import rng_states
from ftmem.cli import main
from ftmem.capacity import Job, Schedule, plan, rank_bytes
from ftmem._ec.protect import piece_size
from ftmem._state.plan import ALIGN, SnapshotPlan
from ftmem._state.serialize import split_state


def adam_job_state(dtype: torch.dtype) -> dict:
    """What a plain-torch data-parallel job saves after a step of AdamW: the model, fp32
    master weights where the model is 16-bit (mixed precision), the optimizer and the RNG."""
    model = GPT(GPTConfig()).to(dtype)
    master = [p.detach().float().requires_grad_() for p in model.parameters()] if dtype != torch.float32 else None
    trained = master or list(model.parameters())
    optimizer = torch.optim.AdamW(trained)
    for p in trained:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_states()}
    if master:
        state["master"] = master
    return state


@pytest.mark.parametrize("dtype, name, dp", [(torch.float32, "fp32", 1), (torch.float32, "fp32", 4),
                                             (torch.bfloat16, "bf16", 3)])
def test_the_bytes_planned_per_rank_are_what_the_engine_plans_for_the_job_s_state(dtype, name, dp):
    """Every DP replica of the job saves the same model and optimizer; the engine keeps 1/D of
    them (REFT) and the RNG whole. The planner leaves out the RNG state and the 64-byte
    alignment of each tensor (the optimizer's step counters are no more than that)."""
    state = adam_job_state(dtype)
    tensors = split_state(state).tensors
    rng = {id(t) for t in split_state(state["rng"]).tensors}
    # As SnapshotEngine.save: replicated flags only where a DP group has more than one replica.
    flags = [id(t) not in rng for t in tensors] if dp > 1 else None
    allocated = max(SnapshotPlan.for_tensors(tensors, flags, (replica, dp)).nbytes for replica in range(dp))
    params = sum(p.numel() for p in GPT(GPTConfig()).parameters())
    planned = rank_bytes(Job(params=params, dtype=name, tp=1, pp=1, dp=dp, ranks_per_node=1)).kept_bytes
    rng_bytes = sum(t.numel() * t.element_size() for t in tensors if id(t) in rng)
    assert 0 <= allocated - planned <= ALIGN * (len(tensors) + 1) + rng_bytes, (allocated, planned)


@pytest.mark.parametrize("dtype, zero, distributed_optimizer, dp_shard, replicated, unique, kept", [
    ("bf16", 0, False, "auto", 64 * 14, 0, 64 * 14 // 4),  # weights and optimizer alike on every replica
    ("fp32", 0, False, "auto", 64 * 12, 0, 64 * 12 // 4),  # fp32: the weights are the master weights
    ("bf16", 1, False, "auto", 64 * 2, 16 * 12, 32 + 16 * 12),  # the optimizer's partition is the rank's own
    ("fp32", 2, False, "auto", 64 * 4, 16 * 12, 64 + 16 * 12),  # ZeRO keeps fp32 master weights whatever the dtype
    ("bf16", 0, True, "auto", 64 * 2, 16 * 12, 32 + 16 * 12),  # Megatron's distributed optimizer: as ZeRO 1
    ("fp16", 3, False, "auto", 0, 16 * 12, 16 * 12),  # ZeRO 3: the fp32 partition alone
    ("bf16", 1, False, "off", 64 * 2, 16 * 12, 64 * 2 + 16 * 12),  # no DP sharding: the replicated bytes whole
])
def test_each_framework_s_state_is_replicated_or_the_rank_s_own_as_it_saves_it(dtype, zero, distributed_optimizer,
                                                                                dp_shard, replicated, unique, kept):
    job = Job(params=128, dtype=dtype, tp=2, pp=1, dp=4, ranks_per_node=2, zero=zero,
              distributed_optimizer=distributed_optimizer, dp_shard=dp_shard)
    rank = rank_bytes(job)
    assert (rank.params, rank.replicated_bytes, rank.unique_bytes, rank.kept_bytes) == (64, replicated, unique, kept)


def test_protection_lags_by_whole_save_intervals_and_two_slots_save_memory_not_lag():
    """1.75 GB per node (14 bytes a parameter over 4 replicas) at 1 GB/s: 1.75 s to protect."""
    job = Job(params=5 * 10**8, dtype="bf16", tp=1, pp=1, dp=4, ranks_per_node=1, zero=1)  # 4 nodes: k=2, m=1
    three = plan(job, Schedule(net_gbps=1, step_s=1)).ec
    assert three.protect_s == pytest.approx(1.75)
    for interval, lag in ((1, 2), (2, 2), (5, 5)):  # a version is protected at the first save 1.75 s after its own
        assert plan(job, Schedule(net_gbps=1, step_s=1, save_interval=interval)).ec.lag_iterations == lag
    two = plan(job, Schedule(net_gbps=1, step_s=1, slots=2)).ec  # the saves during a protection are skipped
    assert two.lag_iterations == three.lag_iterations
    assert three.memory_bytes - two.memory_bytes == plan(job, Schedule(net_gbps=1, step_s=1)).node_bytes


def plan_cli(capsys, *args) -> tuple[int, str, str]:
    """``ftmem plan ARGS`` in this process (no interpreter to start): status, stdout, stderr."""
    try:
        code = main(["plan", *args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_of_a_70b_gpt_on_64_nodes(capsys):
    """bf16 with Megatron's distributed optimizer: 14 bytes a parameter over TP x PP = 32, 1/16
    kept per rank. EC k=4, m=1 over 64 nodes: 8 groups of 5 and 4 of 6; 2x replication: 32 pairs."""
    code, out, err = plan_cli(capsys, "--params", "70B", "--dtype", "bf16", "--tp", "8", "--pp", "4", "--dp", "16",
                              "--gpus-per-node", "8", "--distributed-optimizer", "--k", "4", "--m", "1",
                              "--net-gbps", "12.5", "--step-s", "6", "--json")
    assert code == 0, err
    got = json.loads(out)
    rank, node = 14 * 70 * 10**9 // 32 // 16, 8 * 14 * 70 * 10**9 // 32 // 16
    assert (got["nodes"], got["k"], got["m"], got["rank"]["kept_bytes"], got["node_bytes"]) == (64, 4, 1, rank, node)
    parity = 8 * piece_size([rank], 4)
    assert got["ec"]["redundancy_bytes"] == parity and abs(parity - node / 4) < 8 * ALIGN
    assert got["ec"]["memory_bytes"] == 3 * node + 2 * parity
    assert got["replication"]["memory_bytes"] == 3 * node + 2 * 8 * piece_size([rank], 1)  # a whole copy, aligned
    for scheme in ("ec", "replication"):
        assert got[scheme]["protect_s"] == pytest.approx(node / 12.5e9, rel=1e-6)  # m x data = data, each way
        assert got[scheme]["lag_iterations"] == 1
    pairs = math.comb(64, 2)
    # Two failures lose a version where both fall into one group (m = 1).
    assert got["ec"]["survival"] == {"1": 1.0, "2": pytest.approx(1 - (8 * math.comb(5, 2) + 4 * math.comb(6, 2))
                                                                  / pairs), "3": pytest.approx(0.799347158)}
    assert got["replication"]["survival"]["2"] == pytest.approx(1 - 32 / pairs)
    # The job's store: each of the 64 nodes beats 3 requests every 5 s (a 60 s timeout), made by
    # the node's beater, and 6 at a decision of the whole job, made by the node's speaker (what
    # the real code makes: test_commands' control-plane bench).
    assert got["control_plane"] == {"failure_timeout_s": 60, "beats_per_s": 64 * 3 / 5, "decision_requests": 64 * 6}


@pytest.mark.parametrize("args, message", [
    (["--params", "70X", "--dp", "16"], "must be a whole number of parameters"),
    (["--params", "70B", "--tp", "8", "--pp", "4", "--dp", "3", "--gpus-per-node", "7"],
     "96 ranks do not fill whole nodes of 7 GPUs"),
    (["--params", "70B", "--dp", "4", "--k", "4", "--m", "1"], "needs EC groups of 5 nodes, but the job fills 4"),
    (["--params", "70B", "--dp", "4", "--k", "2"], "give both --k and --m"),
    (["--params", "70B", "--dp", "4", "--zero", "1", "--distributed-optimizer"], "give one of them"),
    (["--params", "70B", "--dp", "1"], "a job of one node has none"),
])
def test_bad_inputs_are_refused_with_the_reason_and_status_2(capsys, args, message):
    code, _, err = plan_cli(capsys, *args, *(["--gpus-per-node", "1"] if "--gpus-per-node" not in args else []),
                         "--net-gbps", "12.5", "--step-s", "6")
    assert code == 2 and message in err and err.startswith("ftmem plan: "), err
