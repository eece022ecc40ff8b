"""Faults of the machine's limits, injected for real: the process's open-file limit (``prlimit``)
set where the training alone fits and ftmem's groups do not."""
import re

import pytest

from ftmem._shm import jobs
from harness.common import run_once
from harness.ds_jobs import ITERS, DSJob
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
