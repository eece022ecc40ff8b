"""Faults of the machine's limits, injected for real: the process's open-file limit (``prlimit``)
set where the training alone fits and ftmem's groups do not, and a memory limit (a cgroup's,
as a container's) over the SMP that leaves its slots no room."""
import os
import re
import subprocess
import sys

import pytest

from ftmem import restored_from_memory
from ftmem._common.identity import node_dir
from ftmem._shm.smp_client import running_smp
from ftmem._shm import jobs
from harness.common import REPO, logged, run_once
from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, reference
from harness.machine_faults import memory_cgroup
from harness.ranks import LocalJob
from harness.toy import assert_same_training

WORLD = 2
NOFILE = 40  # DeepSpeed's ZeRO-1 GPT on 2 ranks trains with 40 open files; ftmem's groups take some 30 more
MIRRORED = {"ec": {"k": 1, "m": 1}}


def under_nofile(soft: int, hard: int) -> type:
    """A LocalJob whose ranks start under the open-file limit ``soft``:``hard`` (``prlimit``)."""
    return type("UnderNofile", (LocalJob,), {"wrapper": ("prlimit", f"--nofile={soft}:{hard}")})


def stock_run_under_the_limit(root) -> str:
    """DeepSpeed's default engine, without ftmem, under the open-file limit: it trains to the end
    (so the limit is one the training fits), and it is the reference of the runs with ftmem."""
    def run():
        job = DSJob("zero1.json", WORLD, None, str(root), stock=True)
        assert job.run(launcher=under_nofile(NOFILE, NOFILE)) == [0] * WORLD, job.log(0)[-3000:]
        return job.out
    return run_once(("deepspeed under nofile", NOFILE), run)


@pytest.mark.fault("open-file limit too low for ftmem", phase="startup", framework="DeepSpeed ZeRO-1",
                   expect="refuses with a reason: the limit, and what to raise it to")
def test_an_open_file_limit_that_leaves_ftmem_no_room_stops_the_job_at_its_start_naming_it(
        shm_dir, tmp_path, fault_clock):
    """Where the hard limit is the soft one, ftmem cannot make room: every rank stops at the
    engine's start with the limit and the figure to raise it to, not with gloo's "epoll_create:
    Too many open files" inside a group, which ftmem took for a rank that never came, and
    nothing is written into shared memory."""
    stock_run_under_the_limit(tmp_path / "stock")
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "ftmem"), ftmem=MIRRORED)
    fault_clock.injected()
    codes = job.run(launcher=under_nofile(NOFILE, NOFILE))
    fault_clock.detected()
    assert codes == [1] * WORLD, job.log(0)[-3000:]
    for rank in range(WORLD):
        said = job.log(rank)
        assert re.search(rf"OpenFileLimit: this process may hold {NOFILE} open files \(ulimit -n; its hard limit is "
                         rf"{NOFILE}\) and holds \d+: ftmem's process groups and connections take about \d+ more\. "
                         rf"Raise the limit to at least \d+", said), said[-3000:]
        assert "CollectiveNotJoined" not in said, said[-3000:]
    assert jobs.list_jobs(shm_dir) == []


@pytest.mark.fault("open-file limit too low for ftmem", phase="startup", framework="DeepSpeed ZeRO-1",
                   expect="goes on: ftmem raises the soft limit by what it takes, and trains bitwise as without it")
def test_a_soft_open_file_limit_is_raised_by_what_ftmem_takes_and_the_training_is_unchanged(shm_dir, tmp_path):
    """Where the hard limit allows, ftmem raises the soft limit by what its groups take, so that
    the training keeps the room it had: the job trains to the end, bitwise as DeepSpeed's default
    engine under the same limit."""
    reference = stock_run_under_the_limit(tmp_path / "stock")
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "ftmem"), ftmem=MIRRORED)
    assert job.run(launcher=under_nofile(NOFILE, 4096)) == [0] * WORLD, job.log(0)[-3000:]
    assert "checkpoint engine FtmemCheckpointEngine" in job.log(0)
    assert_same_training(job.out, reference, WORLD, ITERS)


SMP_ROOM = 40 << 20  # what the memory limit leaves the SMPs besides what they use at their start
LARGER = ("--hidden", "256", "--layers", "4")  # a state of some 25 MiB a rank: 125 MiB of slots with its mirror


@pytest.mark.fault("memory limit over the SMP too low (cgroup)", phase="startup",
                   framework="DeepSpeed ZeRO-1",
                   expect="refuses with a reason: the limit, what is in use and what the slots need, at the first "
                          "save, before the kernel's OOM killer kills anything")
def test_a_memory_limit_that_leaves_the_smp_no_room_refuses_the_first_save_and_the_kernel_kills_nothing(
        shm_dir, tmp_path, fault_clock):
    """The nodes' SMPs run in a memory cgroup whose limit leaves them 40 MiB besides what they
    use, and the slots of each rank take about 125 MiB: tmpfs pages count against the cgroup of
    the process that reserves them, so reserving them would have the kernel's OOM killer end the
    SMP in the middle of the first save (and, in a container, maybe a training process). The
    SMPs check the room first: every rank stops at its first save with the limit, the use and
    the need; the kernel kills nothing."""
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"), ftmem=MIRRORED)
    with memory_cgroup() as cgroup:
        for node in range(WORLD):  # the SMPs first, in the cgroup: the ranks find them running
            subprocess.run([*cgroup.wrapper, sys.executable, "-c", "import sys; from ftmem._shm.smp_client import "
                            "ensure_smp; ensure_smp(sys.argv[1], [int(sys.argv[2])])",
                            node_dir(shm_dir, job.job, node), str(node)], cwd=REPO, check=True, timeout=TIMEOUT)
        smps = cgroup.pids()
        assert len(smps) == WORLD
        cgroup.limit(cgroup.usage() + SMP_ROOM)
        fault_clock.injected()
        codes = job.run(*LARGER)
        fault_clock.detected()
        assert codes == [1] * WORLD, job.log(0)[-3000:]
        for rank in range(WORLD):
            assert re.search(rf"ShmBudgetError: shared memory counts against the memory limit of "
                             rf"{re.escape(cgroup.path)} \(memory\.limit_in_bytes: [\d.]+ MiB, of which [\d.]+ MiB in "
                             rf"use\), and rank {rank} needs [\d.]+ MiB more \(3 versions x [\d.]+ MiB data \+ 2 x "
                             rf"[\d.]+ MiB parity\) than the [\d.]+ MiB it leaves", job.log(rank)), job.log(rank)[-3000:]
        assert cgroup.oom_kills() == 0 and sorted(cgroup.pids()) == sorted(smps)
        assert not any(os.path.exists(os.path.join(node_dir(shm_dir, job.job, node), f"rank{rank:05d}.slot0"))
                       for node, rank in ((0, 0), (1, 1)))


@pytest.mark.fault("SMP killed by the kernel's OOM killer (cgroup)", phase="between saves",
                   framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the snapshots the SMP kept stay in shared memory, and the "
                          "relaunch's SMP serves them")
def test_an_smp_the_oom_killer_ends_loses_no_snapshot(shm_dir, tmp_path, fault_clock):
    """After step STOP, node 1's SMP joins a memory cgroup where another process outgrows the
    limit; the SMP is the OOM killer's first choice there (oom_score_adj 1000, as a node's
    operator may set for a process that can be restarted), and the kernel kills it. The job is
    then lost whole (its ranks SIGKILLed); the relaunch starts node 1 another SMP, which finds
    its snapshots in shared memory, and resumes from memory, bitwise as DeepSpeed's default
    engine."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"), ftmem=MIRRORED)
    with job.start("--stop-after", str(STOP)) as run, memory_cgroup() as cgroup:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(WORLD)), TIMEOUT, f"step {STOP}")
        smp = running_smp(node_dir(shm_dir, job.job, 1))
        with open(os.path.join(cgroup.path, "cgroup.procs"), "w") as f:
            f.write(str(smp))
        with open(f"/proc/{smp}/oom_score_adj", "w") as f:
            f.write("1000")
        cgroup.limit(cgroup.usage() + (64 << 20))
        fault_clock.injected()
        hog = subprocess.run([*cgroup.wrapper, sys.executable, "-c", "x = bytearray(256 << 20)"], timeout=TIMEOUT)
        assert hog.returncode == -9 and cgroup.oom_kills() >= 1 and smp not in cgroup.pids()
        assert running_smp(node_dir(shm_dir, job.job, 1)) is None
        run.kill_all()
    assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
    fault_clock.stepped()
    for rank in range(WORLD):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}"), job.log(rank)), \
            job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)
