"""Faults of the job's store, injected for real under DeepSpeed and Megatron jobs: the store served by a
process of its own, as torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE), stopped
(SIGSTOP: its host hung) for less and for more than the failure detector's timeout."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from examples.launch import free_port
from ftmem import restored_from_memory
from ftmem._engine.failure_detector import EXIT_CODE
from harness import megatron_jobs
from harness.common import logged, read_json
from harness.ds_jobs import ITERS, TIMEOUT, DSJob, rank0_copy_held, reference
from harness.ranks import REPO
from harness.toy import assert_same_training

WORLD = 2
MIRRORED = {"ec": {"k": 1, "m": 1}}
DETECT_S = 4

STORE = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("serving", flush=True)
time.sleep(3600)
"""


class AgentStore:
    """The job's TCP store in a process of its own (a launcher's agent)."""

    def __init__(self):
        """Serving once this returns."""
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", STORE, str(self.port)], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout.readline().strip() == "serving"

    def env(self) -> dict:
        """What the ranks need to use it, as torchrun's workers do."""
        return {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(self.port)}

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The store's process stopped (SIGSTOP) for the block: the host that serves it hangs."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> "AgentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def job_on(store: AgentStore, shm_dir: str, tmp_path) -> DSJob:
    return DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"), env=store.env(),
                 ftmem={**MIRRORED, "failure_detection": {"timeout_s": DETECT_S}})


@pytest.mark.fault("job's store stalled (its host hung)", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="goes on: a store stopped for less than the failure detector's timeout ends no rank, and "
                          "training is bitwise as without ftmem")
def test_a_store_stalled_for_less_than_the_detector_s_timeout_ends_no_rank(shm_dir, tmp_path):
    """The store's process is stopped for half the detector's timeout while rank 0 copies version
    3 (held there, so that the stall falls inside the run): the ranks' beats wait, none is late
    by the timeout, and the job trains to its end, bitwise as DeepSpeed's default engine."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with AgentStore() as store:
        job = job_on(store, shm_dir, tmp_path)
        with job.start(rank_env=rank0_copy_held(hooks)) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
            with store.stopped():
                time.sleep(DETECT_S / 2)
                assert all(proc.poll() is None for proc in run.procs), run.tails()
            (hooks / "resume.rank0.v3").touch()
            assert run.wait(TIMEOUT) == [0] * WORLD, run.tails()
    assert "has not answered" not in job.log(0) + job.log(1)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("job's store stalled (its host hung)", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="ends every rank within the detector's timeout and a few seconds, naming the store; the "
                          "relaunch resumes bitwise from memory")
def test_a_store_stalled_for_longer_than_the_detector_s_timeout_ends_every_rank_naming_it(
        shm_dir, tmp_path, fault_clock):
    """The store's process stays stopped: every rank ends with the detector's exit code within
    its timeout and a few seconds, saying the store did not answer, instead of waiting on it at
    its next use without end; the launcher's new store serves the relaunch, which resumes from
    memory, bitwise as DeepSpeed's default engine."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with AgentStore() as store:
        job = job_on(store, shm_dir, tmp_path)
        with job.start(rank_env=rank0_copy_held(hooks)) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
            with store.stopped():
                fault_clock.injected()
                assert run.wait(3 * DETECT_S) == [EXIT_CODE] * WORLD, run.tails()
                fault_clock.detected()
    for rank in range(WORLD):
        assert re.search(rf"rank {rank}: the job's store \(127\.0\.0\.1:{store.port}\) has not answered for "
                         rf"{DETECT_S} s: the host that serves it is lost or hung: ending this process \(exit code "
                         rf"{EXIT_CODE}\)", job.log(rank)), job.log(rank)[-3000:]
    with AgentStore() as relaunched:
        job.env.update(relaunched.env())
        assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
        fault_clock.stepped()
    newest = int(re.search(r"ftmem: restored iteration (\d+) from memory", job.log(0)).group(1))
    assert newest >= 2
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank, f"tag global_step{newest}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("job's store stalled (its host hung)", phase="during the copy", framework="Megatron (megatron-core)",
                   expect="ends every rank within the detector's timeout and a few seconds, naming the store; the "
                          "relaunch resumes bitwise from memory")
def test_a_store_stalled_for_longer_than_the_detector_s_timeout_ends_every_megatron_rank_naming_it(
        shm_dir, tmp_path, fault_clock):
    """As above, for megatron-core's DP 2: every rank ends within 3 timeouts saying the store did
    not answer, and the relaunch on a new store resumes from memory with the losses and final
    state of Megatron's own uninterrupted run."""
    ref = megatron_jobs.reference(WORLD, [], str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    job = megatron_jobs.MegatronJob(WORLD, [], ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m",
                                                "1", "--ftmem-failure-detection-timeout-s", str(DETECT_S)],
                                    shm_dir, str(tmp_path / "run"))
    with AgentStore() as store:
        with job.start(env=store.env(), rank_env=rank0_copy_held(hooks)) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), megatron_jobs.TIMEOUT, "the copy of iteration 3")
            with store.stopped():
                fault_clock.injected()
                assert run.wait(3 * DETECT_S) == [EXIT_CODE] * WORLD, run.tails()
                fault_clock.detected()
    for rank in range(WORLD):
        assert re.search(rf"rank {rank}: the job's store \(127\.0\.0\.1:{store.port}\) has not answered for "
                         rf"{DETECT_S} s", job.log(rank)), job.log(rank)[-3000:]
    with AgentStore() as relaunched:
        job.run(str(tmp_path / "resumed.json"), env=relaunched.env())
        fault_clock.stepped()
    newest = int(re.search(r"ftmem: restored iteration (\d+) from memory", job.log(0)).group(1))
    assert newest >= 2
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank), job.log(rank)), job.log(rank)[-3000:]
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(newest + 1, megatron_jobs.ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
