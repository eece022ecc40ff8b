"""Whole virtual nodes lost — all their ranks SIGKILLed, their SMP killed, their
shared memory deleted — and the job restored from its EC groups' parity, bitwise."""
import os

import pytest

from harness.common import REPO, flip_byte, job_id
from harness.ranks import LocalJob
from ftmem._shm import jobs
from ftmem._shm.slots import PARITY, RankStore
from harness.toy import TIMEOUT, TrainJob, reference_run


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs by world size (EC and node layout do not change the training)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = reference_run(tmp_path_factory.mktemp(f"reference{world}"), world)
        return cache[world]
    return get


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, node 1 rebuilt from parity (k=2, m=1)")
def test_k2_m1_loses_one_node_of_three(shm_dir, tmp_path, references):
    job = TrainJob(shm_dir, tmp_path, world=3, ec=(2, 1))
    job.run_until_stopped(after=5)
    assert [job.nodes()[n]["protected"] for n in range(3)] == [5, 5, 5]
    job.lose_node(1)
    job.restart_and_check(references(3), expect_version=5, rebuilt_ranks={1})


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 4, nodes 0 and 2 rebuilt from parity (k=2, m=2)")
def test_k2_m2_loses_two_nodes_of_four(shm_dir, tmp_path, references):
    job = TrainJob(shm_dir, tmp_path, world=4, ec=(2, 2))
    job.run_until_stopped(after=4)
    job.lose_node(0)
    job.lose_node(2)
    job.restart_and_check(references(4), expect_version=4, rebuilt_ranks={0, 2})


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 3, both ranks of node 2 rebuilt from parity")
def test_two_ranks_per_node_lose_a_node(shm_dir, tmp_path, references):
    job = TrainJob(shm_dir, tmp_path, world=6, ranks_per_node=2, ec=(2, 1))
    job.run_until_stopped(after=3)
    job.lose_node(2)
    job.restart_and_check(references(6), expect_version=3, rebuilt_ranks={4, 5})


@pytest.mark.fault("more nodes lost than parity", phase="between saves", framework="engine (toy trainer)",
                   expect="refuses with a reason: every rank exits 3 naming the EC group and the nodes it lacks")
def test_more_losses_than_parity_is_not_recoverable_and_says_where(shm_dir, tmp_path):
    job = TrainJob(shm_dir, tmp_path, world=3, ec=(2, 1))
    job.run_until_stopped(after=5)
    job.lose_node(0)
    job.lose_node(2)
    codes = job.run()
    assert codes == [3, 3, 3]
    log = job.log(1)
    assert "no version is recoverable from memory" in log
    assert "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 2]" in log
    assert "Fall back to a disk checkpoint" in log


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, the damaged data shard rebuilt from parity")
def test_a_corrupted_data_shard_is_rebuilt_from_parity(shm_dir, tmp_path, references):
    job = TrainJob(shm_dir, tmp_path, world=3, ec=(2, 1))
    job.run_until_stopped(after=5)
    store = RankStore(job.node_dir(0), 0)
    flip_byte(store.slot_path(store.committed()[5]), 200)
    job.restart_and_check(references(3), expect_version=5, rebuilt_ranks={0})
    assert "rank 0 version 5: data in" in job.log(0) and "does not match its checksum" in job.log(0)


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 4, node 1 lost and rebuilt around a damaged parity "
                          "piece")
def test_a_corrupted_parity_shard_is_routed_around(shm_dir, tmp_path, references):
    """k=2, m=2: node 1 is lost and a parity piece on node 3 is corrupt; the stripes
    that need rebuilding still have enough intact pieces elsewhere."""
    job = TrainJob(shm_dir, tmp_path, world=4, ec=(2, 2))
    job.run_until_stopped(after=4)
    store = RankStore(job.node_dir(3), 3)
    flip_byte(store.slot_path(store.parity_held()[4], PARITY), 5)
    job.lose_node(1)
    job.restart_and_check(references(4), expect_version=4, rebuilt_ranks={1})
    assert "parity piece 0" in job.log(3) and "does not match its checksum" in job.log(3)


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, node 1 rebuilt from parity, DP-sharded or not")
def test_dp_sharding_keeps_a_slice_per_replica_and_off_restores_the_same(shm_dir, tmp_path, references):
    sharded = TrainJob(shm_dir, tmp_path / "on", world=3, ec=(2, 1))
    sharded.run_until_stopped(after=5)
    plan = RankStore(sharded.node_dir(1), 1).read_commit(5).plan
    assert plan.shard.count == 3 and plan.shard.index == 1
    assert plan.shard.nbytes <= plan.shard.stream_nbytes // 3 + 1  # a third of the replicated bytes
    sharded.lose_node(1)
    sharded.restart_and_check(references(3), expect_version=5, rebuilt_ranks={1})

    whole = TrainJob(shm_dir, tmp_path / "off", world=3, ec=(2, 1))
    whole.args += ["--dp-shard", "off"]
    whole.run_until_stopped(after=5)
    assert RankStore(whole.node_dir(1), 1).read_commit(5).plan.shard is None
    whole.lose_node(1)
    whole.restart_and_check(references(3), expect_version=5, rebuilt_ranks={1})


# Each rank saves bytes of its own, of unequal lengths, so that the last rounds run past the
# shorter members' data (padded with zeros); the exchange is cut into rounds of a few KiB,
# so that protecting one version takes many rounds with two in flight at once.
ROUNDS_SCRIPT = """
import sys
import torch, torch.distributed as dist
from ftmem import SnapshotEngine
from ftmem._ec import protect

protect.EXCHANGE_ROUND = 4096
shm_dir, job, k, m, phase = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo")
rank = dist.get_rank()
engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1, "dp_shard": "off",
                         "ec": {"k": k, "m": m}})
mine = torch.randint(0, 256, (50_000 + 7_777 * rank,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
if phase == "save":
    engine.save({"bytes": mine}, 1).wait_protected()
    engine.close()  # the memory stays, as after a crash
else:
    restored = engine.restore()
    same = restored is not None and restored.version == 1 and torch.equal(restored.state["bytes"], mine)
    print(f"rank {rank} restored its own bytes: {same}, rebuilt: {restored.rebuilt}", flush=True)
    engine.close(job_finished=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("nodes,k,m,lost", [(3, 2, 1, [1]), (4, 2, 2, [0, 3])], ids=["xor", "reed-solomon"])
@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: the lost nodes' bytes rebuilt exactly from parity written in "
                          "rounds")
def test_a_version_protected_in_many_rounds_rebuilds_bitwise(shm_dir, tmp_path, nodes, k, m, lost):
    """Protection moves its pieces in rounds, the next round's under way while one encodes:
    lost nodes rebuilt from parity written that way get their bytes back exactly."""
    (tmp_path / "rounds_job.py").write_text(ROUNDS_SCRIPT)
    job, env = job_id(), {"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}

    def run(phase):
        ranks = LocalJob("rounds_job", [shm_dir, job, str(k), str(m), phase], nodes, job, str(tmp_path / phase),
                         env=env)
        assert ranks.wait(TIMEOUT) == [0] * nodes, ranks.tails()
        return [ranks.log(r) for r in range(nodes)]

    run("save")
    for node in lost:
        jobs.lose_node(shm_dir, job, node)
    logs = run("restore")
    for rank in range(nodes):
        assert f"rank {rank} restored its own bytes: True, rebuilt: {rank in lost}" in logs[rank], logs[rank]
