"""Faults of the shared-memory file system under DeepSpeed jobs, injected for real: a tmpfs
mounted as the job's shm_dir, too small from the start (a container's small /dev/shm), or
filled up by another process while the job trains."""
import os
import re
import signal
import threading

import pytest

from ftmem import restored_from_memory
from ftmem._shm import jobs
from harness.common import logged
from harness.ds_jobs import ITERS, TIMEOUT, DSJob, reference
from harness.machine_faults import tmpfs
from harness.toy import assert_same_training

WORLD = 2
MIRRORED = {"ec": {"k": 1, "m": 1}}


class Filler:
    """A writer that fills ``path``'s file system and goes on taking whatever room is freed there
    until :meth:`stop`, as a runaway writer beside the job does. Filled once only, the room the
    job freed afterwards (a marker replaced) let its next marker through, and which write met the
    full file system depended on the timing (a CI run's job never met it)."""

    def __init__(self, path: str):
        self.path = os.path.join(path, "filler")
        self._file = open(self.path, "wb", buffering=0)
        self._stopped = threading.Event()
        self._fill()
        self._thread = threading.Thread(target=self._keep_full, name="filler", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    self._file.write(b"\0" * chunk)
            except OSError:
                pass

    def _keep_full(self) -> None:
        while not self._stopped.wait(0.001):
            self._fill()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._file.close()


@pytest.mark.fault("/dev/shm filling up", phase="during the copy", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the save that found no room stops the job naming the "
                          "full file system, never a SIGBUS, and what was held stays")
def test_shared_memory_filled_by_another_process_mid_run_stops_the_job_clearly_and_loses_nothing(
        tmp_path, fault_clock):
    """The copy of version 3 is held on rank 0 while another process fills the job's tmpfs and
    keeps it full: the slots' pages were reserved when they grew, but a version's markers are new
    files, and the first of them written after that finds no room (rank 0's commit marker of
    version 3, or, where a protection was still running, a parity marker). The job stops with
    ShmBudgetError saying the file system is full and that something else filled it (not an
    OSError of a marker's temporary file, nor a SIGBUS), the job keeps its newest version, and
    once the space is freed the relaunch resumes from it bitwise as DeepSpeed's default engine."""
    ref = reference("zero1.json", WORLD, str(tmp_path / "reference"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with tmpfs(str(tmp_path / "shm"), "64m") as shm:
        job = DSJob("zero1.json", WORLD, shm, str(tmp_path / "run"), ftmem=MIRRORED)
        hold = {0: {"FTMEM_TEST_HOOK": "mid_copy:hold:rank=0:version=3", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
        with job.start(rank_env=hold) as run:
            run.wait_for(lambda: (hooks / "paused.rank0.v3").exists(), TIMEOUT, "the copy of version 3")
            filler = Filler(shm)
            fault_clock.injected()
            (hooks / "resume.rank0.v3").touch()
            try:
                codes = run.wait(TIMEOUT)
            finally:
                filler.stop()
            fault_clock.detected()
        # Whichever rank meets the full file system first stops the job with it; the other may end
        # first in a collective that rank left (rank 0's copy error reaches its training thread at a
        # save after the step, while rank 1, not held, may hit it at its next copy first).
        assert 1 in codes and -signal.SIGBUS not in codes, run.tails()
        said = "\n".join(job.log(rank) for rank in range(WORLD))
        assert re.search(r"ShmBudgetError: shared memory full: rank \d could not write version \d+'s "
                         rf"(commit|parity) marker \([\d.]+ KiB\) into {re.escape(shm)}/\S+: its file system has [\d.]+ \w?i?B free of "
                         r"64(\.0)? MiB, and ftmem's slots were reserved when they grew, so something else filled it",
                         said), said[-3000:]
        kept = int(re.search(r"keeps its newest version \((\d+)\) in shared memory", said).group(1))
        assert kept >= 2
        os.unlink(filler.path)
        assert job.run("--load") == [0] * WORLD, job.log(0)[-4000:]
        fault_clock.stepped()
    for rank in range(WORLD):
        assert logged(restored_from_memory(kept, rank, f"tag global_step{kept}"), job.log(rank)), job.log(rank)
    assert_same_training(job.out, ref, WORLD, ITERS)


@pytest.mark.fault("/dev/shm too small", phase="startup", framework="DeepSpeed ZeRO-3",
                   expect="refuses with a reason: the size needed and how to enlarge it, at the first save")
def test_shared_memory_too_small_from_the_start_stops_the_first_save_with_the_size_needed(tmp_path, fault_clock):
    """A 2 MiB tmpfs (a container's /dev/shm is 64 MiB, this model's versions are smaller):
    the first save asks the SMP for its slots, which checks the free space and reserves the
    pages at once, so every rank stops there with the size needed and the ways to get it, not
    with a SIGBUS in a later copy; nothing is left claiming to hold the job."""
    with tmpfs(str(tmp_path / "shm"), "2m") as shm:
        job = DSJob("zero3.json", WORLD, shm, str(tmp_path / "run"), ftmem=MIRRORED)
        fault_clock.injected()
        codes = job.run()
        fault_clock.detected()
        assert codes == [1] * WORLD, job.log(0)[-3000:]
        for rank in range(WORLD):
            assert re.search(rf"ShmBudgetError: shared memory too small: rank {rank} needs [\d.]+ \w?i?B more in "
                             rf"{re.escape(shm)}/\S+ \(3 versions x [\d.]+ \w?i?B data \+ 2 x [\d.]+ \w?i?B parity\), "
                             r"but that filesystem has [\d.]+ \w?i?B free\. Enlarge it \(docker run --shm-size=\.\.\.",
                             job.log(rank)), job.log(rank)[-3000:]
        assert not [node["versions"] for held in jobs.status(shm, job.job)["jobs"] for node in held["nodes"]
                    if node["versions"]]
