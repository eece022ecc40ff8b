"""Faults of the persistent tier's disk, injected for real under DeepSpeed jobs: a file system
that turns read-only in the middle of a flush (a tmpfs remounted), and a disk whose syncs are
slow (``strace`` makes the kernel's fsync wait), slower than the saves are apart and than a
preemption's grace. Every resume is compared with DeepSpeed's default engine."""
import os
import re
import signal

import pytest

from ftmem import restored_from_disk, restored_from_memory
from ftmem._shm import jobs
from harness.common import ANY, logged
from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, latest_tag, reference
from harness.machine_faults import remount, slow_calls, tmpfs
from harness.toy import assert_same_training

WORLD = 2
MIRRORED = {"ec": {"k": 1, "m": 1}}


@pytest.mark.fault("persistent tier's disk turns read-only", phase="during a flush", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the failed flushes are named, the script's wait for them "
                          "raises, the older checkpoint stays the newest on disk")
def test_a_disk_that_turns_read_only_mid_flush_loses_nothing_and_the_job_resumes_from_memory(
        shm_dir, tmp_path, fault_clock):
    """Every version is due a flush. The first flush of a version V >= 3 (one due while another
    runs is skipped) is held once a file of it is written, on both ranks, and the disk is
    remounted read-only under it: that flush fails, named, while training goes on (the flushes
    due meanwhile are skipped), and the script's wait for the flushes at its stop raises the
    failure; the disk keeps the checkpoint it named newest before whole. Relaunched once the
    disk takes writes again, the job resumes from memory, bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with tmpfs(str(tmp_path / "disk"), "256m") as persist:
        job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                    ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 1}})
        hold = {r: {"FTMEM_TEST_HOOK": f"mid_flush:hold:rank={r}:version=3+", "FTMEM_TEST_HOOK_DIR": str(hooks)}
                for r in range(WORLD)}
        with job.start("--stop-after", str(STOP + 1), rank_env=hold) as run:
            run.wait_for(lambda: all(list(hooks.glob(f"paused.rank{r}.v*")) for r in range(WORLD)), TIMEOUT,
                         "a flush of version 3 or later to be halfway")
            held = {int(path.name.rsplit(".v", 1)[1]) for path in hooks.glob("paused.rank*.v*")}
            assert len(held) == 1, held  # every rank flushes the same versions
            version = held.pop()
            before = latest_tag(persist)  # one flush runs at a time: the older ones ended
            remount(persist, "ro")
            fault_clock.injected()
            for r in range(WORLD):
                (hooks / f"resume.rank{r}.v{version}").touch()
            assert run.wait(TIMEOUT) == [1] * WORLD, run.tails()  # the script's wait_flushed raised
            fault_clock.detected()
        for rank in range(WORLD):  # the newest flush that failed: version's, or one due after it
            raised = re.search(r"FtmemError: the persistent tier could not write version (\d+) to "
                               rf"{re.escape(persist)} \(rank \d: Read-only file system \(EROFS\) writing "
                               rf"{re.escape(persist)}/\.global_step\d+\.tmp", job.log(rank))
            assert raised and int(raised.group(1)) >= version, job.log(rank)[-3000:]
        assert re.search(rf"version {version} was not flushed \(rank \d: Read-only file system \(EROFS\) writing "
                         rf"{re.escape(persist)}/\S+\); {before} stays the newest on disk", job.log(0)), \
            job.log(0)[-4000:]
        assert latest_tag(persist) == before and f"global_step{version}" not in os.listdir(persist)
        remount(persist, "rw")
        assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
        fault_clock.stepped()
    newest = STOP + 2  # the version saved after the last step trained
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank, f"tag global_step{newest}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


SYNC_S = 1  # each fsync of the slow disk: a flush makes several, each step takes a fraction of one


@pytest.mark.fault("persistent tier's disk very slow", phase="during a flush", framework="DeepSpeed ZeRO-3",
                   expect="goes on: saves never wait for the disk, a flush due while one runs is skipped and "
                          "says so, and training is bitwise as without ftmem")
def test_a_disk_slower_than_the_saves_skips_flushes_and_never_holds_the_training(shm_dir, tmp_path):
    """Every fsync of the ranks waits SYNC_S (strace): a flush takes far longer than a step.
    Flushes never queue: one due while another runs is skipped, and the log says so; the job
    trains to its end bitwise as DeepSpeed's default engine, and its last version reaches the
    disk at its end."""
    ref = reference("zero3.json", WORLD, str(tmp_path / "reference"))
    persist = str(tmp_path / "persist")
    job = DSJob("zero3.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 1}})
    with job.start() as run:
        with slow_calls([p.pid for p in run.procs], ["fsync", "fdatasync"], SYNC_S):
            assert run.wait(TIMEOUT) == [0] * WORLD, run.tails()
    assert re.search(r"version \d+ not flushed: the previous flush is still running", job.log(0)), job.log(0)[-4000:]
    assert latest_tag(persist) == f"global_step{ITERS}"
    assert_same_training(job.out, ref, WORLD, ITERS)


GRACE_S = 4


@pytest.mark.fault("persistent tier's disk very slow", phase="during a flush", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from disk: a preemption's flush that outlasts the grace ends with it, "
                          "and the older checkpoint stays the newest")
def test_a_preemption_flush_slower_than_the_grace_ends_with_it_and_the_older_checkpoint_serves(
        shm_dir, tmp_path, fault_clock):
    """A flush every 3rd version; the job is preempted (SIGTERM to every rank) after step
    STOP while every fsync waits longer than the grace: the ranks end by SIGTERM within the
    grace and a few seconds, the disk still names the older checkpoint, and with every node's
    memory gone (as with the machines) the relaunch resumes from it, bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    persist = str(tmp_path / "persist")
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 3}, "preemption": {"grace_s": GRACE_S}})
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(WORLD)), TIMEOUT, f"step {STOP}")
        run.wait_for(lambda: os.path.exists(os.path.join(persist, "latest")) and latest_tag(persist) == "global_step3",
                     TIMEOUT, "the flush of version 3")
        with slow_calls([p.pid for p in run.procs], ["fsync", "fdatasync"], 3 * GRACE_S):
            fault_clock.injected()
            for proc in run.procs:
                proc.send_signal(signal.SIGTERM)
            assert run.wait(GRACE_S + 20) == [-signal.SIGTERM] * WORLD, run.tails()
            fault_clock.detected()
    assert any(f"the {GRACE_S} s of grace (\"ftmem.preemption.grace_s\") ended before the flush did" in job.log(r)
               for r in range(WORLD)), job.log(0)[-3000:]
    assert latest_tag(persist) == "global_step3"
    for node in range(WORLD):
        jobs.lose_node(shm_dir, job.job, node)
    assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
    fault_clock.stepped()
    for rank in range(WORLD):
        assert logged(restored_from_disk(3, f"{persist}/global_step3", rank, ANY), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("persistent tier's disk full", phase="during a flush", framework="DeepSpeed ZeRO-3",
                   expect="goes on: a flush that finds the disk full is named with the space it needs, leaves no "
                          "partial checkpoint, the newest whole one stays named, and training is bitwise as without "
                          "ftmem")
def test_a_full_disk_fails_the_flushes_by_name_and_never_the_training(shm_dir, tmp_path):
    """The persistent tier is a tmpfs of 2 MiB: the first flush fits, later ones do not (the
    older checkpoint goes only once a newer one is whole). Each failed flush says what it needed
    and what was free; no half-written checkpoint is named, the saves into memory never wait,
    and the job trains to its end bitwise as DeepSpeed's default engine."""
    ref = reference("zero3.json", WORLD, str(tmp_path / "reference"))
    with tmpfs(str(tmp_path / "disk"), "2m") as persist:
        job = DSJob("zero3.json", WORLD, shm_dir, str(tmp_path / "run"),
                    ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 1, "keep": 1}})
        assert job.run() == [0] * WORLD, job.log(0)[-4000:]
        failed = re.findall(r"version (\d+) was not flushed \(rank \d: No space left on device \(ENOSPC\) writing "
                            rf"{re.escape(persist)}/\.global_step\d+\.tmp/\S+: this rank's files need about [\d.]+ MiB, "
                            r"and [\d.]+ MiB is free there\); global_step1 stays the newest on disk", job.log(0))
        assert str(ITERS) in failed, job.log(0)[-4000:]
        assert latest_tag(persist) == "global_step1"
        assert not [name for name in os.listdir(persist) if name.startswith(".")], os.listdir(persist)
        # The newest version is not on disk: the job's end keeps it in memory, and says why.
        assert re.search(rf"keeps its newest version \({ITERS}\) in shared memory \(rank \d: the persistent tier "
                         rf"could not write version {ITERS}", job.log(0)), job.log(0)[-3000:]
    assert_same_training(job.out, ref, WORLD, ITERS)
