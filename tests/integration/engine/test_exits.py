"""Which exits of a process are a job's finish, and which are failures (the issues "an exit on
an uncaught exception counts as leaving" and "sys.exit(42) on every rank counts as a clean end
of the job").

Only a job-wide finish (every rank returns, or exits with status 0) or ``close(job_finished=
True)`` is leaving. A rank that dies of an uncaught exception, or exits with a non-zero status,
failed: its watcher reports it within the failure detector's timeout while the other ranks sit
in a collective that would not fail by itself (NCCL's, whose default timeout is 10 minutes);
and where every rank exits so, the job's memory stays for the restart, as after a crash, even
with a persistent tier behind it. Real processes on ftmem's adapter runtime (tests/harness/lifecycle_job.py),
real SMPs, real exits.
"""
import glob
import os
import re
import signal
import subprocess
import time

import pytest

from harness.common import held_versions, job_id, logged
from harness.ranks import LocalJob
from ftmem import restored_from_memory
from ftmem._engine.failure_detector import EXIT_CODE
from ftmem._shm import jobs

TIMEOUT = 120
# The suite's failure timeout (tests/conftest.py) is 10 s: the watcher of a dead rank judges
# it within that and a beat or two, and its verdict reaches every live rank within two beats.
# A bound, not the expected time: a loaded machine may take longer than the detector's own.
DETECTED_WITHIN_S = 45


def run(shm_dir, out, world: int, *args, job=None, env=None) -> LocalJob:
    return LocalJob("tests.harness.lifecycle_job", ["--out", str(out), *args], world, job, str(out),
                    env={"SHM_DIR": shm_dir, **(env or {})})



def on_the_tier(persist) -> list:
    """What the persistent tier published: its pointer to the newest checkpoint, and checkpoints."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(persist), "newest")) +
                  glob.glob(os.path.join(str(persist), "v*")))


@pytest.mark.parametrize("end, code", [("raise", 1), ("exit3", 3)], ids=["uncaught-exception", "sys-exit-3"])
@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="ends every rank within the detector's timeout, naming the dead rank; memory kept for the "
                          "restart")
def test_a_rank_that_dies_of_an_exception_or_a_non_zero_exit_is_reported_by_its_watcher_while_the_others_are_stuck(
        end, code, shm_dir, tmp_path):
    """3 ranks on 3 nodes; once the last save is protected, ranks 0 and 1 block in
    ``signal.pause()``, as ranks stuck in an NCCL collective whose peer died (nothing fails by
    itself there), and rank 2 ends with an uncaught exception, or ``sys.exit(3)``. Its exit
    ran the runtime's end, which stopped the failure detector as if the rank had left: rank 2
    was never reported, and the others sat there until the collective's timeout (NCCL's 10
    minutes). A failed exit is no leaving: rank 1, which watches rank 2, puts the verdict
    naming it, and ranks 0 and 1 end with the detector's exit code, their memory kept for
    the restart. (The finish vote of rank 2, which the stuck ranks never join, is cut to 5 s
    so that the test waits on the detector, not on that vote's timeout.)"""
    job, go = job_id(), tmp_path / "go"
    with run(shm_dir, tmp_path, 3, "--steps", "2", "--end", "hang", "--end-of-rank", f"2={end}", "--end-after",
             str(go), job=job) as ranks:
        ranks.wait_for(lambda: all(f"rank {r}: ends with hang" in ranks.log(r) for r in range(2)), TIMEOUT,
                       "ranks 0 and 1 stuck, their last save protected")
        go.touch()
        assert ranks.procs[2].wait(TIMEOUT) == code, ranks.tails()
        codes = []
        for r in range(2):
            try:
                codes.append(ranks.procs[r].wait(DETECTED_WITHIN_S))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still runs {DETECTED_WITHIN_S} s after rank 2 ended ({end}, exit code {code}): "
                            f"nobody reported rank 2. Logs:\n{ranks.tails()}")
        assert codes == [EXIT_CODE, EXIT_CODE], ranks.tails()
    for r in range(2):
        log = ranks.log(r)
        assert re.search(rf"node 2 \(host [^,]*, rank 2\) has not answered for \d+ s.*: ending this process "
                         rf"\(exit code {EXIT_CODE}\)", log), log[-3000:]
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2], 2: [1, 2]}  # no finish: kept for the restart


@pytest.mark.parametrize("end", ["exit42", "builtin-exit42"])
@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 3, nothing flushed at the failed end")
def test_a_non_zero_exit_on_every_rank_keeps_memory_for_the_restart_though_a_persistent_tier_is_configured(
        end, shm_dir, tmp_path):
    """Every rank ends with status 42 (``sys.exit(42)``, the builtin ``exit(42)``; a bare ``raise
    SystemExit(42)`` is not seen, docs/limits.md), after versions 1-3 were protected and none
    was flushed (the tier writes every 100th). SystemExit never reaches ``sys.excepthook``, so
    the end counted as a clean finish: version 3 was flushed and the memory freed, all of a
    job that did not finish in the tier's one checkpoint. A non-zero exit is a failure: the memory stays as after a crash, the
    tier gets nothing at the end, and the relaunch resumes version 3 from memory."""
    job, persist = job_id(), tmp_path / "persist"
    tier = ("--persist", str(persist), "--persist-interval", "100")
    ended = run(shm_dir, tmp_path / "out", 2, "--steps", "3", *tier, "--end", end, job=job)
    assert ended.wait(TIMEOUT) == [42, 42], ended.tails()
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}, ended.tails()
    assert on_the_tier(persist) == [], ended.tails()
    back = run(shm_dir, tmp_path / "out", 2, "--steps", "4", *tier, job=job)  # the same job: logs go on
    assert back.wait(TIMEOUT) == [0, 0], back.tails()
    for r in range(2):
        assert logged(restored_from_memory(3, r), back.log(r)), back.log(r)[-3000:]
    assert (persist / "newest").read_text() == "v4" and jobs.list_jobs(shm_dir) == []  # that one finished


def test_sys_exit_0_on_every_rank_is_a_finish_that_flushes_the_newest_version_and_frees_memory(shm_dir, tmp_path):
    """Status 0 is success, however the script reaches it: the job finished, the tier gets
    the newest version and the memory goes (a fix for non-zero exits must keep this)."""
    job, persist = job_id(), tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", 2, "--steps", "3", "--persist", str(persist), "--persist-interval", "100",
               "--end", "exit0", job=job)
    assert done.wait(TIMEOUT) == [0, 0], done.tails()
    assert (persist / "newest").read_text() == "v3" and jobs.list_jobs(shm_dir) == [], done.tails()


def test_sys_exit_in_a_thread_other_than_the_main_one_ends_that_thread_only_and_the_job_still_finishes(
        shm_dir, tmp_path):
    """``sys.exit(3)`` in a thread raises SystemExit there, which ends that thread and nothing
    else: the process goes on and exits with status 0. A fix that notes a non-zero exit where
    sys.exit is called (not where the process ends) would count this job as failed."""
    job, persist = job_id(), tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", 2, "--steps", "3", "--persist", str(persist), "--persist-interval", "100",
               "--end", "thread-exit3", job=job)
    assert done.wait(TIMEOUT) == [0, 0], done.tails()
    assert all(f"rank {r}: a thread of its own called sys.exit(3) and ended" in done.log(r) for r in range(2))
    assert (persist / "newest").read_text() == "v3" and jobs.list_jobs(shm_dir) == [], done.tails()


# The detector's and the finish's own timeouts in the test below: the ranks must end far sooner.
SLOW_TIMEOUTS = {"FTMEM_FAILURE_TIMEOUT_S": "60", "FTMEM_FINISH_TIMEOUT_S": "60"}
ENDED_WITHIN_S = 30


@pytest.mark.parametrize("others", ["stuck", "crash"])
@pytest.mark.fault("SIGTERM to one rank", phase="at the job's end", framework="adapter runtime",
                   expect="ends every rank within 30 s of rank 0's end, nothing flushed, memory kept for the restart")
def test_a_sigterm_to_the_rank_that_serves_the_store_alone_ends_the_others_within_seconds(others, shm_dir, tmp_path):
    """A single pod evicted: SIGTERM to rank 0 alone, whose process serves the job's store
    (``env://``, as under the deepspeed launcher). It is no preemption of the whole job (the
    others were not told), so rank 0 flushes nothing and ends by the signal once it stops
    waiting for them. The others then sit in a collective that does not fail by itself
    (``stuck``), or fail in their next one (``crash``). They used to end a minute later: the
    stuck ones on the detector's timeout for a silent store, the crashed ones in the second of
    two finish votes, whose gloo send to a rank that had given up waited out its 60 s. Now a
    store that nothing serves any more is a failure the detector acts on at its next beat, and
    a rank that failed does not wait for the others' word: both end well within a launcher's
    30 s of grace, their memory kept for the restart."""
    job, go = job_id(), tmp_path / "go"
    way = {"stuck": "hang", "crash": "raise"}[others]
    with run(shm_dir, tmp_path, 3, "--steps", "2", "--persist", str(tmp_path / "persist"), "--end", "hang",
             "--end-of-rank", f"1={way}", "--end-of-rank", f"2={way}", "--end-after", str(go), job=job,
             env=SLOW_TIMEOUTS) as ranks:
        if others == "stuck":
            go.touch()
        ranks.wait_for(lambda: all(f"rank {r}: ends with" in ranks.log(r) for r in range(3 if others == "stuck" else 1)),
                       TIMEOUT, "the ranks at their end")
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert ranks.procs[0].wait(TIMEOUT) == -signal.SIGTERM, ranks.tails()
        gone = time.monotonic()
        go.touch()  # the crashing ranks meet rank 0's absence now
        codes = []
        for r in (1, 2):
            try:
                codes.append(ranks.procs[r].wait(max(0.0, gone + ENDED_WITHIN_S - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still runs {ENDED_WITHIN_S} s after rank 0 ended. Logs:\n{ranks.tails()}")
    assert "not as a preemption of the whole job" in ranks.log(0), ranks.log(0)[-3000:]
    if others == "stuck":
        assert codes == [EXIT_CODE, EXIT_CODE], ranks.tails()
        assert all("is gone: nothing listens there any more" in ranks.log(r) for r in (1, 2)), ranks.tails()
    else:
        assert codes == [1, 1], ranks.tails()
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2], 2: [1, 2]}  # no finish: kept for the restart
