"""Megatron in-memory checkpoints (--non-persistent-ckpt-type in_memory) on the real
megatron-core (CPU, gloo): ranks SIGKILLed, a whole virtual node lost, the job
restarted with the same command, restored from memory (rebuilt from parity where the
node was lost), and bitwise equal to an uninterrupted run without ftmem (no
in_memory, no --ftmem-* flag: Megatron's own --ckpt-format torch saves only) —
per-iteration losses and every rank's final parameters and optimizer state."""
import os
import re
import shutil
import signal

import pytest

from ftmem import restored_from_disk, restored_from_memory
from ftmem._shm import jobs
from harness.common import ANY, logged, read_json, run_cli
from harness.megatron_jobs import ITERS, STOP, TIMEOUT, MegatronJob, reference

@pytest.mark.parametrize("world, parallel, ftmem, lost_node, replicas", [
    (2, ["--tensor-model-parallel-size", "2"], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1",
                                                "--ftmem-ec-m", "1"], 1, 1),
    # PP 2 x DP 2 on 4 virtual nodes, k=2, m=1, DP sharding left to "auto".
    (4, ["--pipeline-model-parallel-size", "2"], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "2",
                                                  "--ftmem-ec-m", "1"], 3, 2),
    # TP 2 x DP 2 on 4 virtual nodes, k=2, m=1; replicated weights and optimizer state
    # are kept once across the DP replicas.
    pytest.param(4, ["--tensor-model-parallel-size", "2"], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "2",
                                                         "--ftmem-ec-m", "1", "--ftmem-dp-shard", "on"], 2, 2,
                 marks=pytest.mark.compat),
    # DP 2 with megatron-core's DistributedOptimizer: its state is split, not replicated.
    (2, ["--use-distributed-optimizer"], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1",
                                          "--ftmem-dp-shard", "on"], 1, 2),
], ids=["tp2", "pp2-dp2", "tp2-dp2-dp-shard", "dp2-distributed-optimizer"])
@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="Megatron (megatron-core)",
                   expect="resumes bitwise from memory: iteration 3, the lost node's rank rebuilt from parity")
def test_resume_after_losing_a_node_is_bitwise(world, parallel, ftmem, lost_node, replicas, shm_dir, tmp_path):
    ref = reference(world, parallel, str(tmp_path / "reference"))
    job = MegatronJob(world, parallel, ftmem, shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    for rank in range(world):
        total, shared = map(float, re.search(r"snapshots ([\d.]+) MiB of tensors per version, ([\d.]+) MiB of them "
                                             rf"identical on its {replicas} DP replica", job.log(rank)).groups())
        # Without DP replicas nothing is shared; with them, weights and optimizer state
        # are, except what the distributed optimizer splits (all of its state).
        if replicas == 1:
            assert shared == 0 < total
        elif "--use-distributed-optimizer" in parallel:
            assert 0.3 * total < shared < 0.5 * total  # weights W of W + 3W/2 (main params, 2 moments)
        else:
            assert shared > 0.9 * total
    jobs.lose_node(shm_dir, job.job, lost_node)
    job.run(str(tmp_path / "resumed.json"))
    for rank in range(world):
        assert logged(restored_from_memory(STOP, rank, rebuilt=rank == lost_node), job.log(rank))
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(STOP + 1, ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
    assert jobs.list_jobs(shm_dir) == []


def stopped_after(job: "MegatronJob", world: int) -> None:
    """Run ``job`` on ``world`` ranks until every rank stopped after iteration STOP, then SIGKILL them all."""
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()


# received: the old ranks' data each new rank holds. DP-sharded, new rank R takes old rank
# R, whose replicated bytes lie across it and old rank R + 2; old rank 0 lost, new rank 0
# also needs the rest of its column (old ranks 1, 2, 3) and their parity to rebuild it.
@pytest.mark.parametrize("lost, dp_shard, received, rebuilt", [
    pytest.param([0], "auto", [3, 2], [0], id="a node lost", marks=pytest.mark.fault(
        "node lost (its ranks, SMP and memory)", phase="during an elastic adoption",
        framework="Megatron (megatron-core)",
        expect="resumes bitwise from memory: TP 2 x DP 2 on TP 2 x DP 1, old rank 0 rebuilt, as Megatron loads "
               "its files")),
    pytest.param([], "auto", [2, 2], [], id="shrunk", marks=pytest.mark.fault(
        "restart on fewer or more nodes", phase="during an elastic adoption", framework="Megatron (megatron-core)",
        expect="resumes bitwise from memory: TP 2 x DP 2 on TP 2 x DP 1, each new rank receiving only what it "
               "needs")),
    # Without DP sharding each old rank holds its whole state: a new rank needs its own.
    # Nodes 2 and 3 (DP replica 1, which no new rank takes) lost: more than m=1, yet
    # nothing the relaunch loads is lost, so nothing is rebuilt.
    pytest.param([2, 3], "off", [1, 1], [], id="a replica's nodes lost, no DP sharding", marks=pytest.mark.fault(
        "more nodes lost than parity", phase="during an elastic adoption", framework="Megatron (megatron-core)",
        expect="resumes bitwise from memory: the lost replica is one no new rank takes, so nothing is rebuilt")),
])
def test_a_relaunch_on_fewer_nodes_resumes_from_the_old_world_s_memory_as_megatron_loads_its_files(
        lost, dp_shard, received, rebuilt, shm_dir, tmp_path):
    """TP 2 x DP 2 on 4 virtual nodes (k=3, m=1) stops after iteration 3 and is killed;
    ftmem's job may also lose nodes (node 0: TP rank 0 of DP replica 0, the rank whose state
    the new TP rank 0 takes). Both come back as TP 2 x DP 1 on 2 ranks, their job ids derived
    from the new world: ftmem's relaunch adopts the old world's version from memory, where
    the reference (no ftmem) loads Megatron's torch-format files of iteration 3 (each rank
    its TP rank's file, which DP replica 0 wrote). Each new rank receives only the old bytes
    its state is made of (and those it rebuilds it from). Training then goes on bitwise alike, and the old job's memory is
    freed once the relaunch protects a version of its own."""
    outs = {}
    for name, stock in (("reference", True), ("ftmem", False)):
        job = MegatronJob(4, ["--tensor-model-parallel-size", "2"],
                          ["--ftmem-ranks-per-node", "1", "--ftmem-dp-shard", dp_shard, "--ftmem-ec-k", "3",
                           "--ftmem-ec-m", "1"], shm_dir, str(tmp_path / name), stock=stock)
        job.job = ""  # derived from the save dir and the world
        if stock:
            job.args[job.args.index("--save-interval") + 1] = "1"
        stopped_after(job, 4)
        if not stock:
            [old] = jobs.list_jobs(shm_dir)
            for node in lost:
                jobs.lose_node(shm_dir, old, node)
            job.args[-4:] = ["--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]  # 2 nodes now
        job.world = 2
        job.run(str(tmp_path / f"{name}.json"))
        outs[name] = read_json(str(tmp_path / f"{name}.json"))
    said = f", its rank(s) {rebuilt} rebuilt from parity" if rebuilt else ""
    for rank in range(2):
        assert logged(restored_from_memory(STOP, rank, f"saved by job {old} on 4 ranks (4 nodes of 1){said}"),
                      job.log(rank)), job.log(rank)[-3000:]
        assert (f"rank {rank}: takes old rank(s) [{rank}]'s state of job {old}'s version {STOP} (the data of "
                f"{received[rank]} of its 4 old ranks received, {len(set(rebuilt) & {rank})} rebuilt)") in job.log(rank)
    assert outs["ftmem"]["losses"] == outs["reference"]["losses"]
    assert outs["ftmem"]["digests"] == outs["reference"]["digests"]
    assert f"freed job {old}'s memory" in job.log(0)
    assert old not in jobs.list_jobs(shm_dir)


@pytest.mark.fault("every rank SIGKILLed", phase="during an elastic adoption", framework="Megatron (megatron-core)",
                   expect="resumes bitwise from memory: the relaunch's iteration 5, its memory freed once the job "
                          "protects its own")
def test_the_first_command_run_again_resumes_the_newest_state_its_relaunch_saved(shm_dir, tmp_path):
    """The rerun sequence of DeepSpeed's test_a_rerun_into_the_same_save_dir_... with Megatron.
    TP 2 x DP 2 on 4 virtual nodes stops after iteration 3 and is killed; the relaunch on 2
    ranks (another job, its id derived) adopts that version, stops after iteration 5 and is
    killed too. The first command run again (on 4 ranks, its first job's id) cannot start
    over in place of the newest state (ftmem needs --load with in-memory checkpoints): it
    resumes the relaunch's iteration 5 from memory, although the relaunch's line descends from
    this very job, and frees the relaunch's memory only once it protected a version of its own."""
    def job_on(world: int, ec: tuple[str, str]) -> MegatronJob:
        job = MegatronJob(world, ["--tensor-model-parallel-size", "2"],
                          ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", ec[0], "--ftmem-ec-m", ec[1]], shm_dir,
                          str(tmp_path))
        job.job = ""  # derived from the save dir and the world
        job.logs = str(tmp_path / f"logs-{world}")  # one save dir, a log of each world's own
        return job

    four, two = job_on(4, ("3", "1")), job_on(2, ("1", "1"))
    stopped_after(four, 4)
    [first] = jobs.list_jobs(shm_dir)
    with two.start("--stop-after", str(STOP + 2)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(2)), TIMEOUT, f"iteration {STOP + 2}")
        run.kill_all()
    [relaunch] = jobs.list_jobs(shm_dir)  # it freed the first job once it protected a version of its own
    four.logs += "-again"
    four.run(str(tmp_path / "again.json"))
    for rank in range(4):
        assert logged(restored_from_memory(STOP + 2, rank, f"saved by job {relaunch} on 2 ranks (2 nodes of 1)"),
                      four.log(rank)), four.log(rank)[-3000:]
    assert sorted(read_json(str(tmp_path / "again.json"))["losses"]) == [str(it) for it in range(STOP + 3, ITERS + 1)]
    assert re.search(rf"freed job {relaunch}'s memory on nodes \[.*\]: this job adopted its version {STOP + 2} and "
                     rf"now holds a protected version of its own", four.log(0)), four.log(0)[-3000:]
    assert jobs.list_jobs(shm_dir) in ([], [first])  # the end frees the first job's memory once Megatron saved


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="during an elastic adoption",
                   framework="Megatron (megatron-core)",
                   expect="resumes bitwise from memory: DP 4 to DP 2, rank 1 rebuilt; a TP change is refused with the "
                          "reason")
def test_a_relaunch_at_another_dp_size_with_the_distributed_optimizer_joins_its_split_state_as_megatron_loads_it(
        shm_dir, tmp_path):
    """DP 4 -> DP 2 with the distributed optimizer, whose state each DP rank holds a range
    of: DP 4 on 4 virtual nodes (k=3, m=1) stops after iteration 3 and is killed, and ftmem's
    job loses node 1. A first relaunch on 2 ranks that also changes the TP size is refused
    on every rank with the reason, and leaves the old job's memory as it was. The relaunch at
    DP 2 adopts the old version: each new rank receives the old DP group's data (rank 1's
    rebuilt from parity) and joins its own ranges of the optimizer's buckets by key and
    offset, where the reference (no ftmem) loads Megatron's torch-format files of iteration
    3 (``distrib_optim.pt`` scattered to the new DP ranks). Training then goes on bitwise
    alike."""
    outs = {}
    for name, stock in (("reference", True), ("ftmem", False)):
        job = MegatronJob(4, ["--use-distributed-optimizer"],
                          ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "3", "--ftmem-ec-m", "1"], shm_dir,
                          str(tmp_path / name), stock=stock)
        job.job = ""  # derived from the save dir and the world
        job.args[job.args.index("--micro-batch-size") + 1] = "1"  # a global batch of 4 over 4 replicas
        if stock:
            job.args[job.args.index("--save-interval") + 1] = "1"
        stopped_after(job, 4)
        job.world = 2
        if not stock:
            [old] = jobs.list_jobs(shm_dir)
            jobs.lose_node(shm_dir, old, 1)
            held = jobs.status(shm_dir, old)
            job.args[-4:] = ["--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]  # 2 nodes now
            assert job.start("--tensor-model-parallel-size", "2").wait(TIMEOUT) == [1, 1]
            for rank in range(2):
                assert ("ftmem cannot resume from them: it resumes Megatron from another world's memory only where "
                        "the DP size alone changed (tp_size 1 -> 2)") in job.log(rank), job.log(rank)[-3000:]
                assert f"free them first: ftmem clean --job {old}" in job.log(rank)
            assert jobs.status(shm_dir, old) == held
        job.run(str(tmp_path / f"{name}.json"))
        outs[name] = read_json(str(tmp_path / f"{name}.json"))
    for rank in range(2):
        assert logged(restored_from_memory(STOP, rank, f"saved by job {old} on 4 ranks (4 nodes of 1), its rank(s) "
                                                       f"[1] rebuilt from parity"), job.log(rank)), job.log(rank)[-3000:]
        assert (f"rank {rank}: takes old rank(s) [0, 1, 2, 3]'s state of job {old}'s version {STOP} (the data of 3 "
                f"of its 4 old ranks received, 1 rebuilt)") in job.log(rank)
    assert outs["ftmem"]["losses"] == outs["reference"]["losses"]
    assert outs["ftmem"]["digests"] == outs["reference"]["digests"]
    assert old not in jobs.list_jobs(shm_dir)


@pytest.mark.fault("restart under another parallel layout or model", phase="startup",
                   framework="Megatron (megatron-core)",
                   expect="refuses with a reason: LayoutMismatch naming tp_size 2 -> 1; the disk checkpoint only where "
                          "allowed")
def test_restore_under_another_layout_is_refused_unless_disk_fallback_is_allowed(shm_dir, tmp_path):
    """Memory holds TP=2 snapshots; the job comes back as DP=2. It stops with the
    mismatch named, and loads its persistent checkpoint only when allowed to."""
    mirror = ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]
    # A persistent checkpoint of the new layout (iteration 2); its clean end frees its memory.
    dp2 = MegatronJob(2, [], mirror, shm_dir, str(tmp_path / "dp2"))
    dp2.args[dp2.args.index("--train-iters") + 1] = "2"
    dp2.args[dp2.args.index("--save-interval") + 1] = "2"
    dp2.run(str(tmp_path / "dp2.json"))
    # In memory: iteration 3 of a TP=2 job, which dies.
    tp2 = MegatronJob(2, ["--tensor-model-parallel-size", "2"], mirror, shm_dir, str(tmp_path / "tp2"))
    with tp2.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(2)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    # The same job (identity) restarted as DP=2, loading the DP=2 checkpoint.
    back = MegatronJob(2, [], mirror, shm_dir, str(tmp_path / "back"))
    back.job = tp2.job
    back.args[back.args.index("--save") + 1] = os.path.join(str(tmp_path / "tp2"), "ckpt")  # the same job: its origin
    back.args[back.args.index("--load") + 1] = os.path.join(str(tmp_path / "dp2"), "ckpt")
    codes = back.start().wait(TIMEOUT)
    assert codes == [1, 1]
    assert ("LayoutMismatch: version 3 was saved under another parallel layout" in back.log(0)
            and "tp_size 2 -> 1" in back.log(0) and "To load the disk checkpoint instead (iteration 2), set "
            "\"allow_disk_fallback\": true in the \"ftmem\" config (Megatron: --ftmem-allow-disk-fallback)"
            in back.log(0))
    assert jobs.status(shm_dir, tp2.job)["jobs"][0]["nodes"][0]["versions"] == [1, 2, 3]  # nothing lost

    back.run(str(tmp_path / "back.json"), "--ftmem-allow-disk-fallback")
    assert "tp_size 2 -> 1" in back.log(0) and "loading from disk as allow_disk_fallback allows" in back.log(0)
    assert "successfully loaded checkpoint" in back.log(0) and "at iteration 2" in back.log(0)
    assert sorted(read_json(str(tmp_path / "back.json"))["losses"], key=int) == ["3", "4", "5", "6"]
    assert jobs.list_jobs(shm_dir) == []


@pytest.mark.fault("restart under another parallel layout or model", phase="startup",
                   framework="Megatron (megatron-core)",
                   expect="resumes bitwise from disk: the snapshot lacks the untied output layer, the allowed fallback "
                          "trains as Megatron")
def test_a_load_that_builds_its_template_then_refuses_memory_trains_as_megatron_from_its_disk_checkpoint(
        shm_dir, tmp_path):
    """Memory holds iteration 3 of a TP 2 GPT with tied embeddings; the job comes back with
    untied ones, which no checked arg names: the load builds its template (the optimizer's
    placeholder moments, allocated, not zero-filled), then finds that the snapshot lacks the
    output layer. With the disk fallback allowed it loads Megatron's own checkpoint of
    iteration 2 and trains on exactly as the same model without ftmem does."""
    parallel = ["--tensor-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
    ref = reference(2, parallel, str(tmp_path / "reference"), save_interval=2)
    disk = str(tmp_path / "disk")  # the reference's checkpoint of iteration 2, as if it had stopped there
    shutil.copytree(os.path.join(str(tmp_path / "reference"), "ckpt", "iter_0000002"),
                    os.path.join(disk, "iter_0000002"))
    with open(os.path.join(disk, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    mirror = ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]
    tied = MegatronJob(2, parallel[:2], mirror, shm_dir, str(tmp_path / "tied"))
    with tied.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(2)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    back = MegatronJob(2, parallel, mirror, shm_dir, str(tmp_path / "tied"))
    back.job = tied.job
    back.args[back.args.index("--load") + 1] = disk
    back.run(str(tmp_path / "back.json"), "--ftmem-allow-disk-fallback")
    assert ("lacks ['output_layer.weight'], which this job expects" in back.log(0)
            and "loading from disk as allow_disk_fallback allows" in back.log(0)
            and "successfully loaded checkpoint" in back.log(0) and "at iteration 2" in back.log(0)), \
        back.log(0)[-3000:]
    resumed = read_json(str(tmp_path / "back.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(3, ITERS + 1)}
    assert resumed["digests"] == ref["digests"]


@pytest.mark.fault("restart under another EC geometry", phase="startup", framework="Megatron (megatron-core)",
                   expect="refuses with a reason: naming both geometries, memory kept; the right flags then resume "
                          "bitwise")
def test_a_restart_under_another_ec_geometry_is_refused_and_loses_nothing(shm_dir, tmp_path):
    """A node lost, and the job relaunched with other --ftmem-ec-k/m: the lost node's data
    can be rebuilt only under the geometry its parity was written with. That was taken
    for an unrecoverable loss: the job started from scratch and its first save dropped
    the versions a relaunch with the right flags restores. Now it stops with the reason,
    memory as it was, and the right flags resume bitwise."""
    world, parallel = 4, ["--tensor-model-parallel-size", "2"]
    ref = reference(world, parallel, str(tmp_path / "reference"))
    job = MegatronJob(world, parallel, ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "3", "--ftmem-ec-m", "1"],
                      shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, 1)
    def versions():
        return {n["node"]: n["versions"] for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"] if n["versions"]}

    held, logged_before = versions(), [len(job.log(r)) for r in range(world)]
    codes = job.start("--ftmem-ec-k", "2", "--ftmem-ec-m", "2").wait(TIMEOUT)  # the last flag wins
    assert codes == [1] * world, job.log(0)[-3000:]
    for rank in range(world):
        log = job.log(rank)[logged_before[rank]:]
        assert "LayoutMismatch: no version is recoverable from memory" in log, log[-3000:]
        assert "was written for k=3, m=1 over nodes [0, 1, 2, 3]" in log
        assert "the job now runs k=2, m=2 over nodes [0, 1, 2, 3]" in log
        assert " iteration " not in log  # no training from scratch
    assert versions() == held and sorted(held) == [0, 2, 3]  # nothing dropped

    job.run(str(tmp_path / "resumed.json"))
    for rank in range(world):
        assert logged(restored_from_memory(STOP, rank, rebuilt=rank == 1), job.log(rank))
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(STOP + 1, ITERS + 1)}
    assert resumed["digests"] == ref["digests"]


@pytest.mark.fault("more nodes lost than parity", phase="between saves", framework="Megatron (megatron-core)",
                   expect="refuses with a reason: NotRecoverableFromMemory naming the lost nodes and ftmem clean; "
                          "memory kept")
def test_more_than_m_nodes_lost_with_no_disk_checkpoint_is_refused_not_restarted_from_scratch(shm_dir, tmp_path):
    """TP 2 x DP 2 on 4 virtual nodes, k=3 m=1, no persistent checkpoint yet: two nodes
    lost. Memory cannot serve and --load holds nothing, so the job started from scratch,
    said so in one log line, and its first save dropped what the survivors held. Now
    every rank stops with the reason and the way to start over on purpose; memory stays."""
    world, parallel = 4, ["--tensor-model-parallel-size", "2"]
    job = MegatronJob(world, parallel, ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "3", "--ftmem-ec-m", "1"],
                      shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    for node in (1, 2):
        jobs.lose_node(shm_dir, job.job, node)
    held = {n["node"]: n["versions"] for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"] if n["versions"]}
    assert sorted(held) == [0, 3]
    logged_before = [len(job.log(r)) for r in range(world)]
    assert job.start().wait(TIMEOUT) == [1] * world, job.log(0)[-3000:]
    for rank in range(world):
        log = job.log(rank)[logged_before[rank]:]
        assert ("NotRecoverableFromMemory: memory could not serve (no version is recoverable from memory" in log
                and "lacks node(s) [1, 2]" in log), log[-3000:]
        assert (f"ftmem does not start from scratch in place of what this job saved. To start over on purpose, "
                f"free it first: ftmem clean --job {job.job} --shm-dir {shm_dir}") in log
        assert " iteration " not in log  # no training
    assert {n["node"]: n["versions"] for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"]
            if n["versions"]} == held  # nothing dropped


def test_a_job_that_ends_at_exit_frees_memory_once_megatron_s_own_save_holds_the_newest(shm_dir, tmp_path):
    """Megatron-LM's loop never calls checkpointing.finish(args): ftmem's end runs at exit.
    Where Megatron writes its persistent checkpoints itself (here with the distributed
    optimizer), that end did not know of them: every clean job kept its memory, saying no
    persistent tier was configured. It now reads the save dir's tracker."""
    job = MegatronJob(2, ["--use-distributed-optimizer"], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1",
                                                           "--ftmem-ec-m", "1"], shm_dir, str(tmp_path))
    job.run(str(tmp_path / "out.json"), "--end-at-exit")
    with open(os.path.join(tmp_path, "ckpt", "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(ITERS)  # Megatron's own save of the final iteration
    assert "keeps" not in job.log(0) and jobs.list_jobs(shm_dir) == [], job.log(0)[-3000:]


@pytest.mark.parametrize("drop, add, message", [
    ("--non-persistent-save-interval", [], "needs --non-persistent-save-interval N"),
    (None, ["--ftmem-ec-k", "3", "--ftmem-ec-m", "1"], "needs groups of 4 nodes, but 2 ranks at 1 per node make 2"),
    (None, ["--ftmem-ec-kk", "3"], "unrecognized arguments: --ftmem-ec-kk"),
])
def test_bad_flags_stop_the_driver_before_training(drop, add, message, shm_dir, tmp_path):
    job = MegatronJob(2, [], ["--ftmem-ranks-per-node", "1"], shm_dir, str(tmp_path))
    if drop:
        at = job.args.index(drop)
        del job.args[at:at + 2]
    codes = job.start(*add).wait(TIMEOUT)
    assert codes != [0, 0] and message in job.log(0)
    assert " iteration " not in job.log(0) and jobs.list_jobs(shm_dir) == []


@pytest.mark.parametrize("flags, restored, detail", [
    (["--no-load-rng"], STOP, "without its RNG"),
    (["--no-load-optim"], STOP, "without its optimizer and scheduler"),
    (["--finetune"], STOP, "without its optimizer and scheduler, RNG, iteration"),
    (["--ckpt-step", str(STOP - 1)], STOP - 1, ""),
], ids=["no-load-rng", "no-load-optim", "finetune", "ckpt-step"])
@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="Megatron (megatron-core)",
                   expect="resumes bitwise from memory: as Megatron's own load with the same flag, node 1 rebuilt")
def test_megatron_s_load_flags_shape_a_load_from_memory_as_one_from_disk(flags, restored, detail, shm_dir, tmp_path):
    """Megatron-LM's load flags say what a load puts back. ftmem ignored them: a restore
    from memory put back the optimizer, the RNG and the iteration whatever they said, and
    always memory's newest version. Each flag's load from memory (after a node loss) now
    trains on as Megatron's own load of the same flag does from its files."""
    world, parallel = 2, ["--tensor-model-parallel-size", "2"]
    ftmem = ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]
    outs = {}
    for name, stock in (("reference", True), ("run", False)):
        job = MegatronJob(world, parallel, ftmem, shm_dir, str(tmp_path / name), stock=stock)
        if stock:  # Megatron's own files of every iteration
            job.args[job.args.index("--save-interval") + 1] = "1"
        with job.start("--stop-after", str(STOP)) as run:
            run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT,
                         f"iteration {STOP}")
            run.kill_all()
        if not stock:
            jobs.lose_node(shm_dir, job.job, 1)
        outs[name] = str(tmp_path / f"{name}.json")
        job.run(outs[name], *flags)
    for rank in range(world):
        assert logged(restored_from_memory(restored, rank, detail, rebuilt=rank == 1), job.log(rank))
    resumed, ref = read_json(outs["run"]), read_json(outs["reference"])
    assert resumed["losses"] == ref["losses"] and resumed["digests"] == ref["digests"]


@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="between saves", framework="Megatron (megatron-core)",
                   expect="resumes bitwise from disk: iteration 5, flushed at SIGTERM, two nodes of the group lost")
def test_a_preempted_job_resumes_from_the_checkpoint_written_from_memory_at_sigterm(shm_dir, tmp_path):
    """TP 2 x DP 2 on 4 virtual nodes, one EC group with m=1. Megatron's persistent saves
    (every 3 iterations) are snapshots flushed to --save in the background, in
    Megatron-LM's --ckpt-format torch layout. After iteration 5 every rank gets SIGTERM, as
    in a preemption: the ranks flush memory's newest version (5) too, and end by SIGTERM. Two
    nodes of the group are lost: memory cannot serve, and the job resumes from the checkpoint
    written at the SIGTERM, bitwise from there on."""
    import torch

    world, parallel = 4, ["--tensor-model-parallel-size", "2"]
    ftmem = ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "2", "--ftmem-ec-m", "1"]

    def every_third(job: MegatronJob) -> MegatronJob:
        job.args[job.args.index("--save-interval") + 1] = "3"
        return job

    ref = reference(world, parallel, str(tmp_path / "reference"), save_interval=3)

    job = every_third(MegatronJob(world, parallel, ftmem, shm_dir, str(tmp_path / "run")))
    ckpt = os.path.join(job.root, "ckpt")
    with job.start("--stop-after", "5") as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, "iteration 5")
        for proc in run.procs:
            proc.send_signal(signal.SIGTERM)
        assert run.wait(TIMEOUT) == [-signal.SIGTERM] * world, run.tails()
    assert f"ftmem: rank 0: flushed version 3 to {ckpt}/iter_0000003" in job.log(0)
    assert f"ftmem: flushed version 5 to {ckpt} at SIGTERM: a relaunch resumes from it" in job.log(0)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "5"
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000003"))) == ["mp_rank_00", "mp_rank_01"]
    assert not [name for name in os.listdir(ckpt) if name.endswith(".tmp")]
    # Megatron-LM's keys and forms: plain tensors in the model, one RNG entry (the writer's:
    # every DP rank's only with --data-parallel-random-init, as Megatron-LM 0.19.2 writes it).
    saved = torch.load(os.path.join(ckpt, "iter_0000003", "mp_rank_01", "model_optim_rng.pt"), weights_only=False)
    assert set(saved) == {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                          "rng_state", "num_floating_point_operations_so_far"}
    assert saved["iteration"] == 3 and saved["checkpoint_version"] == 3.0 and len(saved["rng_state"]) == 1
    assert saved["args"].tensor_model_parallel_size == 2 and saved["optimizer"]["state"]
    assert all(type(t) is torch.Tensor for t in saved["model"].values() if isinstance(t, torch.Tensor))

    # `ftmem export` writes memory's newest version (5) from shared memory, the job dead.
    exported = str(tmp_path / "exported")
    out = run_cli("export", "--job", job.job, "--shm-dir", shm_dir, "--out", exported)
    assert out.returncode == 0 and f"exported version 5 to {exported}/iter_0000005" in out.stdout, out.stderr
    assert "] 100%  read " in out.stderr  # the progress bar's last line
    assert sorted(os.listdir(exported)) == ["ftmem_flushed.json", "iter_0000005", "latest_checkpointed_iteration.txt"]
    again = run_cli("export", "--job", job.job, "--shm-dir", shm_dir, "--out", exported)  # not without --force
    assert again.returncode == 2 and f"--out '{exported}' already holds iter_0000005, " \
        f"latest_checkpointed_iteration.txt, which exporting version 5 would replace." in again.stderr, again.stderr

    for node in (1, 2):
        jobs.lose_node(shm_dir, job.job, node)
    out = run_cli("export", "--job", job.job, "--shm-dir", shm_dir, "--out", str(tmp_path / "nothing"))
    assert out.returncode == 2 and "ranks [1, 2] have no node directory here" in out.stderr
    job.run(str(tmp_path / "resumed.json"))
    for rank in range(world):
        assert logged(restored_from_disk(5, ckpt, rank, "no version is recoverable from memory" + ANY), job.log(rank))
    assert "Newest held: version 5: " in job.log(0)
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(6, ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
    assert jobs.list_jobs(shm_dir) == []

    # A new job (no memory) loads the exported iteration 5 and continues bitwise.
    fresh = every_third(MegatronJob(world, parallel, ftmem, shm_dir, str(tmp_path / "fresh")))
    fresh.args[fresh.args.index("--load") + 1] = exported
    fresh.run(str(tmp_path / "fresh.json"))
    assert f"successfully loaded checkpoint from {exported} at iteration 5" in fresh.log(0)
    from_export = read_json(str(tmp_path / "fresh.json"))
    assert from_export["losses"] == {"6": ref["losses"]["6"]} and from_export["digests"] == ref["digests"]
