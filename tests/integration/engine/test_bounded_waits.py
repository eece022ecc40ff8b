"""Every wait ftmem starts has a bound of its own, and one that runs out names what did not
come (the issue "waits without a bound of ftmem's own"): the protection's collectives, which
waited for gloo's 30 minutes on a rank that never came, and the copy into shared memory,
which the step and the protection waited for without end. Real ranks, stopped for real."""
import re

import pytest

from harness.common import job_id
from harness.ranks import LocalJob

TIMEOUT = 120
# The waits, cut short for the test: how far apart the ranks may come, and the least a copy may take.
BOUNDS = {"FTMEM_COLLECTIVE_TIMEOUT_S": "5", "FTMEM_COPY_TIMEOUT_S": "3"}


def run(shm_dir, out, *args, rank_env=None) -> LocalJob:
    return LocalJob("tests.harness.lifecycle_job", ["--out", str(out), "--steps", "3", *args], 2, job_id(), str(out),
                    env={"SHM_DIR": shm_dir, **BOUNDS}, rank_env=rank_env)


@pytest.mark.fault("rank stopped (SIGSTOP)", phase="during protection", framework="adapter runtime",
                   expect="ends every rank within FTMEM_COLLECTIVE_TIMEOUT_S that waits for it: rank 0 raises "
                          "CollectiveNotJoined naming rank 1, not after gloo's 30 minutes")
def test_a_rank_that_never_comes_to_the_protection_is_named_when_the_wait_runs_out(shm_dir, tmp_path):
    """Rank 1 stops (SIGSTOP: a hung host) once the job agreed to protect version 2, before
    the parity exchange with its column; the failure detector is off, as it would end rank 0
    first. Rank 0's protection waits for it at most FTMEM_COLLECTIVE_TIMEOUT_S, and its wait
    for the save (the script's wait_flushed) raises, naming rank 1, where it waited out gloo's
    30 minutes."""
    hook = {"FTMEM_TEST_HOOK": "before_protect:stop:rank=1:version=2"}
    with run(shm_dir, tmp_path, "--no-failure-detection", rank_env={1: hook}) as ranks:
        assert ranks.procs[0].wait(TIMEOUT) == 1, ranks.tails()
    said = ranks.log(0)
    assert re.search(r"CollectiveNotJoined: rank 0.s exchange of version 2.s records with its EC column: ranks \[1\] did "
                     r"not come within 5 s \(FTMEM_COLLECTIVE_TIMEOUT_S sets", said), said[-3000:]


@pytest.mark.fault("copy into shared memory stalled", phase="during the copy", framework="adapter runtime",
                   expect="ends every rank within FTMEM_COPY_TIMEOUT_S that waits for it: the wait raises, naming the "
                          "version and its size")
def test_a_copy_that_does_not_end_is_named_when_the_wait_for_it_runs_out(shm_dir, tmp_path):
    """Rank 0's copy of version 2 stops halfway (a device that no longer answers). The wait
    for it (the script's wait_flushed, as DeepSpeed's optimizer step waits for the copy) raises
    after FTMEM_COPY_TIMEOUT_S and a second per 50 MB of the copy, naming it."""
    hook = {"FTMEM_TEST_HOOK": "mid_copy:pause:rank=0:version=2", "FTMEM_TEST_HOOK_DIR": str(tmp_path)}
    with run(shm_dir, tmp_path, rank_env={0: hook}) as ranks:
        code = ranks.procs[0].wait(TIMEOUT)
        assert code == 1, (code, ranks.tails())
    said = ranks.log(0)
    assert re.search(r"FtmemError: the copy of version 2 \([0-9.]+ MiB\) into shared memory has not ended within 3 s",
                     said), said[-3000:]
