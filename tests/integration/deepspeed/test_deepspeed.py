"""The real DeepSpeed (CPU, gloo) checkpointing through ftmem: ranks SIGKILLed, a
whole virtual node lost, the job resumed with load_checkpoint, bitwise equal to an
uninterrupted run without ftmem (DeepSpeed's default checkpoint engine saving every
step; per-step losses and final weights)."""
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.common import ANY, StockFailed, free_shm_dir, job_id, logged, new_shm_dir, run_cli, run_once
from harness.ranks import LocalJob, free_port, wait_until
from harness import strace as syscalls
from ftmem import restored_from_disk, restored_from_memory
from ftmem._engine.failure_detector import EXIT_CODE
from ftmem._shm.procs import process_state
from ftmem._shm.smp_client import running_smp
from ftmem import capacity
from ftmem._shm import jobs
from ftmem._shm.slots import RankStore
from ftmem._state.plan import ALIGN
from examples.deepspeed.gpt import GPT, GPTConfig
from ftmem_deepspeed.stub import is_stub
from harness.ds_jobs import (CONFIGS, ENV, ITERS, STOCK_ENV, STOP, TIMEOUT, DSJob, config_pair, reference,
                             stock_deepspeed_load, stock_script)
from harness.toy import assert_same_training
from examples.engine.demo import read_losses


def node_lost(framework: str, detail: str):
    """The fault campaign's marker of one configuration of the test below."""
    return pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework=framework,
                             expect=f"resumes bitwise from memory: version {STOP + 1}, {detail}")


@pytest.mark.parametrize("config, world, lost_node, ftmem", [
    # no ZeRO: the optimizer state is replicated too, and DP-sharded
    pytest.param("zero0.json", 3, 2, None, id="zero0.json-3-2-None",
                 marks=node_lost("DeepSpeed ZeRO-0", "node 2 rebuilt from parity")),
    pytest.param("zero2.json", 3, 2, None, id="zero2.json-3-2-None",
                 marks=node_lost("DeepSpeed ZeRO-2", "node 2 rebuilt from parity")),
    pytest.param("zero3.json", 3, 0, None, id="zero3.json-3-0-None",
                 marks=(node_lost("DeepSpeed ZeRO-3", "node 0 rebuilt from parity"), pytest.mark.compat)),
    # bf16: DeepSpeed's BF16_Optimizer wrapper
    pytest.param("zero1-bf16.json", 3, 1, None, id="zero1-bf16.json-3-1-None",
                 marks=node_lost("DeepSpeed ZeRO-1", "bf16, node 1 rebuilt from parity")),
    # 2 stages x 3 DP replicas, 2 ranks on each of 3 virtual nodes, k=2, m=1
    pytest.param("pipeline.json", 6, 1, {"ranks_per_node": 2, "ec": {"k": 2, "m": 1}}, id="pipeline.json-6-1-ftmem4",
                 marks=node_lost("DeepSpeed pipeline", "both ranks of node 1 rebuilt from parity")),
    # a model axis of 2 in DeepSpeed's mpu grid, mirrored
    pytest.param("model-parallel.json", 2, 1, None, id="model-parallel.json-2-1-None",
                 marks=node_lost("DeepSpeed pipeline", "a model axis of 2, node 1 rebuilt from its mirror")),
])
def test_resume_after_losing_a_node_is_bitwise(config, world, lost_node, ftmem, shm_dir, tmp_path):
    ref = reference(config, world, str(tmp_path / "reference"))
    job = DSJob(config, world, shm_dir, str(tmp_path / "run"), ftmem=ftmem)
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, lost_node)
    assert job.run("--load") == [0] * world, job.log(0)[-5000:]
    assert "checkpoint engine FtmemCheckpointEngine" in job.log(0)
    if "bf16" in config:
        assert "optimizer BF16_Optimizer" in job.log(0)
    lost_ranks = {r for r in range(world) if r // (ftmem or {}).get("ranks_per_node", 1) == lost_node}
    for rank in range(world):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}", rebuilt=rank in lost_ranks),
                      job.log(rank))
        assert f"rank {rank}: resuming at step {STOP + 1} (client_state)" in job.log(rank)
    assert_same_training(job.out, ref, world, ITERS)
    # No persistent tier: the finished job's newest version stays in memory, and it says so.
    assert f"keeps its newest version ({ITERS}) in shared memory" in job.log(0)
    assert all(n["versions"][-1] == ITERS for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"])
    if "pipeline" not in json.load(open(os.path.join(CONFIGS, config))):  # (its GPT splits unevenly over stages)
        assert_allocated_as_planned(config, world, shm_dir, job.job)


DETECT_S = 4  # the failure detector's timeout in the test below


@pytest.mark.parametrize("failure, lost", [
    pytest.param("hung", 1, id="hung", marks=pytest.mark.fault(
        "host hung (its processes stopped)", phase="after the commit, before parity", framework="DeepSpeed ZeRO-1",
        expect="ends every rank within the detector's timeout, naming the hung node; the relaunch resumes bitwise "
               "from memory, the node rebuilt")),
    pytest.param("hung", 0, id="hung, the store's host", marks=pytest.mark.fault(
        "host hung (its processes stopped)", phase="after the commit, before parity", framework="DeepSpeed ZeRO-1",
        expect="ends every rank within the detector's timeout, naming the job's store as hung; the relaunch "
               "resumes bitwise from memory, the node rebuilt")),
    pytest.param("killed", 1, id="killed", marks=(pytest.mark.fault(
        "node lost (its ranks, SMP and memory)", phase="after the commit, before parity",
        framework="DeepSpeed ZeRO-1",
        expect="resumes bitwise from memory: the survivors end within the detector's timeout, the lost node "
               "rebuilt from parity"), pytest.mark.compat)),
])
def test_a_hung_or_killed_node_ends_the_survivors_at_the_detector_s_timeout_and_the_relaunch_resumes_bitwise(
        failure, lost, shm_dir, tmp_path):
    """A node's processes stopped (SIGSTOP: a hung host, which raises nothing) or killed while the
    job trains: the survivors end with the detector's line naming the node (or, where the node
    served the job's store, the store), not after the training collective's 30 minutes; the node
    is lost, and the relaunch resumes from memory, the node rebuilt from parity, bitwise with
    DeepSpeed's default engine."""
    world = 3
    ref = reference("zero1.json", world, str(tmp_path / "reference"))
    action = "stop" if failure == "hung" else "kill"
    job = DSJob("zero1.json", world, shm_dir, str(tmp_path / "run"), ftmem={"failure_detection": {"timeout_s": DETECT_S}})
    with job.start(rank_env={lost: {"FTMEM_TEST_HOOK": f"after_commit:{action}:rank={lost}:version=3"}}) as run:
        victim = run.procs[lost]
        wait_until(lambda: process_state(victim.pid) in ("T", None, "Z"), TIMEOUT, f"rank {lost} to be {failure}")
        node_dir = dict(jobs.node_dirs(shm_dir, job.job))[lost]
        os.kill(running_smp(node_dir), signal.SIGSTOP if failure == "hung" else signal.SIGKILL)
        # Bounded by the detector's timeout, plus its beats and a loaded machine's slack; without
        # it, the survivors would sit in DeepSpeed's all-reduce for gloo's 30 minutes.
        survivors = [r for r in range(world) if r != lost]
        codes = [run.procs[r].wait(timeout=DETECT_S + 30) for r in survivors]
        if failure == "hung":
            assert codes == [EXIT_CODE] * 2, run.tails()
            # Rank 0 serves the job's store (MASTER_ADDR): stopped, it answers nobody.
            why = (f"the job's store (127.0.0.1:{ANY}) has not answered for {ANY} s: the host that serves it is lost "
                   f"or hung" if lost == 0 else
                   f"node {lost} (host {socket.gethostname()}, rank {lost}) has not answered for {ANY} s (seen "
                   f"by rank {lost - 1})")
            for rank in survivors:
                assert logged(f"rank {rank}: {why}: ending this process (exit code {EXIT_CODE})" + ANY,
                              job.log(rank)), job.log(rank)[-3000:]
                # The silence its beats saw: past the timeout by less than a few beats (late on a loaded machine).
                silent = re.findall(r"has not answered for (\d+) s", job.log(rank))
                assert all(DETECT_S <= int(s) <= 2 * DETECT_S for s in silent), silent
        else:  # the survivors' own all-reduce may fail first, on the connection the kill reset
            assert all(code != 0 for code in codes), run.tails()
        run.kill(lost)
    jobs.lose_node(shm_dir, job.job, lost)
    assert job.run("--load") == [0] * world, job.log(0)[-5000:]
    version = int(re.findall(r"restored iteration (\d+) from memory", job.log(0))[-1])
    for rank in range(world):
        assert logged(restored_from_memory(version, rank, f"tag global_step{version}", rebuilt=rank == lost),
                      job.log(rank))
    assert_same_training(job.out, ref, world, ITERS)


def assert_allocated_as_planned(config: str, world: int, shm_dir: str, job: str) -> None:
    """Each rank's data slots are as large as ``ftmem plan`` plans for the GPT at the config's
    ZeRO stage and dtype, DP = world: more by each tensor's 64-byte alignment and the RNG
    state at most, which the planner leaves out (ftmem/capacity.py)."""
    ds_config = json.load(open(os.path.join(CONFIGS, config)))
    dtype = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
    params = sum(p.numel() for p in GPT(GPTConfig()).parameters())
    planned = capacity.rank_bytes(capacity.Job(params=params, dtype=dtype, tp=1, pp=1, dp=world, ranks_per_node=1,
                                      zero=ds_config["zero_optimization"]["stage"])).kept_bytes
    for node in jobs.status(shm_dir, job)["jobs"][0]["nodes"]:
        for rank in node["ranks"]:
            store = RankStore(node["path"], rank)
            entries = store.read_commit(node["versions"][-1]).plan.entries
            rng = sum(e.nbytes for e in entries if e.dtype == torch.uint8)  # torch's RNG state (rng_states)
            allocated = store.capacity()
            assert 0 <= allocated - planned <= ALIGN * (len(entries) + 1) + rng, (rank, allocated, planned)


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: each replica's own buffers, node 1 rebuilt from parity")
def test_buffers_that_differ_across_replicas_resume_as_each_replica_s_own(shm_dir, tmp_path):
    """DeepSpeed does not keep buffers in step across DP replicas: a BatchNorm's running
    statistics follow each replica's data. ftmem kept the whole module once across the
    replicas, buffers included, so a resume gave each replica a mix of theirs. Final
    weights and buffers of every rank are compared with the uninterrupted run's."""
    config, world = "zero1.json", 3
    ref = DSJob(config, world, None, str(tmp_path / "reference"), stock=True)
    assert ref.run("--batch-norm") == [0] * world, ref.log(0)[-5000:]
    final = [torch.load(os.path.join(ref.out, f"rank{r}.final.pt")) for r in range(world)]
    assert not torch.equal(final[0]["layers.3.batch_norm.running_mean"], final[1]["layers.3.batch_norm.running_mean"])
    job = DSJob(config, world, shm_dir, str(tmp_path / "run"))
    with job.start("--batch-norm", "--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, 1)
    assert job.run("--batch-norm", "--load") == [0] * world, job.log(0)[-5000:]
    for rank in range(world):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}", rebuilt=rank == 1),
                      job.log(rank))
    assert_same_training(job.out, ref.out, world, ITERS)


@pytest.mark.fault("every rank SIGKILLed", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: version 4, and a reload mid-run loads the newest checkpoint")
def test_a_load_mid_run_after_a_resume_loads_the_newest_checkpoint(shm_dir, tmp_path):
    """A second load_checkpoint in one process (a rollback to the newest checkpoint, mid-run)
    loads what the default engine would: the newest. ftmem restored once per process, so a
    job that had resumed from memory got the version it resumed from again, and trained on
    from it, silently."""
    config, world, reload_after = "zero1.json", 3, STOP + 1
    ref = DSJob(config, world, None, str(tmp_path / "reference"), stock=True)
    assert ref.run("--reload-after", str(reload_after)) == [0] * world, ref.log(0)[-5000:]
    job = DSJob(config, world, shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    assert job.run("--load", "--reload-after", str(reload_after)) == [0] * world, job.log(0)[-5000:]
    newest = reload_after + 1
    for rank in range(world):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}"), job.log(rank))
        assert f"rank {rank}: reloaded global_step{newest} after step {reload_after}, next step {newest}" in \
            job.log(rank), job.log(rank)[-3000:]
        assert f"rank {rank}: reloaded global_step{newest}" in ref.log(rank)
    assert_same_training(job.out, ref.out, world, ITERS)


def test_a_reload_restores_into_the_optimizer_s_own_tensors_only_where_deepspeed_loads_them(shm_dir, tmp_path):
    """ftmem restores a version straight into the tensors DeepSpeed would copy it into (the
    ZeRO optimizer's fp32 partitions and Adam state, the module's weights), but only where
    the load overwrites them anyway. Mid-run, one step past the newest checkpoint, that
    checkpoint is loaded without the optimizer's states and then with them: the optimizer
    then holds, bitwise, what it holds with the default engine (without: the moments of the
    step after the save, untouched), and with them ftmem kept every tensor in place."""
    config, stock = config_pair("zero1.json", shm_dir, ec={"k": 1, "m": 1})
    world, got = 2, {}
    for name, cfg, env in (("reference", stock, STOCK_ENV), ("ftmem", config, ENV)):
        run = stock_script(tmp_path, name, cfg, env, world, job_id(), 3, "--reload")
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        for rank in range(world):
            for how in ("without", "with"):
                got[name, rank, how] = torch.load(str(tmp_path / name / f"rank{rank}.reload-{how}-optimizer-states.pt"))
            kept = [int(line.split(";")[1].split()[0]) for line in run.log(rank).splitlines()
                    if line.startswith(f"rank {rank}: reloaded with optimizer states;")]
            assert len(kept) == 1, run.log(rank)[-3000:]
            in_place = kept[0] == len(got[name, rank, "with"])
            assert in_place == (name == "ftmem"), run.log(rank)[-3000:]  # torch.load hands out new tensors
    for rank in range(world):
        for how in ("without", "with"):
            mine, theirs = got["ftmem", rank, how], got["reference", rank, how]
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs), (rank, how)
    assert any(not torch.equal(got["ftmem", 0, "without"][k], got["ftmem", 0, "with"][k])
               for k in got["ftmem", 0, "with"] if k.startswith("state."))  # the two loads differ where they should


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the older tag named, with its own RNG, node 1 rebuilt from "
                          "parity")
def test_a_load_of_an_older_tag_resumes_that_checkpoint_with_its_own_rng(shm_dir, tmp_path):
    """load_checkpoint(save_dir, tag) of a tag older than memory's newest version. ftmem
    restored its newest version first, put back that version's RNG and logged it as
    restored, then served the named tag's files: one step's weights with another step's
    dropout masks, silently. Now the named version is restored (rebuilt after a node loss),
    with its own RNG, and training from it equals the uninterrupted run from that step."""
    config, world, older = "zero1.json", 3, STOP
    ref = reference(config, world, str(tmp_path / "reference"))
    job = DSJob(config, world, shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, 1)
    assert job.run("--load", "--tag", f"global_step{older}") == [0] * world, job.log(0)[-5000:]
    for rank in range(world):
        assert logged(restored_from_memory(older, rank, f"tag global_step{older}", rebuilt=rank == 1), job.log(rank))
        assert "restored iteration %d" % (STOP + 1) not in job.log(rank), job.log(rank)[-3000:]
        assert f"rank {rank}: resuming at step {older} (client_state)" in job.log(rank), job.log(rank)[-3000:]
    assert_same_training(job.out, ref, world, ITERS)


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: as DeepSpeed's elastic loader from its files, node 1 rebuilt")
def test_an_elastic_zero1_checkpoint_resumes_as_deepspeed_s_elastic_loader_does(shm_dir, tmp_path, torch_extensions):
    """"elastic_checkpoint": true: DeepSpeed's elastic loader reads every DP rank's
    optimizer partition, on every rank; with ftmem, the other ranks' are served from
    memory. Both jobs stop after step 3 and are killed; ftmem's also loses a node. The
    resumed training equals, bitwise, DeepSpeed's own elastic resume from its default
    engine's files (that loader is not bitwise with uninterrupted training: it rebuilds
    the optimizer state, and the second step after it differs; and DeepSpeed saves no
    RNG state, hence no dropout here)."""
    # DeepSpeed's own Adam (a torch optimizer keeps no step in its param groups, which the
    # elastic loader needs), built once and loaded under a lock of this test's own.
    env, world = {"TORCH_EXTENSIONS_DIR": torch_extensions}, 3
    outs = {}
    for name, stock in (("reference", True), ("ftmem", False)):
        job = DSJob("zero1-elastic.json", world, shm_dir, str(tmp_path / name), stock=stock, env=env)
        job.args += ["--dropout", "0"]
        with job.start("--stop-after", str(STOP)) as run:
            run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
            run.kill_all()
        if not stock:
            jobs.lose_node(shm_dir, job.job, 1)
        assert job.run("--load") == [0] * world, job.log(0)[-5000:]
        for rank in range(world):
            assert f"rank {rank}: resuming at step {STOP + 1} (client_state)" in job.log(rank), job.log(rank)[-3000:]
            if not stock:
                assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}", rebuilt=rank == 1),
                              job.log(rank))
        outs[name] = job.out
    assert_same_training(outs["ftmem"], outs["reference"], world, ITERS)


def stopped_and_relaunched(job: DSJob, before: int, after: int, load: tuple, lose=None) -> None:
    """``job`` on ``before`` ranks stops after step STOP and is killed (then ``lose(job)``, if
    given); the same command relaunched on ``after`` ranks loads with the flags ``load`` and
    trains to the end."""
    job.world = before
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(before)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    if lose is not None:
        lose(job)
    job.world = after
    assert job.run("--load", *load) == [0] * after, job.log(0)[-5000:]
    for rank in range(after):
        assert f"rank {rank}: resuming at step {STOP + 1}" in job.log(rank), job.log(rank)[-3000:]


def relaunched_reference(config: str, before: int, after: int, load: tuple, root: str, env: dict) -> str:
    """:func:`stopped_and_relaunched` on DeepSpeed's default engine, without ftmem (no dropout:
    DeepSpeed saves no RNG state, and the old ranks' RNG does not carry over to another world);
    the folder of its losses and final weights. Run once per session for the same arguments."""
    def run() -> str:
        job = DSJob(config, before, None, root, stock=True, env=env)
        job.args += ["--dropout", "0"]
        stopped_and_relaunched(job, before, after, load)
        return job.out
    return run_once(("deepspeed-relaunched", config, before, after, load), run)


@pytest.mark.parametrize("config, ftmem, before, lost, after, load", [
    # DeepSpeed's elastic loader joins every old rank's fp32 partition and cuts it for 3 ranks
    # (with the optimizer's moments, DeepSpeed refuses another DP size: ZeRORuntimeException)
    pytest.param("zero1-elastic.json", {"ec": {"k": 2, "m": 1}}, 4, 1, 3, ("--no-optimizer-states",),
                 id="zero1-elastic.json-ftmem0-4-1-3-load0", marks=pytest.mark.fault(
                     "node lost (its ranks, SMP and memory)", phase="during an elastic adoption",
                     framework="DeepSpeed ZeRO-1",
                     expect="resumes bitwise from memory: 4 ranks' version on 3, the lost rank rebuilt, as DeepSpeed's "
                            "elastic loader from its files")),
    # the module alone, at half the DP size (DeepSpeed loads it at any size)
    pytest.param("zero1.json", {"ec": {"k": 1, "m": 1}}, 4, 1, 2, ("--module-only",),
                 id="zero1.json-ftmem1-4-1-2-load1", marks=pytest.mark.fault(
                     "node lost (its ranks, SMP and memory)", phase="during an elastic adoption",
                     framework="DeepSpeed ZeRO-1",
                     expect="resumes bitwise from memory: 4 ranks' module on 2, the lost rank rebuilt, as DeepSpeed "
                            "loads its files")),
    # growing back: 2 nodes' memory read by the ranks of 4
    pytest.param("zero1-elastic.json", {"ec": {"k": 1, "m": 1}}, 2, None, 4, ("--no-optimizer-states",),
                 id="zero1-elastic.json-ftmem2-2-None-4-load2", marks=pytest.mark.fault(
                     "restart on fewer or more nodes", phase="during an elastic adoption",
                     framework="DeepSpeed ZeRO-1",
                     expect="resumes bitwise from memory: 2 ranks' version read by 4, as DeepSpeed's elastic loader "
                            "from its files")),
])
def test_a_relaunch_on_another_number_of_nodes_resumes_from_the_old_world_s_memory_as_deepspeed_loads_its_files(
        config, ftmem, before, lost, after, load, shm_dir, tmp_path, torch_extensions):
    """Ranks on virtual nodes of one rank stop after step 3 and are killed; ftmem's job may
    also lose a node; each job comes back on another number of ranks (its job id derived
    from the new world). ftmem's relaunch adopts the old world's version from memory (the
    lost node's rank rebuilt from parity), where DeepSpeed's default engine loads its
    files: the resumed training is bitwise the same. The relaunch then protects versions
    of its own under its new EC groups, and the old job's memory is freed."""
    # DeepSpeed's own Adam, built once and loaded under a lock of this test's own.
    env = {"TORCH_EXTENSIONS_DIR": torch_extensions, "FTMEM_JOB_ID": ""}
    reference_out = relaunched_reference(config, before, after, load, str(tmp_path / "reference"), env)
    job = DSJob(config, before, shm_dir, str(tmp_path / "ftmem"), ftmem=ftmem, env=env)
    job.args += ["--dropout", "0"]
    olds = []

    def lose(job: DSJob) -> None:
        olds.extend(jobs.list_jobs(shm_dir))  # the id the first world derived
        if lost is not None:
            jobs.lose_node(shm_dir, olds[0], lost)
    stopped_and_relaunched(job, before, after, load, lose)
    [old] = olds
    for rank in range(after):
        rebuilt = "" if lost is None else f", its rank(s) [{lost}] rebuilt from parity"
        assert logged(restored_from_memory(
            STOP + 1, rank, f"tag global_step{STOP + 1}, saved by job {old} on {before} ranks ({before} nodes "
                            f"of 1){rebuilt}"), job.log(rank)), job.log(rank)[-3000:]
    assert_same_training(job.out, reference_out, after, ITERS, joined=before, at=STOP + 1)
    status = json.loads(run_cli("status", "--json", "--shm-dir", shm_dir).stdout)
    [new] = status["jobs"]  # the old job's memory is freed
    assert new["job"] != old and [n["node"] for n in new["nodes"]] == list(range(after))
    # A module-only load leaves DeepSpeed's global step at 0: the relaunch's saves count from there.
    newest = ITERS - (STOP + 1) if "--module-only" in load else ITERS
    assert all(n["versions"][-1] == newest and n["protected"] == newest for n in new["nodes"]), new
    assert f"freed job {old}'s memory on nodes" in job.log(0)


@pytest.mark.fault("restart on fewer or more nodes", phase="during an elastic adoption", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: what the save dir's latest names, never an earlier run's newer "
                          "versions")
def test_a_rerun_into_the_same_save_dir_resumes_its_newest_state_never_an_earlier_run_s_memory(
        shm_dir, tmp_path, torch_extensions):
    """The same experiment run twice into one save dir, as a user reruns from scratch into a
    reused output directory: 4 ranks stop after step 3 and are killed; the relaunch on 3
    ranks (another job, its id derived) adopts their version, trains to the end and ends,
    its memory kept (no persistent tier). Then all of it again: the second relaunch derives
    the same id, and its memory holds the first run's versions 5 and 6, higher numbers than
    anything the second run saved. It resumes what DeepSpeed's ``latest`` names, the second
    run's version 4 (bitwise DeepSpeed's own resume), says which versions are stale, and
    frees the second run's 4-rank job only once it holds a protected version of its own."""
    config, before, after, load = "zero1-elastic.json", 4, 3, ("--no-optimizer-states",)
    env = {"TORCH_EXTENSIONS_DIR": torch_extensions, "FTMEM_JOB_ID": ""}
    reference_out = relaunched_reference(config, before, after, load, str(tmp_path / "reference"), env)
    save_dir, olds = str(tmp_path / "ckpt"), []
    for attempt in (1, 2):
        job = DSJob(config, before, shm_dir, str(tmp_path / f"run{attempt}"), ftmem={"ec": {"k": 2, "m": 1}}, env=env)
        job.args[job.args.index("--save-dir") + 1] = save_dir
        job.args += ["--dropout", "0"]
        stopped_and_relaunched(job, before, after, load, lose=lambda job: olds.append(set(jobs.list_jobs(shm_dir))))
    first, second = olds  # the jobs in memory when each 3-rank relaunch started
    [old], [stale] = first, second - first
    assert second == {old, stale}  # the 4-rank job's id again, and the first relaunch's
    status = json.loads(run_cli("status", "--json", "--shm-dir", shm_dir).stdout)
    assert [j["job"] for j in status["jobs"]] == [stale]  # the relaunch's id: its memory now holds this run's versions
    for rank in range(after):
        assert logged(restored_from_memory(
            STOP + 1, rank, f"tag global_step{STOP + 1}, saved by job {old} on {before} ranks ({before} nodes of 1)"),
            job.log(rank)), job.log(rank)[-3000:]
    stale_versions = re.search(rf"not restoring this job's version\(s\) \[([0-9, ]+)\]: they are of another run than "
                               rf"the save dir's newest checkpoint \(job {old}'s version {STOP + 1}\)", job.log(0))
    assert stale_versions and ITERS in map(int, stale_versions[1].split(", ")), job.log(0)[-3000:]
    assert re.search(rf"freed job {old}'s memory on nodes \[.*\]: this job adopted its version {STOP + 1} and now "
                     rf"holds a protected version of its own", job.log(0)), job.log(0)[-3000:]
    assert_same_training(job.out, reference_out, after, ITERS, joined=before, at=STOP + 1)


@pytest.mark.parametrize("ftmem, message", [
    ({"ranks_per_nod": 1}, "unknown key 'ranks_per_nod' in the \"ftmem\" config. Did you mean 'ranks_per_node'?"),
    ({"ec": {"k": 3, "m": 1}}, "needs groups of 4 nodes, but the job has 3 node(s)"),
    ({"persist": {"dir": "ckpt", "interval": "3"}},
     '"ftmem.persist.interval" must be an integer from 0 to 1,000,000,000, got "3".'),
])
def test_bad_ftmem_section_fails_at_initialize_with_the_reason(ftmem, message, shm_dir, tmp_path):
    job = DSJob("zero1.json", 3, shm_dir, str(tmp_path), ftmem=ftmem)
    codes = job.run()
    assert all(c != 0 for c in codes)
    assert message in job.log(0)


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: version 5, node 1 rebuilt, in a script that never names ftmem")
@pytest.mark.compat
def test_the_json_alone_switches_ftmem_on_in_a_script_that_never_mentions_it(shm_dir, tmp_path):
    """tests/harness/stock_deepspeed_train.py never imports ftmem; "checkpoint": {"engine": "ftmem"}
    in its JSON installs the adapter (ftmem_guard) before the engine is built. It then
    saves every step into memory, ends (keeping the memory: no persistent tier), loses a
    node, and resumes from memory, rebuilt: losses and weights bitwise those of the same
    script on DeepSpeed's default engine, without ftmem."""
    config, stock = config_pair("zero1.json", shm_dir)
    world, iters, job = 3, 8, job_id()

    def run(name: str, config: dict, iters: int, env: dict) -> LocalJob:
        run = stock_script(tmp_path, name, config, env, world, job, iters)
        if run.wait(TIMEOUT) != [0] * world:
            raise (StockFailed("DeepSpeed's default engine (zero1.json)", run.log(0)) if name == "reference"
                   else AssertionError(run.log(0)[-5000:]))
        return run

    reference = run("reference", stock, iters, STOCK_ENV)
    assert "checkpoint engine TorchCheckpointEngine" in reference.log(0)
    first = run("ftmem", config, 5, ENV)
    for rank in range(world):
        assert "checkpoint engine FtmemCheckpointEngine" in first.log(rank), first.log(rank)[-3000:]
        assert 'the DeepSpeed config selects "engine": "ftmem": installed ftmem_deepspeed' in first.log(rank)
    jobs.lose_node(shm_dir, job, 1)
    again = run("ftmem", config, iters, ENV)
    for rank in range(world):
        assert logged(restored_from_memory(5, rank, "tag global_step5", rebuilt=rank == 1), again.log(rank))
    assert_same_training(str(tmp_path / "ftmem"), str(tmp_path / "reference"), world, iters)


def test_a_version_s_stubs_are_on_the_disk_before_it_commits(shm_dir, tmp_path):
    """The stubs are written during save_checkpoint and synced by the copy thread, not the
    training thread: each stub, its tag's directory and the save dir, before the version's
    commit marker is renamed into place (what the kernel was asked, read off a real run by strace)."""
    trace = tmp_path / "trace"
    straced = type("Straced", (LocalJob,), {"wrapper": tuple(syscalls.strace(str(trace)))})
    job = DSJob("zero1.json", 1, shm_dir, str(tmp_path), ftmem={"ec": {"k": 1, "m": 0}})
    assert job.run(launcher=straced) == [0], job.log(0)[-5000:]
    calls = syscalls.calls_in(str(trace))
    stubs = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for step in range(1, ITERS + 1):
        tag = rf"/ckpt/global_step{step}"
        written = [syscalls.first(calls, "rename", rf"{tag}/{stub}\.tmp\.\d+", rf"{tag}/{stub}", near=tag) for stub in stubs]
        synced = [syscalls.first(calls, "fsync", rf"{tag}/{stub}", after=w, near=tag) for stub, w in zip(stubs, written)]
        tag_synced = syscalls.first(calls, "fsync", tag, after=max(synced), near=tag)
        root_synced = syscalls.first(calls, "fsync", "/ckpt", after=tag_synced, near=tag)
        committed = syscalls.first(calls, "rename", rf"\.v{step:012d}\.s\d+\.commit\.tmp\.\d+", rf"\.v{step:012d}\.s\d+\.commit",
                          after=root_synced, near=f".v{step:012d}.")
        training_thread = calls[written[0]].tid
        assert all(calls[i].tid != training_thread for i in (*synced, tag_synced, root_synced, committed))
        # and the training thread syncs nothing of the save dir's
        assert not [c for c in calls if c.tid == training_thread and c.name.startswith(("fsync", "fdatasync"))
                    and any("/ckpt" in p for p in c.paths)]


@pytest.mark.parametrize("stage", [1, 3])
def test_save_16bit_model_writes_a_real_file_equal_to_the_default_engine_s(stage, shm_dir, tmp_path):
    """save_16bit_model is an export, not a snapshot: its model.pt is a real file, as the
    default engine writes it (it used to fail: 'cannot tell the global step')."""
    config, stock = config_pair(f"zero{stage}.json", shm_dir, ec={"k": 1, "m": 1})
    for c in (config, stock):
        c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    world, exported = 2, {}
    for name, cfg, env in (("reference", stock, STOCK_ENV), ("ftmem", config, ENV)):
        out = tmp_path / name
        run = stock_script(tmp_path, name, cfg, env, world, job_id(), 3, "--save-16bit", str(out / "export"))
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        assert all("save_16bit_model returned True" in run.log(r) for r in range(world)), run.log(0)[-3000:]
        path = str(out / "export" / "pytorch_model.bin")
        assert not is_stub(path)
        exported[name] = torch.load(path, weights_only=True)
    assert is_stub(str(tmp_path / "ftmem" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt")
                   if stage < 3 else str(tmp_path / "ftmem" / "ckpt" / "global_step3" /
                                         "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    mine, theirs = exported["ftmem"], exported["reference"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_save_into_another_directory_writes_real_files_and_keeps_the_job_s_snapshot(shm_dir, tmp_path):
    """A second save_checkpoint of the same step into another directory (a copy, as
    DeepSpeed's frozen-weights tests make) is written as the default engine writes it,
    real files, and not snapshotted: a snapshot of that step would replace the one the
    save dir's stubs name. The job then resumes from its own snapshot."""
    config, stock = config_pair("zero1.json", shm_dir, ec={"k": 1, "m": 1})
    world, job, copies = 2, job_id(), {}
    for name, cfg, env, j in (("reference", stock, STOCK_ENV, job_id()), ("ftmem", config, ENV, job)):
        copy = tmp_path / name / "copy" / "global_step3"
        run = stock_script(tmp_path, name, cfg, env, world, j, 3, "--also-save-to", str(copy.parent))
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        copies[name] = {f: torch.load(str(copy / f), weights_only=False) for f in sorted(os.listdir(copy))}
        assert not any(is_stub(str(copy / f)) for f in copies[name])
    assert f"{tmp_path / 'ftmem' / 'copy'} is not this job's save dir ({tmp_path / 'ftmem' / 'ckpt'}): this " \
           f"checkpoint is written there as real files" in run.log(0)
    assert copies["ftmem"].keys() == copies["reference"].keys()
    mine, theirs = copies["ftmem"]["mp_rank_00_model_states.pt"], copies["reference"]["mp_rank_00_model_states.pt"]
    assert mine["module"].keys() == theirs["module"].keys()
    assert all(torch.equal(mine["module"][k], theirs["module"][k]) for k in theirs["module"])
    assert is_stub(str(tmp_path / "ftmem" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"))
    again = stock_script(tmp_path, "ftmem", config, ENV, world, job, 4)
    assert again.wait(TIMEOUT) == [0] * world, again.log(0)[-5000:]
    assert logged(restored_from_memory(3, 0, "tag global_step3"), again.log(0)), again.log(0)[-3000:]


@pytest.mark.parametrize("load", ["--no-optimizer-states", "--module-only"])
def test_zero3_module_loads_are_served_from_memory_bitwise(load, shm_dir, tmp_path):
    """ZeRO-3 load_checkpoint(..., load_optimizer_states=False) rebuilds the weights with
    zero_to_fp32, which reads every rank's files itself: from ftmem's stubs, it is served
    every rank's files of the version restored from memory. The same with
    load_module_only=True. The loaded weights are those the default engine's files give;
    without optimizer states, those the job saved (with load_module_only alone, ZeRO-3
    DeepSpeed takes the module from the rank's own model-states file, which holds no
    partitioned weights: stock DeepSpeed keeps the initial weights, and so does ftmem)."""
    world, loaded = 2, {}
    for name, ftmem in (("stock", None), ("ftmem", {"ec": {"k": 1, "m": 1}})):
        job = DSJob("zero3.json", world, shm_dir, str(tmp_path / name), ftmem=ftmem, stock=ftmem is None)
        job.args[job.args.index("--iters") + 1] = "3"
        assert job.run() == [0] * world, job.log(0)[-3000:]
        for rank in range(world):  # the weights the job trained to, before a reload overwrites them
            os.replace(os.path.join(job.out, f"rank{rank}.final.pt"), os.path.join(job.out, f"rank{rank}.saved.pt"))
        assert job.run("--load", load) == [0] * world, job.log(0)[-3000:]
        for rank in range(world):
            assert "resuming at step 3 (client_state)" in job.log(rank), job.log(rank)[-3000:]
            if ftmem:
                assert logged(restored_from_memory(3, rank, "tag global_step3"), job.log(rank))
            saved, got = (torch.load(os.path.join(job.out, f"rank{rank}.{kind}.pt")) for kind in ("saved", "final"))
            assert saved.keys() == got.keys()
            assert all(torch.equal(saved[k], got[k]) for k in saved) == (load == "--no-optimizer-states")
            loaded[name, rank] = got
    for rank in range(world):
        mine, theirs = loaded["ftmem", rank], loaded["stock", rank]
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("stage, how", [(3, "zero_to_fp32"), (1, "torch-load"), (1, "torch-load-weights-only")])
def test_a_script_reading_checkpoint_files_gets_what_the_default_engine_s_files_hold(stage, how, shm_dir,
                                                                                      tmp_path):
    """Right after its saves, with nothing restored, a script reads the newest checkpoint
    itself on every rank: in-process zero_to_fp32 of the save dir, or torch.load of its
    model-states file by path. With ftmem those are stubs, served from memory; what the
    script gets equals, bitwise, what it gets from the default engine's files."""
    config, stock = config_pair(f"zero{stage}.json", shm_dir, ec={"k": 1, "m": 1})
    world, got = 2, {}
    for name, cfg, env in (("reference", stock, STOCK_ENV), ("ftmem", config, ENV)):
        run = stock_script(tmp_path, name, cfg, env, world, job_id(), 3, "--read-back", how)
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        for rank in range(world):
            assert f"rank {rank}: read back" in run.log(rank), run.log(rank)[-3000:]
            got[name, rank] = torch.load(str(tmp_path / name / f"rank{rank}.read-back.pt"), weights_only=True)
    newest = tmp_path / "ftmem" / "ckpt" / "global_step3"
    assert all(is_stub(str(f)) for f in newest.iterdir())
    for rank in range(world):
        mine, theirs = got["ftmem", rank], got["reference", rank]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_torch_load_with_weights_only_refuses_a_served_stub_as_it_refuses_the_file(shm_dir, tmp_path):
    """A script saves its args (an argparse.Namespace) in the client state, and then reads
    the model-states file with torch.load's default, weights_only=True. torch refuses the
    default engine's file (the Namespace is not an allowed global); a served stub was
    handed over regardless. Now it is refused the same way, with torch's reason."""
    config, stock = config_pair("zero1.json", shm_dir, ec={"k": 1, "m": 1})
    world, said = 2, {}
    for name, cfg, env in (("reference", stock, STOCK_ENV), ("ftmem", config, ENV)):
        run = stock_script(tmp_path, name, cfg, env, world, job_id(), 2, "--client-args", "--read-back",
                           "torch-load-weights-only")
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        for rank in range(world):
            said[name, rank] = re.search(r"torch.load refused: (.*)", run.log(rank))
    for rank in range(world):
        stock_refusal, ftmem_refusal = said["reference", rank], said["ftmem", rank]
        assert stock_refusal and "GLOBAL argparse.Namespace was not an allowed global" in stock_refusal.group(1)
        assert ftmem_refusal, said
        assert ftmem_refusal.group(1).startswith("torch.load(weights_only=True) of ") and \
            "(served from memory) refuses it, as it would refuse the file: Unsupported global: GLOBAL " \
            "argparse.Namespace was not an allowed global" in ftmem_refusal.group(1)


@pytest.mark.parametrize("config, how", [("zero3.json", "zero_to_fp32-on-rank-0"),
                                         ("zero1.json", "ds_to_universal-on-rank-0")])
def test_checkpoint_files_read_on_rank_0_alone_are_served_from_this_host_s_memory(config, how, shm_dir, tmp_path):
    """zero_to_fp32, and DeepSpeed's universal-checkpoint conversion in-process (as DeepSpeed's
    own test_universal_checkpoint.py runs it), read every rank's files on rank 0 while rank 1
    waits elsewhere (in a barrier, or the job's end). Every rank's node memory is on this host:
    rank 0 reads it there, with no collective. What it gets equals, bitwise, what it gets
    from the default engine's files. The conversion copies the model-states files as files
    (``shutil.copy2``), so its copies are the stubs', which stand for the same files: the
    universal checkpoint then loads (``"load_universal"``, new ranks of the same job, as
    DeepSpeed's test goes on) and trains a step bitwise as uninterrupted training without
    ftmem does (DeepSpeed's own universal load leaves the RNG as the script seeded it, so its
    step after the load differs in dropout; ftmem restores the RNG the version saved)."""
    ftmem, stock = config_pair(config, shm_dir, ec={"k": 1, "m": 1})
    runs = {"reference": (stock, STOCK_ENV), "ftmem": (ftmem, dict(ENV, FTMEM_COLLECTIVE_TIMEOUT_S="5"))}
    jobs_of = {name: job_id() for name in runs}
    universal = how == "ds_to_universal-on-rank-0"
    for name, (cfg, env) in runs.items():
        # The reference converts step 2 and trains on to step 3: also the uninterrupted run
        # the universal load is compared with.
        more = ["--read-back-tag", "global_step2"] if universal and name == "reference" else []
        run = stock_script(tmp_path, name, cfg, env, 2, jobs_of[name], 3 if more else 2, "--read-back", how, *more)
        assert run.wait(TIMEOUT) == [0, 0], run.log(0)[-5000:]
    if not universal:
        got, want = (torch.load(tmp_path / name / "rank0.read-back.pt") for name in ("ftmem", "reference"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        return
    assert "rank 0: converted global_step2 to a universal checkpoint" in run.log(0)
    got, want = (tmp_path / name / "ckpt" / "global_step2_universal" for name in ("ftmem", "reference"))
    files = sorted(str(f.relative_to(want)) for f in want.rglob("*") if f.is_file())
    assert files and files == sorted(str(f.relative_to(got)) for f in got.rglob("*") if f.is_file())
    copied = [name for name in files if name.endswith("model_states.pt")]
    assert copied, files
    for name in files:
        if name in copied:
            original = tmp_path / "ftmem" / "ckpt" / "global_step2" / name
            assert is_stub(str(original)) and (got / name).read_bytes() == original.read_bytes(), name
            continue
        mine, theirs = (torch.load(d / name, weights_only=False) for d in (got, want))
        assert_same_values(mine, theirs, name)  # what the conversion read from memory is what the files held
    loads_universal = dict(ftmem, checkpoint={**ftmem["checkpoint"], "load_universal": True})
    run = stock_script(tmp_path, "ftmem", loads_universal, runs["ftmem"][1], 2, jobs_of["ftmem"], 3, "--load-tag",
                       "global_step2_universal")
    assert run.wait(TIMEOUT) == [0, 0], run.log(0)[-5000:]
    assert logged(restored_from_memory(2, 0, "tag global_step2"), run.log(0)), run.log(0)[-3000:]
    for rank in range(2):
        got, want = ((tmp_path / name / f"rank{rank}.losses.jsonl").read_text().splitlines()
                     for name in ("ftmem", "reference"))
        assert len(got) == 3 and got == want  # steps 0-1, then step 2 after the universal load
        mine, theirs = (torch.load(tmp_path / name / f"rank{rank}.final.pt") for name in ("ftmem", "reference"))
        assert_same_values(mine, theirs, f"rank {rank}'s final weights")


@pytest.mark.parametrize("config, saved_on, loaded_on, tag, load", [
    ("zero1.json", 2, 3, None, []),
    ("zero3.json", 3, 2, "global_step2_universal", []),
    ("zero3.json", 2, 3, "global_step2_universal", ["--load-without-optimizer-states"])],
    ids=["zero1-2to3-latest_universal", "zero3-3to2", "zero3-2to3-without-optimizer-states"])
def test_a_universal_checkpoint_loads_onto_another_world_as_the_default_engine_s_does(config, saved_on, loaded_on, tag,
                                                                                     load, shm_dir, tmp_path):
    """Resharding is what a universal checkpoint is for. A job saves with ftmem and converts
    its checkpoint in-process (DeepSpeed's ds_to_universal on rank 0, as its own tests run
    it: the model-states files are copied as they are, stubs of this job), and a job on
    another number of ranks (another job: its id derives from the save dir and the world)
    loads the universal checkpoint and trains a step: every rank's losses and final weights
    are bitwise those of the same two jobs with DeepSpeed's default engine. DeepSpeed's
    universal load reads only the model states' tensor-free entries, which the stubs carry.
    Without a tag, the load takes what ``latest_universal`` names, as DeepSpeed does (not
    memory's newest version, which ``latest`` names). ZeRO-3 without the optimizer's states
    takes the weights from the checkpoint ``latest`` names instead (DeepSpeed's zero_to_fp32
    of the saving job's files, stubs of another world): served from that job's memory on this
    host."""
    ftmem, stock = config_pair(config, shm_dir, ec={"k": 1, "m": 1})
    runs = {"reference": (stock, STOCK_ENV), "ftmem": (ftmem, dict(ENV, FTMEM_COLLECTIVE_TIMEOUT_S="5"))}
    for name, (cfg, env) in runs.items():
        run = stock_script(tmp_path, name, cfg, env, saved_on, None, 2, "--read-back", "ds_to_universal-on-rank-0")
        try:
            assert run.wait(TIMEOUT) == [0] * saved_on, run.log(0)[-5000:]
        except AssertionError:
            if name == "reference":
                raise StockFailed(f"DeepSpeed's universal conversion ({config}, {saved_on} ranks)", run.log(0))
            raise
        loads_universal = dict(cfg, checkpoint={**cfg.get("checkpoint", {}), "load_universal": True})
        run = stock_script(tmp_path, name, loads_universal, env, loaded_on, None, 3,
                           *(["--load-tag", tag] if tag else []), *load)
        assert run.wait(TIMEOUT) == [0] * loaded_on, run.log(0)[-5000:]
    assert re.search(r"global_step2_universal/\S*model_states.pt: a universal checkpoint's copy of a stub of job \S+ "
                     r"on another world", run.log(0)), run.log(0)[-3000:]
    for rank in range(max(saved_on, loaded_on)):
        got, want = ((tmp_path / name / f"rank{rank}.losses.jsonl").read_text().splitlines()
                     for name in ("ftmem", "reference"))
        assert got == want and len(got) == (2 if rank < saved_on else 0) + (1 if rank < loaded_on else 0), rank
    for rank in range(loaded_on):
        mine, theirs = (torch.load(tmp_path / name / f"rank{rank}.final.pt") for name in ("ftmem", "reference"))
        assert_same_values(mine, theirs, f"rank {rank}'s final weights after the universal load")


def assert_same_values(got, want, where: str) -> None:
    """``got`` equals ``want``: tensors bitwise, containers item by item, objects attribute by
    attribute (DeepSpeed's loss scaler has no ``==``), anything else by ``==``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same_values(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (mine, theirs) in enumerate(zip(got, want)):
            assert_same_values(mine, theirs, f"{where}.{i}")
    elif hasattr(want, "__dict__"):
        assert type(got) is type(want), where
        assert_same_values(vars(got), vars(want), where)
    else:
        assert got == want, where


def test_checkpoint_files_read_on_rank_0_alone_wait_a_bounded_time_where_a_rank_s_memory_is_on_another_host(
        shm_dir, tmp_path):
    """As above, with rank 1 on another host: its node memory in a shared-memory directory of
    its own, which rank 0 cannot see. Only every rank together can read the files then:
    zero_to_fp32 on rank 0 alone waits a bounded time for the others, then fails with the
    reason and what to do instead; rank 1, which never reads, ends as usual."""
    elsewhere, bound = new_shm_dir(), 5
    try:
        configs = [config_pair("zero3.json", d, ec={"k": 1, "m": 1})[0] for d in (shm_dir, elsewhere)]
        run = stock_script(tmp_path, "ftmem", configs, dict(ENV, FTMEM_COLLECTIVE_TIMEOUT_S=str(bound)), 2, job_id(),
                           2, "--read-back", "zero_to_fp32-on-rank-0")
        assert run.wait(TIMEOUT) == [1, 0], run.log(0)[-5000:]
    finally:
        free_shm_dir(elsewhere)
    assert (f"CollectiveNotJoined: reading {tmp_path}/ftmem/ckpt/global_step2/" in run.log(0)), run.log(0)[-3000:]
    assert (f"is a collective: every rank of the job must make it at the same point, as load_checkpoint does, but "
            f"ranks [1] did not within {bound} s (FTMEM_COLLECTIVE_TIMEOUT_S sets the wait). To read an ftmem "
            f"checkpoint on some ranks only, or in another process, get real files first: `ftmem export`, or the "
            f"persistent tier") in run.log(0)
    assert not os.path.exists(tmp_path / "ftmem" / "rank0.read-back.pt")


def test_a_stub_read_in_a_forked_worker_gets_the_stub_s_error_not_the_rank_s_collectives(shm_dir, tmp_path):
    """Scripts and DeepSpeed's ds_to_universal read checkpoint files in forked worker
    pools. The worker inherits the rank's engine, but a collective from it would share
    the rank's store and gloo sockets: it gets the stub's error at once instead, while
    the default engine's worker reads the real file."""
    config, stock = config_pair("zero1.json", shm_dir, ec={"k": 1, "m": 1})
    world = 2
    for name, cfg, env in (("reference", stock, STOCK_ENV),
                           ("ftmem", config, dict(ENV, FTMEM_COLLECTIVE_TIMEOUT_S="5"))):
        run = stock_script(tmp_path, name, cfg, env, world, job_id(), 2, "--read-back", "torch-load-in-worker")
        assert run.wait(TIMEOUT) == [0] * world, run.log(0)[-5000:]
        for rank in range(world):
            read = [line for line in run.log(rank).splitlines() if line.startswith(f"rank {rank}: worker read ")]
            assert len(read) == 1, run.log(rank)[-3000:]
            if name == "reference":
                assert read[0] == f"rank {rank}: worker read 4 tensors"
            else:
                stub_error = ("FtmemStubFile: global_step2/mp_rank_00_model_states.pt is a stub of ftmem's "
                              "in-memory checkpoint of job ")
                assert read[0].startswith(f"rank {rank}: worker read {stub_error}"), read[0]
                assert "(not processes they fork or spawn)" in read[0]


def test_reading_stubs_without_ftmem_says_what_they_are_and_how_to_get_real_files(shm_dir, tmp_path):
    """zero_to_fp32 and a plain torch.load, in a process without ftmem's adapter, on the
    save dir of a ZeRO-3 job with ftmem: one clear error each, never 'invalid load key'."""
    job = DSJob("zero3.json", 2, shm_dir, str(tmp_path), ftmem={"ec": {"k": 1, "m": 1}})
    job.args[job.args.index("--iters") + 1] = "2"
    assert job.run() == [0, 0], job.log(0)[-3000:]
    stub = os.path.join(job.save_dir, "global_step2", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert is_stub(stub)
    script = textwrap.dedent(f"""
        import sys, torch
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        for read in (lambda: torch.load({stub!r}, weights_only=False),
                     lambda: get_fp32_state_dict_from_zero_checkpoint({job.save_dir!r})):
            try:
                read()
            except Exception as e:
                print(type(e).__name__, e)
        print("modules:", sorted(m for m in sys.modules if m.startswith("ftmem") and m != "ftmem_guard"))
    """)
    out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **ENV), capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len([line for line in lines if line.startswith("FtmemStubFile ")]) == 2, out.stdout
    assert f"stub of ftmem's in-memory checkpoint of job {job.job}" in out.stdout
    assert f"run `ftmem export --job {job.job} --out DIR`" in out.stdout
    assert "modules: []" in lines, out.stdout


def test_ftmem_selected_where_the_adapter_cannot_be_imported_is_refused_with_the_reason(shm_dir):
    """Stock DeepSpeed would ignore the unknown engine name and save with torch.save."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ftmem_deepspeed"] = None  # its import fails, as in an environment without it
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        import deepspeed, torch
        deepspeed.init_distributed(dist_backend="gloo")
        config = {{"train_batch_size": 1, "optimizer": {{"type": "Adam", "params": {{"torch_adam": True}}}},
                  "checkpoint": {{"engine": "ftmem"}}, "ftmem": {{"shm_dir": {shm_dir!r}}}}}
        model = torch.nn.Linear(4, 4)
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    """)
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode != 0
    assert "FtmemNotInstalled" in out.stderr
    assert ("ftmem's DeepSpeed engine could not be installed in this process (ModuleNotFoundError: import of "
            "ftmem_deepspeed halted") in out.stderr
    assert "Check that `import ftmem_deepspeed` works in this environment" in out.stderr
    assert jobs.list_jobs(shm_dir) == []


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the lost node rebuilt from parity, all 12 steps as the "
                          "reference")
def test_make_demo_succeeds(shm_dir):
    """What `make demo` runs: a DeepSpeed job loses a node and resumes bitwise."""
    out = subprocess.run([sys.executable, "-m", "examples.deepspeed.demo", shm_dir], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, **ENV))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "reference run without failures and without ftmem (DeepSpeed's default checkpoint engine, " \
           "TorchCheckpointEngine on every rank): done" in out.stdout
    assert "rebuilt from parity); losses of all 12 steps and final weights bitwise equal to the reference: True" \
        in out.stdout
    assert out.stdout.rstrip().endswith("SUCCESS")


def test_runs_under_the_deepspeed_launcher(shm_dir, tmp_path):
    """No special launcher: under `deepspeed` the ranks start their SMPs themselves."""
    mirror = {"ec": {"k": 1, "m": 1}}
    ref = reference("zero1.json", 2, str(tmp_path / "reference"))
    job = DSJob("zero1.json", 2, shm_dir, str(tmp_path / "run"), ftmem=mirror)
    env = dict(os.environ, FTMEM_JOB_ID=job.job, OMP_NUM_THREADS="1", **ENV)
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                          "--master_port", str(free_port()), "--module", "examples.deepspeed.train_gpt", *job.args],
                         env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("checkpoint engine FtmemCheckpointEngine") == 2
    assert_same_training(job.out, ref, 2, ITERS)
    assert f"keeps its newest version ({ITERS}) in shared memory" in out.stdout + out.stderr


def test_resumes_from_checkpoints_of_the_default_engine(shm_dir, tmp_path):
    """Switching a job to ftmem: files the default engine wrote load as stock DeepSpeed loads them."""
    mirror = {"ec": {"k": 1, "m": 1}}
    default = DSJob("zero1.json", 2, shm_dir, str(tmp_path), ftmem=mirror)
    stock_config = json.load(open(os.path.join(CONFIGS, "zero1.json")))
    del stock_config["checkpoint"]
    (tmp_path / "stock.json").write_text(json.dumps(stock_config))
    default.args[1] = str(tmp_path / "stock.json")
    default.args[default.args.index("--iters") + 1] = "3"
    assert default.run() == [0, 0], default.log(0)[-4000:]
    assert not any(is_stub(str(p)) for p in (tmp_path / "ckpt" / "global_step3").iterdir())
    switched = DSJob("zero1.json", 2, shm_dir, str(tmp_path), ftmem=mirror)
    assert switched.run("--load") == [0, 0], switched.log(0)[-4000:]
    assert "rank 0: resuming at step 3 (client_state)" in switched.log(0)
    assert "checkpoint engine FtmemCheckpointEngine" in switched.log(0)
    assert "from memory" not in switched.log(0)


@pytest.mark.parametrize("config, end", [
    pytest.param("zero1.json", "torn down", id="zero1.json-torn down", marks=pytest.mark.fault(
        "more nodes lost than parity", phase="between saves", framework="DeepSpeed ZeRO-1",
        expect="resumes bitwise from disk: the flushed version 3, after a teardown that flushed nothing")),
    pytest.param("zero3.json", "preempted, the flush too slow", id="zero3.json-preempted, the flush too slow",
                 marks=pytest.mark.fault(
                     "SIGTERM to the whole job (preemption)", phase="during a flush", framework="DeepSpeed ZeRO-3",
                     expect="resumes bitwise from disk: the grace ends the cut flush, the older checkpoint stays "
                            "newest and serves once two nodes are lost")),
])
def test_more_than_m_lost_nodes_resume_from_the_persisted_checkpoint(config, end, shm_dir, tmp_path):
    """k=2, m=1 over 3 nodes, every 3rd protected version flushed to disk. Rank 1 is
    SIGKILLed and the others get SIGTERM, as torchrun tears a job down after a failure: not a
    preemption, nothing is flushed. Or every rank gets SIGTERM, as in a preemption, and the
    flush of the newest version (4) outlasts the grace (one rank's write of it stops
    halfway): they end when the grace does, and the older checkpoint stays the newest on
    disk. Two nodes lost: memory cannot serve, the job resumes from the flushed version
    bitwise; the flushed directory is a stock DeepSpeed checkpoint (loads without ftmem,
    zero_to_fp32 converts it)."""
    persist = str(tmp_path / "persist")
    preempted = end != "torn down"
    ftmem = {"persist": {"dir": persist, "interval": 3, "keep": 1}, "preemption": {"grace_s": 4}}
    ref = reference(config, 3, str(tmp_path / "reference"))
    job = DSJob(config, 3, shm_dir, str(tmp_path / "run"), ftmem=ftmem)
    slow = {1: {"FTMEM_TEST_HOOK": "mid_flush:pause:rank=1:version=4", "FTMEM_TEST_HOOK_DIR": str(tmp_path)}}
    with job.start("--stop-after", str(STOP), rank_env=slow if preempted else None) as run:  # 1..4 saved; 3 flushed
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(3)), TIMEOUT, f"step {STOP}")
        if not preempted:
            run.kill(1)
        for proc in run.procs:
            proc.send_signal(signal.SIGTERM)
        assert run.wait(TIMEOUT) == [-signal.SIGTERM, -signal.SIGKILL if not preempted else -signal.SIGTERM,
                                     -signal.SIGTERM], run.tails()
        if preempted:
            assert os.path.exists(tmp_path / "paused.rank1.v4")  # the flush of version 4 had begun
        else:
            for rank in (0, 2):
                assert (f"ftmem: rank {rank}: SIGTERM, not as a preemption of the whole job (rank(s) [1] of this host "
                        f"had died first, as in a teardown after a failure): nothing is flushed") in job.log(rank)
    leftover = [".global_step4.tmp"] if preempted else []  # the cut flush's, removed by the next flush
    assert sorted(os.listdir(persist)) == leftover + ["ftmem_flushed.json", "global_step3", "latest",
                                                      "zero_to_fp32.py", "zero_to_torch.py"]
    if preempted:
        assert "SIGTERM to every rank: the newest version goes to" in job.log(0)
        assert "the 4 s of grace (\"ftmem.preemption.grace_s\") ended before the flush did" in job.log(1)
    exported = str(tmp_path / "exported")
    out = run_cli("export", "--job", job.job, "--shm-dir", shm_dir, "--out", exported)
    newest = STOP + 1  # memory's newest version: the step after the last one trained
    assert out.returncode == 0 and f"exported version {newest} to {exported}/global_step{newest}" in out.stdout, \
        out.stderr
    jobs.lose_node(shm_dir, job.job, 0)
    jobs.lose_node(shm_dir, job.job, 1)
    assert job.run("--load") == [0] * 3, job.log(0)[-5000:]
    for rank in range(3):
        assert logged(restored_from_disk(3, f"{persist}/global_step3", rank, ANY), job.log(rank))
        assert f"rank {rank}: resuming at step 3 (client_state)" in job.log(rank)
    assert "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 1]" in job.log(0)  # the reason
    assert_same_training(job.out, ref, 3, ITERS)
    assert jobs.list_jobs(shm_dir) == []
    with open(os.path.join(persist, "latest")) as f:
        assert f.read() == f"global_step{ITERS}"  # the last flush of the resumed run; keep=1 pruned step 3
    assert not os.path.exists(os.path.join(persist, "global_step3"))

    # Stock DeepSpeed (its default engine, the same 3 ranks), with no ftmem module loaded, loads it.
    for rank, loaded in enumerate(stock_deepspeed_load(config, persist, str(tmp_path / "stock"))):
        assert loaded.startswith(f"STOCK LOADED {persist}/global_step{ITERS}/") and loaded.endswith(f" {ITERS} {ITERS}")
    # So does what `ftmem export` wrote from the dead job's memory (newer than the flushed version).
    for rank, loaded in enumerate(stock_deepspeed_load(config, exported, str(tmp_path / "stock_export"))):
        assert loaded.startswith(f"STOCK LOADED {exported}/global_step{newest}/") and loaded.endswith(f" {newest} {newest}")

    # DeepSpeed's own converter, as copied beside the checkpoint (its CLI also wants
    # huggingface_hub for sharding, so its function is called): the final weights.
    spec = importlib.util.spec_from_file_location("zero_to_fp32", os.path.join(persist, "zero_to_fp32.py"))
    zero_to_fp32 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zero_to_fp32)
    weights = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(persist)
    final = torch.load(os.path.join(job.out, "rank0.final.pt"))
    assert weights.keys() == final.keys() and all(torch.equal(weights[k], final[k]) for k in final)


PREEMPTED_ITERS = 24


@pytest.mark.compat
@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="during a step", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from disk: the newest version flushed at SIGTERM, every node's memory lost")
def test_a_preempted_job_flushes_its_newest_version_and_the_relaunch_resumes_from_it_bitwise(shm_dir, tmp_path):
    """k=2, m=1 over 3 nodes, the persistent tier every 100 versions (never, in this run).
    Mid-training every process of every node, ranks and SMPs, gets SIGTERM, as a scheduler's
    preemption sends it: the ranks flush the newest version every rank holds and end by
    SIGTERM, as without ftmem. Every node's shared memory is lost, as with the machines. The
    same command relaunched resumes from the flushed version, bitwise against an uninterrupted
    run with DeepSpeed's default engine."""
    config, iters = "zero1.json", ("--iters", str(PREEMPTED_ITERS))
    persist = str(tmp_path / "persist")
    ftmem = {"persist": {"dir": persist, "interval": 100, "keep": 1}}
    ref = reference(config, 3, str(tmp_path / "reference"), extra=iters)
    job = DSJob(config, 3, shm_dir, str(tmp_path / "run"), ftmem=ftmem)

    def trained() -> list[int]:
        return [len(read_losses(job.out, r)) if os.path.exists(os.path.join(job.out, f"rank{r}.losses.jsonl")) else 0
                for r in range(3)]

    with job.start(*iters) as run:
        run.wait_for(lambda: min(trained()) >= 4, TIMEOUT, "4 steps on every rank")
        smps = [node["smp_pid"] for node in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"]]
        saved = min(trained()) - 1  # a rank writes a step's loss before it saves the step
        for proc in run.procs:
            proc.send_signal(signal.SIGTERM)
        for pid in smps:
            os.kill(pid, signal.SIGTERM)
        codes = run.wait(TIMEOUT)
    assert codes == [-signal.SIGTERM] * 3, run.tails()  # ended as SIGTERM ends a process without ftmem
    flushed = re.search(r"flushed version (\d+) to \S+ at SIGTERM: a relaunch resumes from it", job.log(0))
    assert flushed, job.log(0)[-5000:]
    version = int(flushed.group(1))
    assert saved <= version < PREEMPTED_ITERS  # no version saved before the signal is lost
    assert "SIGTERM: exiting; the versions this node holds stay in shared memory" in _smp_logs(shm_dir, job.job)
    for node in range(3):  # the machines are gone: nothing in memory survives
        jobs.lose_node(shm_dir, job.job, node)
    with open(os.path.join(persist, "latest")) as f:
        assert f.read() == f"global_step{version}"

    assert job.run(*iters, "--load") == [0] * 3, job.log(0)[-5000:]
    for rank in range(3):
        assert logged(restored_from_disk(version, f"{persist}/global_step{version}", rank, ANY), job.log(rank))
    assert_same_training(job.out, ref, 3, PREEMPTED_ITERS)


def _smp_logs(shm_dir: str, job: str) -> str:
    return "".join(open(os.path.join(d, f)).read() for _, d in jobs.node_dirs(shm_dir, job)
                   for f in os.listdir(d) if f.endswith(".log"))


@pytest.mark.parametrize("restart", [
    pytest.param("two nodes lost", id="two nodes lost", marks=pytest.mark.fault(
        "more nodes lost than parity", phase="between saves", framework="DeepSpeed ZeRO-1",
        expect="refuses with a reason: the checkpoint latest names, the nodes the group lacks; nothing freed")),
    pytest.param("memory cleaned", id="memory cleaned", marks=pytest.mark.fault(
        "ftmem clean after a crash", phase="between saves", framework="DeepSpeed ZeRO-1",
        expect="refuses with a reason: the checkpoint latest names, which memory no longer holds; no fresh start")),
    pytest.param("half the ranks", id="half the ranks", marks=pytest.mark.fault(
        "restart on fewer or more nodes", phase="startup", framework="DeepSpeed ZeRO-1",
        expect="refuses with a reason: the version saved under another parallel layout; nothing freed")),
    pytest.param("half the ranks at ZeRO-3, id derived", id="half the ranks at ZeRO-3, id derived",
                 marks=pytest.mark.fault(
                     "restart on fewer or more nodes", phase="during an elastic adoption",
                     framework="DeepSpeed ZeRO-3",
                     expect="refuses with a reason: another world's memory is adopted at ZeRO 0-2 only; ftmem "
                            "clean named, nothing freed")),
])
def test_a_checkpoint_memory_cannot_give_back_is_refused_not_replaced_by_a_fresh_start(restart, shm_dir, tmp_path):
    """`latest` names an ftmem checkpoint, no disk holds one, and memory cannot give it
    back: more than m=1 nodes are lost, `ftmem clean` freed the job, or the job comes
    back on 2 of its 4 ranks under one FTMEM_JOB_ID (its memory is laid out for the old
    world), or at ZeRO-3 with the job id derived from the save dir and the world (the
    relaunch is another job, and ftmem adopts another world's version only at ZeRO 0-2).
    DeepSpeed's default engine would have loaded the checkpoint: ftmem refuses with the
    reason and frees nothing."""
    elastic = restart.startswith("half the ranks")
    world, ftmem = (4, {"ec": {"k": 1, "m": 1}}) if elastic else (3, None)
    job = DSJob("zero3.json" if "ZeRO-3" in restart else "zero1.json", world, shm_dir, str(tmp_path / "run"),
                ftmem=ftmem,
                env={"FTMEM_JOB_ID": ""} if restart.endswith("derived") else None)
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    latest = os.path.join(job.save_dir, "latest")
    refused = (f"{latest} names global_step{STOP + 1}, an ftmem checkpoint that neither memory nor the persistent "
               f"tier can give back (")
    if restart == "two nodes lost":
        jobs.lose_node(shm_dir, job.job, 0)
        jobs.lose_node(shm_dir, job.job, 1)
        refusal = [refused, "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 1]",
                   f"to start over on purpose, remove {latest}"]
    elif restart == "memory cleaned":
        assert run_cli("clean", "--job", job.job, "--shm-dir", shm_dir).returncode == 0
        refusal = [refused + "memory holds no version of this job). ftmem does not start from scratch in its place."]
    elif restart == "half the ranks":
        job.world = 2
        refusal = [f"version {STOP + 1} was saved under another parallel layout (dp_groups ((0, 1, 2, 3),) -> ((0, 1),))"]
    else:
        [saved] = jobs.list_jobs(shm_dir)  # the id the four ranks derived
        job.job, job.world = saved, 2
        versions = sorted({v for node in jobs.status(shm_dir, saved)["jobs"][0]["nodes"] for v in node["versions"]})
        assert versions[-1] == STOP + 1, versions
        refusal = [", on 2 ranks (2 nodes of 1)) holds no version in memory, but other jobs saved from its origin",
                   f"hold some (job {saved} on 4 ranks (4 nodes of 1): versions {versions}). A relaunch at "
                   f"another world size or ranks per node derives another job id",
                   "ftmem cannot resume from them: it resumes DeepSpeed from another world's memory only at ZeRO "
                   "stages 0 to 2 (ZeRO-3 partitions the module as well; saved at stage 3, now 3)",
                   f"free them first: ftmem clean --job {saved} --shm-dir {shm_dir}."]
    held = {n["node"]: n["versions"] for j in jobs.status(shm_dir, job.job)["jobs"] for n in j["nodes"]}
    codes = job.run("--load")
    assert all(code != 0 for code in codes), job.log(0)[-5000:]
    for rank in range(job.world):
        assert all(part in job.log(rank) for part in refusal), job.log(rank)[-5000:]
        assert "starting from scratch" not in job.log(rank) and "resuming at step" not in job.log(rank)
    after = {n["node"]: n["versions"] for j in jobs.status(shm_dir, job.job)["jobs"] for n in j["nodes"]}
    assert {node: after[node] for node in held} == held  # nothing freed


@pytest.mark.fault("another job wrote into the save dir", phase="startup", framework="DeepSpeed ZeRO-1",
                   expect="refuses with a reason: naming both jobs; this job's stale versions never served")
def test_a_checkpoint_another_job_wrote_into_the_save_dir_is_refused_not_served_from_this_job_s_memory(shm_dir,
                                                                                                       tmp_path):
    """A job is killed after step 3. Another job (another id and world size, on other
    machines: its own shared memory) then trains in the same save dir and writes its own
    stubs over the same tags. The first job's restart holds its versions 3 and 4 in memory,
    but ``latest`` now names the other job's global_step6, of another run: this job's
    versions are stale, never served, and the load of the other job's checkpoint is refused,
    naming both jobs."""
    world = 2
    job = DSJob("zero1.json", world, shm_dir, str(tmp_path / "run"), ftmem={"ec": {"k": 1, "m": 1}})
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    elsewhere = new_shm_dir()
    try:
        other = DSJob("zero1.json", world + 1, elsewhere, str(tmp_path / "other"), ftmem={"ec": {"k": 1, "m": 1}})
        other.args[other.args.index("--save-dir") + 1] = job.save_dir
        os.remove(os.path.join(job.save_dir, "latest"))  # the other job starts over on purpose
        assert other.run() == [0] * other.world, other.log(0)[-5000:]
    finally:
        free_shm_dir(elsewhere)
    codes = job.run("--load")
    assert all(code != 0 for code in codes), job.log(0)[-5000:]
    stub = os.path.join(job.save_dir, f"global_step{ITERS}", "mp_rank_00_model_states.pt")
    stale_versions = re.search(rf"not restoring this job's version\(s\) \[([0-9, ]+)\]: they are of another run than "
                               rf"the save dir's newest checkpoint \(job {other.job}'s version {ITERS}\)", job.log(0))
    assert stale_versions and STOP + 1 in map(int, stale_versions[1].split(", ")), job.log(0)[-5000:]
    for rank in range(world):
        assert (f"{stub} is a stub of job {other.job}'s in-memory checkpoint, but this job is {job.job}. Job "
                f"{other.job} saved it on 3 ranks (3 nodes of 1); this job runs on 2 ranks (2 nodes of 1). A job's id "
                f"derives from its save dir and its world layout") in job.log(rank), job.log(rank)[-5000:]
        assert f"`ftmem export --job {other.job} --out DIR`" in job.log(rank)
        assert "resuming at step" not in job.log(rank)


@pytest.mark.fault("rank SIGKILLed", phase="during a flush", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from disk: version 2, the partial flush after it never published")
def test_a_flush_killed_midway_leaves_the_previous_checkpoint_the_newest(shm_dir, tmp_path):
    """Rank 0 dies after writing one file of the flush after version 2's: the disk still says
    version 2, whose directory is complete, and a restart that memory cannot serve resumes
    from it bitwise.

    Which version that flush is depends on timing: the tier flushes every second protected
    version, and one that comes while a flush still runs is skipped (flushes never queue). So
    rank 1 holds after its commit of version 3, before the vote that protects it, until version
    2's flush is done on every rank: no version after it is skipped. Without the hold, on a
    loaded machine, version 2's flush outlived the versions after it."""
    persist, hooks = str(tmp_path / "persist"), tmp_path / "hooks"
    hooks.mkdir()
    ftmem = {"persist": {"dir": persist, "interval": 2, "keep": 2}}
    ref = reference("zero1.json", 3, str(tmp_path / "reference"))
    job = DSJob("zero1.json", 3, shm_dir, str(tmp_path / "run"), ftmem=ftmem)
    rank_env = {0: {"FTMEM_TEST_HOOK": "mid_flush:kill:rank=0:version=3+"},
                1: {"FTMEM_TEST_HOOK": "after_commit:hold:rank=1:version=3", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    with job.start(rank_env=rank_env) as run:
        wait_until(lambda: all(f"rank {r}: flushed version 2 to" in job.log(r) for r in range(3)), TIMEOUT,
                   "every rank's flush of version 2")
        (hooks / "resume.rank1.v3").touch()
        wait_until(lambda: run.procs[0].poll() is not None, TIMEOUT, "rank 0 killed in the flush after version 2's")
    with open(os.path.join(persist, "latest")) as f:
        assert f.read() == "global_step2"
    partial = [name for name in os.listdir(persist) if name.startswith(".")]
    assert len(partial) == 1 and re.fullmatch(r"\.global_step[3-6]\.tmp", partial[0]), partial  # never published
    for lost in (0, 1):  # more than m=1: memory cannot serve
        jobs.lose_node(shm_dir, job.job, lost)
    assert job.run("--load") == [0] * 3, job.log(0)[-5000:]
    assert logged(restored_from_disk(2, f"{persist}/global_step2", 0, ANY), job.log(0))
    assert_same_training(job.out, ref, 3, ITERS)
    assert jobs.list_jobs(shm_dir) == []
