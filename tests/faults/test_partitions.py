"""A network partition between a job's hosts, injected for real: DeepSpeed's and Megatron's
ranks in two network namespaces joined by a veth pair, whose link is cut (not a process
killed) for less and for more than the failure detector's timeout, then healed."""
import re
import time

import pytest

from ftmem import restored_from_memory
from ftmem._engine.failure_detector import EXIT_CODE
from harness import megatron_jobs
from harness.common import logged, read_json
from harness.ds_jobs import ITERS, TIMEOUT, DSJob, rank0_copy_held, reference
from harness.netns import two_hosts
from harness.toy import assert_same_training

WORLD = 2
NETWORK = "train"
DETECT_S = 6


def job_on(hosts, shm_dir: str, tmp_path) -> tuple[DSJob, type]:
    """Rank r on host r, the training's gloo, ftmem's groups and the store (rank 0's) on NETWORK."""
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={"ec": {"k": 1, "m": 1}, "failure_detection": {"timeout_s": DETECT_S}})
    return job, hosts.launcher(NETWORK)


@pytest.mark.fault("network partition between hosts", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="goes on: a partition healed within the failure detector's timeout ends no rank, and "
                          "training is bitwise as without ftmem")
def test_a_partition_healed_within_the_detector_s_timeout_ends_no_rank(shm_dir, tmp_path):
    """The link between the hosts is down for a third of the detector's timeout while rank 0
    copies version 3 (held there, so that the cut falls inside the run): TCP carries the beats
    and the training on once it is up, and the job trains to its end bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with two_hosts({NETWORK: "198.18.3"}) as hosts:
        job, launcher = job_on(hosts, shm_dir, tmp_path)
        with job.start(rank_env=rank0_copy_held(hooks), launcher=launcher) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
            with hosts.partitioned():
                time.sleep(DETECT_S / 3)
            assert all(proc.poll() is None for proc in run.procs), run.tails()
            (hooks / "resume.rank0.v3").touch()
            assert run.wait(TIMEOUT) == [0] * WORLD, run.tails()
    assert "has not answered" not in job.log(0) + job.log(1)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("network partition between hosts", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="ends every rank within the detector's timeout and a few seconds, each naming what it "
                          "lost; once healed, the relaunch resumes bitwise from memory")
def test_a_partition_longer_than_the_detector_s_timeout_ends_every_rank_and_the_healed_job_resumes(
        shm_dir, tmp_path, fault_clock):
    """The link stays down: each side ends with the detector's exit code within 3 timeouts,
    saying what it lost (host 1 the store that host 0 serves, host 0 the node it watches),
    instead of sitting in the training's collective for gloo's 30 minutes; once the link is up
    again the relaunch resumes from memory, bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with two_hosts({NETWORK: "198.18.3"}) as hosts:
        job, launcher = job_on(hosts, shm_dir, tmp_path)
        with job.start(rank_env=rank0_copy_held(hooks), launcher=launcher) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
            with hosts.partitioned():
                fault_clock.injected()
                assert run.wait(3 * DETECT_S) == [EXIT_CODE] * WORLD, run.tails()
                fault_clock.detected()
        assert re.search(r"ftmem: rank 0: node 1 \(host \S+, rank 1\) has not answered for \d+ s", job.log(0)), \
            job.log(0)[-3000:]
        assert re.search(rf"ftmem: rank 1: the job's store \({re.escape(hosts.address(0, NETWORK))}:\d+\) has not "
                         rf"answered for \d+ s", job.log(1)), job.log(1)[-3000:]
        assert job.run("--load", launcher=launcher) == [0] * WORLD, job.log(0)[-4000:]
        fault_clock.stepped()
    newest = int(re.search(r"ftmem: restored iteration (\d+) from memory", job.log(0)).group(1))
    assert newest >= 2
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank, f"tag global_step{newest}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("network partition between hosts", phase="during the copy", framework="Megatron (megatron-core)",
                   expect="ends every rank within the detector's timeout and a few seconds, each naming what it "
                          "lost; once healed, the relaunch resumes bitwise from memory")
def test_a_partition_longer_than_the_detector_s_timeout_ends_every_megatron_rank_and_the_healed_job_resumes(
        shm_dir, tmp_path, fault_clock):
    """As above, for megatron-core's DP 2 on two hosts: each side ends within 3 timeouts naming
    what it lost, and the healed relaunch resumes from memory with the losses and final state of
    Megatron's own uninterrupted run."""
    ref = megatron_jobs.reference(WORLD, [], str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    job = megatron_jobs.MegatronJob(WORLD, [], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m",
                                                "1", "--ftmem-failure-detection-timeout-s", str(DETECT_S)],
                                    shm_dir, str(tmp_path / "run"))
    with two_hosts({NETWORK: "198.18.4"}) as hosts:
        launcher = hosts.launcher(NETWORK)
        with job.start(rank_env=rank0_copy_held(hooks), launcher=launcher) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), megatron_jobs.TIMEOUT, "the copy of iteration 3")
            with hosts.partitioned():
                fault_clock.injected()
                assert run.wait(3 * DETECT_S) == [EXIT_CODE] * WORLD, run.tails()
                fault_clock.detected()
        assert re.search(r"ftmem: rank 0: node 1 \(host \S+, rank 1\) has not answered for \d+ s", job.log(0)), \
            job.log(0)[-3000:]
        job.run(str(tmp_path / "resumed.json"), launcher=launcher)
        fault_clock.stepped()
    newest = int(re.search(r"ftmem: restored iteration (\d+) from memory", job.log(0)).group(1))
    assert newest >= 2
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank), job.log(rank)), job.log(rank)[-3000:]
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(newest + 1, megatron_jobs.ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
