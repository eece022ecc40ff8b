"""A job's identity can neither collide nor drift (issue 14, findings 1 and 2).

* A plain `torchrun` relaunch of the same command (no FTMEM_JOB_ID) finds its snapshots:
  the id derives from the save dir and the world layout, not torchrun's per-launch run id.
* An unrelated job under the same id is refused at its start, before it reads or deletes
  anything, and the first job still restores its own versions.
* Two live jobs under one id: the second is refused, naming the first's pid.
"""
import os
import signal
import subprocess
import sys

import pytest

from harness.common import REPO, job_id, logged
from harness.ranks import LocalJob, free_port, wait_until
from ftmem import restored_from_memory
from ftmem._shm import jobs
from ftmem._shm.procs import cmdline, pid_alive

CONFIGS = os.path.join(REPO, "configs")
TIMEOUT = 300
MIRROR = '{"ranks_per_node": 1, "ec": {"k": 1, "m": 1}, "shm_dir": "%s"}'


def train_args(shm_dir, save_dir, out, *extra):
    os.makedirs(out, exist_ok=True)
    return ["--deepspeed-config", os.path.join(CONFIGS, "zero1.json"), "--save-dir", save_dir, "--iters", "4",
            "--out", out, "--ftmem", MIRROR % shm_dir, *extra]


def torchrun(args, log_path, port):
    """The README's command: torchrun, no FTMEM_JOB_ID; its own session so it can be killed whole."""
    env = {k: v for k, v in os.environ.items() if k != "FTMEM_JOB_ID"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(port), "-m", "examples.deepspeed.train_gpt", *args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def kill_job(launcher, save_dir):
    """SIGKILL torchrun and every rank it started (its workers run in sessions of their own)."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and save_dir in " ".join(cmdline(int(p)))
             and "train_gpt" in " ".join(cmdline(int(p)))]
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(pid) for pid in ranks), 30, "the ranks to die")


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


@pytest.mark.fault("every rank SIGKILLed", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: version 3 under the id derived again by the plain torchrun "
                          "relaunch")
def test_a_plain_torchrun_relaunch_finds_its_snapshots(shm_dir, tmp_path):
    save, out, log = str(tmp_path / "ckpt"), str(tmp_path / "out"), str(tmp_path / "torchrun.log")
    port = free_port()
    first = torchrun(train_args(shm_dir, save, out, "--stop-after", "2"), log, port)
    try:
        wait_until(lambda: read(log).count("stopped after") == 2 or first.poll() is not None, TIMEOUT, "step 2")
    finally:
        kill_job(first, save)
    assert read(log).count("stopped after") == 2, read(log)[-3000:]
    held = jobs.list_jobs(shm_dir)
    assert len(held) == 1 and held[0].startswith("job-")  # derived, not torchrun's random run id
    again = torchrun(train_args(shm_dir, save, out, "--load"), log, port)
    assert again.wait(TIMEOUT) == 0, read(log)[-3000:]
    for rank in range(2):
        assert logged(restored_from_memory(3, rank, "tag global_step3"), read(log))  # step 2 done: global step 3


@pytest.mark.fault("another job under the same id", phase="startup", framework="DeepSpeed ZeRO-1",
                   expect="refuses with a reason: JobAlreadyRunning naming the pid, ForeignVersions naming the save "
                          "dir; nothing deleted")
def test_an_unrelated_job_under_the_same_id_is_refused_and_deletes_nothing(shm_dir, tmp_path):
    shared_id = job_id()
    env = {"DS_ACCELERATOR": "cpu"}
    a_save, a_out = str(tmp_path / "a" / "ckpt"), str(tmp_path / "a" / "out")
    a = LocalJob("examples.deepspeed.train_gpt", train_args(shm_dir, a_save, a_out, "--stop-after", "2"), 2,
                 shared_id, a_out, env=env)
    with a:
        a.wait_for(lambda: all("stopped after" in a.log(r) for r in range(2)), TIMEOUT, "job A at step 2")
        # The same job started twice while it runs: the second is refused.
        twin_out = str(tmp_path / "twin")
        twin = LocalJob("examples.deepspeed.train_gpt", train_args(shm_dir, a_save, twin_out, "--load"), 2,
                        shared_id, twin_out, env=env)
        assert twin.wait(TIMEOUT) != [0, 0]
        assert "JobAlreadyRunning" in twin.log(0) and "is already running as pid" in twin.log(0)
        a.kill_all()
    held = {n["node"]: n["versions"] for n in jobs.status(shm_dir, shared_id)["jobs"][0]["nodes"]}
    assert held == {0: [1, 2, 3], 1: [1, 2, 3]}

    # Job B: another save dir, the same id by mistake. Refused before it reads or writes.
    b_save, b_out = str(tmp_path / "b" / "ckpt"), str(tmp_path / "b" / "out")
    b = LocalJob("examples.deepspeed.train_gpt", train_args(shm_dir, b_save, b_out), 2, shared_id, b_out, env=env)
    assert b.wait(TIMEOUT) != [0, 0]
    assert "ForeignVersions" in b.log(0)
    assert f"holds versions [1, 2, 3] saved from save dir {os.path.realpath(a_save)}: another job's" in b.log(0)
    assert {n["node"]: n["versions"] for n in jobs.status(shm_dir, shared_id)["jobs"][0]["nodes"]} == held

    # Job A comes back and restores its own version.
    back = LocalJob("examples.deepspeed.train_gpt", train_args(shm_dir, a_save, a_out, "--load"), 2, shared_id,
                    a_out, env=env)
    assert back.wait(TIMEOUT) == [0, 0], back.log(0)[-3000:]
    assert logged(restored_from_memory(3, 0, "tag global_step3"), back.log(0))
