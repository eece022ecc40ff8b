"""Real crash recovery: two gloo ranks on two virtual nodes train with ftmem, are
SIGKILLed at chosen moments, restart, restore, and must finish bitwise identical to
a run that never failed."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import free_shm_dir, job_id, new_shm_dir
from ftmem import jobs
from ftmem.demo import read_losses
from ftmem.launch import LocalJob, free_port, wait_until

WORLD, ITERS, TIMEOUT = 2, 10, 180


def train_args(shm_dir, out, *extra):
    return ["--iters", str(ITERS), "--ranks-per-node", "1", "--shm-dir", shm_dir, "--out", out, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: per-step losses and final weights of each rank."""
    out = str(tmp_path_factory.mktemp("reference"))
    shm_dir = new_shm_dir()
    try:
        codes = LocalJob("ftmem.toy_train", train_args(shm_dir, out), WORLD, job_id(), out).wait(TIMEOUT)
        assert codes == [0, 0], open(os.path.join(out, "rank0.log")).read()
        assert jobs.list_jobs(shm_dir) == []  # a clean finish frees the job's memory
    finally:
        free_shm_dir(shm_dir)
    return out


def held(shm_dir, job, node):
    nodes = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
    return next((n["versions"] for n in nodes if n["node"] == node), [])


def restart_and_check(shm_dir, job, out, reference, expect_version):
    """Restart the whole job; it must restore ``expect_version`` and end like the reference."""
    codes = LocalJob("ftmem.toy_train", train_args(shm_dir, out), WORLD, job, out).wait(TIMEOUT)
    logs = [LocalJob.read_log(out, r) for r in range(WORLD)]
    assert codes == [0, 0], logs
    for rank in range(WORLD):
        assert f"ftmem: restored iteration {expect_version} from memory (rank {rank})" in logs[rank]
        got, want = read_losses(out, rank), read_losses(reference, rank)
        assert [got[i] for i in range(ITERS)] == [want[i] for i in range(ITERS)]
        mine = torch.load(os.path.join(out, f"rank{rank}.final.pt"))
        theirs = torch.load(os.path.join(reference, f"rank{rank}.final.pt"))
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert jobs.list_jobs(shm_dir) == []


def test_killed_between_saves(shm_dir, tmp_path, reference):
    job, out = job_id(), str(tmp_path)
    with LocalJob("ftmem.toy_train", train_args(shm_dir, out, "--stop-after", "5"), WORLD, job, out) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(WORLD)), TIMEOUT, "step 5")
        run.kill(1)
        run.kill(0)
    assert held(shm_dir, job, 0) == held(shm_dir, job, 1) == [4, 5]
    restart_and_check(shm_dir, job, out, reference, expect_version=5)


def test_killed_in_the_middle_of_a_copy_never_resumes_from_a_mix(shm_dir, tmp_path, reference):
    """Rank 1 is paused halfway through copying version 6 while rank 0 commits 6 and
    goes on: the job must agree on version 5, the newest that both ranks hold."""
    job, out, hooks = job_id(), str(tmp_path), str(tmp_path / "hooks")
    os.makedirs(hooks)
    pause = {1: {"FTMEM_TEST_HOOK": "mid_copy:pause:rank=1:version=6", "FTMEM_TEST_HOOK_DIR": hooks}}
    with LocalJob("ftmem.toy_train", train_args(shm_dir, out), WORLD, job, out, rank_env=pause) as run:
        run.wait_for(lambda: os.path.exists(os.path.join(hooks, "paused.rank1.v6")), TIMEOUT, "rank 1 to pause")
        run.wait_for(lambda: 6 in held(shm_dir, job, 0), TIMEOUT, "rank 0 to commit version 6")
        run.kill(0)
        run.kill(1)
    assert held(shm_dir, job, 0) == [5, 6] and held(shm_dir, job, 1) == [5]
    restart_and_check(shm_dir, job, out, reference, expect_version=5)


def test_killed_right_after_a_commit(shm_dir, tmp_path, reference):
    job, out = job_id(), str(tmp_path)
    kill = {1: {"FTMEM_TEST_HOOK": "after_commit:kill:rank=1:version=6"}}
    with LocalJob("ftmem.toy_train", train_args(shm_dir, out), WORLD, job, out, rank_env=kill) as run:
        wait_until(lambda: run.procs[1].poll() is not None, TIMEOUT, "rank 1 to die after committing 6")
        assert run.procs[1].returncode == -signal.SIGKILL
        wait_until(lambda: 6 in held(shm_dir, job, 0), TIMEOUT, "rank 0 to commit version 6")
        run.kill(0)
    assert held(shm_dir, job, 1)[-1] == 6
    restart_and_check(shm_dir, job, out, reference, expect_version=6)


def test_runs_under_torchrun(shm_dir, tmp_path, reference):
    """No special launcher: the first rank of each node starts its SMP under torchrun too."""
    out = str(tmp_path)
    env = dict(os.environ, FTMEM_JOB_ID=job_id(), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "ftmem.toy_train", *train_args(shm_dir, out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(WORLD):
        assert read_losses(out, rank) == read_losses(reference, rank)
    assert jobs.list_jobs(shm_dir) == []
