"""``ftmem bench soak``, briefly: its RESULT line, and a job that frees its memory at the end.
(The real soak runs 1,000 iterations; see docs/benchmarks.md, `ftmem bench soak`.)"""
import os
import re
import subprocess
import sys

from harness.common import leftover_smps

from ftmem._shm import jobs
from ftmem._common.identity import root_dir
from ftmem._shm.procs import cmdline

KEYS = {"iters", "rank_rss_growth_mb", "smp_rss_growth_mb", "shm_growth_mb", "thread_growth", "fd_growth",
        "socket_growth", "seconds_per_iter_s", "smp_left", "shm_left_mb"}


def test_bench_soak_ends_with_a_result_line_and_frees_the_job(shm_dir):
    out = subprocess.run([sys.executable, "-m", "ftmem.cli", "bench", "soak", "--iters", "30", "--samples", "3",
                          "--shm-dir", shm_dir], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    figures = {k: float(v) for k, v in (kv.split("=") for kv in re.match(r"^RESULT (.*)$", last).group(1).split())}
    assert set(figures) == KEYS
    assert figures["iters"] == 30
    assert "job memory freed, no SMP left" in out.stdout
    # Every rank closed with job_finished: the SMPs freed their nodes and exited by themselves
    # (the benchmark's own clean-up afterwards found nothing to do).
    assert figures["smp_left"] == 0 and figures["shm_left_mb"] == 0
    assert jobs.list_jobs(shm_dir) == []
    assert not [pid for pid in leftover_smps() if any(shm_dir in a for a in cmdline(pid))]
    root = root_dir(shm_dir)
    assert not os.path.isdir(root) or os.listdir(root) == []
