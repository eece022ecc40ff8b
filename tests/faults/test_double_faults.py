"""Two faults in a row, the second before the recovery from the first is done, injected for
real under DeepSpeed jobs: a rank SIGKILLed during a preemption's flush (the job was SIGTERMed
and writes its newest version to disk), and a second node lost while the job restores from the
loss of the first. Every resume is compared with DeepSpeed's default engine."""
import os
import re
import signal

import pytest

from ftmem import restored_from_memory
from harness.common import logged
from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, reference
from harness.machine_faults import slow_calls
from harness.toy import assert_same_training

WORLD = 2
MIRRORED = {"ec": {"k": 1, "m": 1}}
GRACE_S = 30


def latest(persist: str) -> str:
    with open(os.path.join(persist, "latest")) as f:
        return f.read()


@pytest.mark.fault("rank SIGKILLed during a preemption's flush", phase="during a flush",
                   framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the other rank ends by its SIGTERM within the grace, the "
                          "half-written flush is never published, and memory holds the newest version")
def test_a_rank_killed_during_the_preemption_flush_leaves_the_disk_as_it_was_and_memory_resumes(
        shm_dir, tmp_path, fault_clock):
    """A flush every 3rd version; the job is preempted (SIGTERM to every rank) after step STOP,
    its syncs slowed so that the flush of version STOP+1 takes seconds; rank 1 is SIGKILLed in
    the middle of it. Rank 0 ends by its SIGTERM, as without ftmem, well within the grace; the
    disk still names global_step3, and the relaunch resumes from memory, bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    persist = str(tmp_path / "persist")
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 3}, "preemption": {"grace_s": GRACE_S}})
    newest = STOP + 1
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(WORLD)), TIMEOUT, f"step {STOP}")
        assert latest(persist) == "global_step3"
        with slow_calls([p.pid for p in run.procs], ["fsync", "fdatasync"], 2):
            for proc in run.procs:
                proc.send_signal(signal.SIGTERM)
            run.wait_for(lambda: "the newest version goes to" in run.log(0), GRACE_S,
                         "the job's decision to flush")
            run.procs[1].kill()
            fault_clock.injected()
            assert run.wait(GRACE_S) == [-signal.SIGTERM, -signal.SIGKILL], run.tails()
            fault_clock.detected()
    assert re.search(rf"version {newest} was not flushed at SIGTERM \(", job.log(0)), job.log(0)[-3000:]
    assert latest(persist) == "global_step3" and f"global_step{newest}" not in os.listdir(persist)
    assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
    fault_clock.stepped()
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank, f"tag global_step{newest}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)
