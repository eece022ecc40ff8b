"""Two faults in a row, the second before the recovery from the first is done, injected for
real under DeepSpeed jobs: a rank SIGKILLed during a preemption's flush (the job was SIGTERMed
and writes its newest version to disk), and a second node lost while the job restores from the
loss of the first. Every resume is compared with DeepSpeed's default engine."""
import os
import re
import signal

import pytest

from ftmem import restored_from_disk, restored_from_memory
from ftmem._shm import jobs
from harness.common import ANY, logged
from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, latest_tag, reference
from harness.machine_faults import slow_calls
from harness.toy import assert_same_training

WORLD = 2
MIRRORED = {"ec": {"k": 1, "m": 1}}
GRACE_S = 30


@pytest.mark.fault("rank SIGKILLed during a preemption's flush", phase="during a flush",
                   framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the other rank ends by its SIGTERM within the grace, the "
                          "half-written flush is never published, and memory holds the newest version")
def test_a_rank_killed_during_the_preemption_flush_leaves_the_disk_as_it_was_and_memory_resumes(
        shm_dir, tmp_path, fault_clock):
    """A flush every 3rd version; the job is preempted (SIGTERM to every rank) after step STOP,
    its syncs slowed so that the flush of version STOP+1 takes seconds; rank 1 is SIGKILLed in
    the middle of it, once rank 0 made its staging directory (the job's log line before the
    flush came first, and on a loaded machine rank 1 died before the job had chosen the version).
    Rank 0 ends by its SIGTERM, as without ftmem, well within the grace; the disk still names
    global_step3, and the relaunch resumes from memory, bitwise."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    persist = str(tmp_path / "persist")
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={**MIRRORED, "persist": {"dir": persist, "interval": 3}, "preemption": {"grace_s": GRACE_S}})
    newest = STOP + 1
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(WORLD)), TIMEOUT, f"step {STOP}")
        assert latest_tag(persist) == "global_step3"
        with slow_calls([p.pid for p in run.procs], ["fsync", "fdatasync"], 2):
            for proc in run.procs:
                proc.send_signal(signal.SIGTERM)
            run.wait_for(lambda: os.path.isdir(os.path.join(persist, f".global_step{newest}.tmp")), GRACE_S,
                         f"the flush of version {newest} to start")
            run.procs[1].kill()
            fault_clock.injected()
            assert run.wait(GRACE_S) == [-signal.SIGTERM, -signal.SIGKILL], run.tails()
            fault_clock.detected()
    assert re.search(rf"version {newest} was not flushed at SIGTERM \(", job.log(0)), job.log(0)[-3000:]
    assert latest_tag(persist) == "global_step3" and f"global_step{newest}" not in os.listdir(persist)
    assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
    fault_clock.stepped()
    for rank in range(WORLD):
        assert logged(restored_from_memory(newest, rank, f"tag global_step{newest}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("node lost while the job restores from another node's loss", phase="during a restore",
                   framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from disk: the restore's survivors end, and with two nodes of k=2, m=1 "
                          "lost the relaunch takes the newest checkpoint on disk, saying why")
def test_a_second_node_lost_during_the_restore_from_the_first_falls_back_to_the_disk(shm_dir, tmp_path, fault_clock):
    """k=2, m=1 over 3 nodes, a flush every 3rd version. Node 0 is lost; its relaunch agrees on
    version STOP+1 (node 0 to be rebuilt from parity), and node 2 is lost there, its rank held
    before anything is read: the other ranks end (their restore's collective broke) within the
    failure detector's timeout, and the next relaunch, with two nodes lost, finds memory unable
    to serve and resumes from global_step3 on disk, bitwise as DeepSpeed's default engine."""
    world = 3
    ref = reference("zero1.json", world, str(tmp_path / "reference"))
    persist = str(tmp_path / "persist")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    job = DSJob("zero1.json", world, shm_dir, str(tmp_path / "run"), ftmem={"persist": {"dir": persist, "interval": 3}})
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, 0)
    held = {2: {"FTMEM_TEST_HOOK": f"mid_restore:hold:rank=2:version={STOP + 1}", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    with job.start("--load", rank_env=held) as run:
        run.wait_for(lambda: (hooks / f"paused.rank2.v{STOP + 1}").exists(), TIMEOUT, "the restore to agree")
        run.procs[2].kill()
        jobs.lose_node(shm_dir, job.job, 2)
        fault_clock.injected()
        codes = run.wait(TIMEOUT)
        fault_clock.detected()
    assert codes[2] == -signal.SIGKILL and all(code not in (0, None) for code in codes[:2]), run.tails()
    assert latest_tag(persist) == "global_step3"
    assert job.run("--load") == [0] * world, job.log(0)[-5000:]
    fault_clock.stepped()
    for rank in range(world):
        assert logged(restored_from_disk(3, f"{persist}/global_step3", rank, ANY), job.log(rank)), job.log(rank)
    assert "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 2]" in job.log(0), job.log(0)[-3000:]
    assert_same_training(job.out, ref, world, ITERS)
