"""The machine's wall clock stepped back and forward under a running DeepSpeed job, as an NTP
correction or an operator's ``date -s`` steps it: ftmem measures every bound on the monotonic
clock, so no step is taken for a silent rank or a late copy."""
import time

import pytest

from harness.ds_jobs import ITERS, TIMEOUT, DSJob, reference
from harness.machine_faults import stepped_clock
from harness.toy import assert_same_training

WORLD = 2
DETECT_S = 4
STEP_S = 1800  # half an hour: far past every timeout of ftmem's


@pytest.mark.fault("wall clock stepped back and forward", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="goes on: no rank is taken for silent, no wait runs out, and training is bitwise as "
                          "without ftmem")
def test_the_wall_clock_stepped_back_and_forward_during_a_run_changes_nothing(shm_dir, tmp_path):
    """While rank 0 copies version 3 (held there: the job waits for it, its failure detector
    beating), the clock steps back half an hour, then forward an hour, each step held for more
    than the detector's timeout: no rank ends, and the job trains to its end bitwise as
    DeepSpeed's default engine. The clock reads right again after the test."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    job = DSJob("zero1.json", WORLD, shm_dir, str(tmp_path / "run"),
                ftmem={"ec": {"k": 1, "m": 1}, "failure_detection": {"timeout_s": DETECT_S}})
    hold = {0: {"FTMEM_TEST_HOOK": "mid_copy:hold:rank=0:version=3", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    with job.start(rank_env=hold) as run:
        run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
        with stepped_clock() as clock:
            for step in (-STEP_S, 2 * STEP_S):
                clock.step(step)
                time.sleep(1.5 * DETECT_S)
                assert all(proc.poll() is None for proc in run.procs), run.tails()
        (hooks / "resume.rank0.v3").touch()
        assert run.wait(TIMEOUT) == [0] * WORLD, run.tails()
    assert "has not answered" not in job.log(0) + job.log(1)
    assert_same_training(job.out, ref, WORLD, ITERS)
