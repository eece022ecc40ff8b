"""The preemption signal on one rank without a persistent tier, and with a handler of the
script's own (the flushes with a tier run through the frameworks: tests/integration/deepspeed
and megatron)."""
import os
import signal
import subprocess
import sys
import textwrap

from harness.common import job_id
from harness.ranks import REPO, wait_until

SCRIPT = textwrap.dedent("""
    import signal, sys, time
    import torch
    from ftmem import SnapshotEngine
    if sys.argv[2] == "own handler":
        signal.signal(signal.SIGTERM, lambda *a: (print("the script's handler ran", flush=True), sys.exit(3)))
    engine = SnapshotEngine({"shm_dir": sys.argv[1]})
    engine.save({"w": torch.ones(4)}, 1).wait_protected()
    print("ready", flush=True)
    while True:
        time.sleep(60)
""")


def _start(shm_dir: str, how: str, tmp_path) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "rank.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, shm_dir, how], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, FTMEM_JOB_ID=job_id()))
    wait_until(lambda: "ready" in open(log).read() or proc.poll() is not None, 60, "the engine's first save")
    return proc, log


def test_without_a_persistent_tier_sigterm_says_what_is_lost_and_ends_the_process_as_sigterm_does(shm_dir, tmp_path):
    proc, log = _start(shm_dir, "ftmem's", tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
    said = open(log).read()
    assert ("ftmem: SIGTERM: no persistent tier (\"ftmem.persist\") to flush to: what memory holds (version 1 "
            "protected, 1 saved) is lost if the job's machines go") in said, said


def test_a_handler_the_script_set_first_keeps_the_signal(shm_dir, tmp_path):
    proc, log = _start(shm_dir, "own handler", tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 3
    finally:
        proc.kill()
    said = open(log).read()
    assert "SIGTERM has a handler of its own" in said and "the script's handler ran" in said, said
    assert "no persistent tier (\"ftmem.persist\") to flush to" not in said
