"""Real crash recovery: two gloo ranks on two virtual nodes train with ftmem, are
SIGKILLed at chosen moments, restart, restore, and must finish bitwise identical to
a run that never failed."""
import os
import signal
import subprocess
import sys

import pytest

from examples.engine.demo import read_losses
from harness.ranks import free_port, wait_until
from harness.toy import TIMEOUT, TrainJob, reference_run

WORLD = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), WORLD)


@pytest.mark.fault("every rank SIGKILLed", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, the newest every node holds")
def test_killed_between_saves(shm_dir, tmp_path, reference):
    job = TrainJob(shm_dir, tmp_path, WORLD)
    job.run_until_stopped(after=5)
    # Which older versions a node still holds beside 5 depends on when its protection rounds
    # ended against its copies (saves never wait for protection): only the newest is promised.
    for node in range(WORLD):
        assert job.held(node)[-1] == 5 and len(job.held(node)) <= 3, (job.held(0), job.held(1))
    assert job.nodes()[0]["protected"] == 5  # mirrored to the other node (k=1, m=1 on 2 nodes)
    job.restart_and_check(reference, expect_version=5)


@pytest.mark.fault("every rank SIGKILLed", phase="during the copy", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: the newest version both ranks hold, older than the one torn on "
                          "rank 1")
def test_killed_in_the_middle_of_a_copy_never_resumes_from_a_mix(shm_dir, tmp_path, reference):
    """Rank 1 is paused halfway through copying version 6 while rank 0 commits 6: the job
    must agree on the newest version that both ranks hold, older than 6. Rank 0's copy thread
    is paused right after its commit of 6: going on, its next save would take the newest
    copy's slot, and a kill while that copy runs would leave rank 0 without 6 as well."""
    job, hooks = TrainJob(shm_dir, tmp_path / "out", WORLD), str(tmp_path / "hooks")
    os.makedirs(hooks)
    pause = {1: {"FTMEM_TEST_HOOK": "mid_copy:pause:rank=1:version=6", "FTMEM_TEST_HOOK_DIR": hooks},
             0: {"FTMEM_TEST_HOOK": "after_commit:pause:rank=0:version=6", "FTMEM_TEST_HOOK_DIR": hooks}}
    with job.start(rank_env=pause) as run:
        for rank in (1, 0):
            run.wait_for(lambda: os.path.exists(os.path.join(hooks, f"paused.rank{rank}.v6")), TIMEOUT,
                         f"rank {rank} to pause")
        run.kill(0)
        run.kill(1)
    both = set(job.held(0)) & set(job.held(1))
    assert 6 in job.held(0) and 6 not in job.held(1) and both and max(both) < 6, (job.held(0), job.held(1))
    job.restart_and_check(reference, expect_version=max(both))


@pytest.mark.fault("rank SIGKILLed", phase="after the commit, before parity", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 6, committed by every rank before its parity")
def test_killed_right_after_a_commit(shm_dir, tmp_path, reference):
    job = TrainJob(shm_dir, tmp_path, WORLD)
    kill = {1: {"FTMEM_TEST_HOOK": "after_commit:kill:rank=1:version=6"}}
    with job.start(rank_env=kill) as run:
        wait_until(lambda: run.procs[1].poll() is not None, TIMEOUT, "rank 1 to die after committing 6")
        assert run.procs[1].returncode == -signal.SIGKILL
        wait_until(lambda: 6 in job.held(0), TIMEOUT, "rank 0 to commit version 6")
        run.kill(0)
    assert job.held(1)[-1] == 6
    job.restart_and_check(reference, expect_version=6)


def test_runs_under_torchrun(shm_dir, tmp_path, reference):
    """No special launcher: the first rank of each node starts its SMP under torchrun too."""
    job = TrainJob(shm_dir, tmp_path, WORLD)
    env = dict(os.environ, FTMEM_JOB_ID=job.job, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "examples.engine.toy_train", *job.args],
        env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(WORLD):
        assert read_losses(job.out, rank) == read_losses(reference, rank)
    assert job.nodes() == {}
