"""The pure helpers of ``ftmem bench recovery`` (the benchmark itself needs root, network
namespaces and minutes: it is run by hand, docs/benchmarks.md)."""
import os
import subprocess
import sys
import time
from datetime import datetime

from harness.common import REPO
from benchmarks.bench_recovery import SEGMENTS, _process_start, rendezvous_after, segments


def test_the_agent_s_rendezvous_is_read_off_its_log_in_local_time_after_the_failure():
    before, after = datetime(2026, 11, 28, 8, 30, 3, 131000), datetime(2026, 11, 28, 8, 30, 34, 104000)
    log = "".join(f"I{at:%m%d %H:%M:%S.%f} 16802 torch/distributed/elastic/agent/server/api.py:553] [default] "
                  f"Rendezvous complete for workers. Result:\n" for at in (before, after))
    assert rendezvous_after(log, before.timestamp() + 1) == after.timestamp()
    assert rendezvous_after(log, before.timestamp() - 1) == before.timestamp()
    assert rendezvous_after(log, after.timestamp() + 1) is None


def test_the_segments_follow_one_another_and_add_up_to_the_first_step():
    marks = ["detected", "ended", "started", "imported", "process_group", "initialized", "restored", "step"]
    timeline = {name: float(i + 1) ** 1.5 for i, name in enumerate(marks)}
    parts = segments(timeline)
    assert list(parts) == [key for key, *_ in SEGMENTS]
    assert parts["detect"] == timeline["detected"]
    assert abs(sum(parts.values()) - timeline["step"]) < 1e-9


def test_a_process_s_start_is_read_from_proc_to_the_clock_tick():
    """Before the process runs a line of Python (the interpreter's start is the launcher's time)."""
    before = time.time()
    child = subprocess.run([sys.executable, "-c", "from benchmarks.bench_recovery import _process_start; "
                            "import time; print(_process_start(), time.time())"],
                           capture_output=True, text=True, cwd=REPO, check=True)
    after = time.time()
    started, running = map(float, child.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= started <= running - tick <= after  # (an interpreter starts in more than a tick)
