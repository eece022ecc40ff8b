"""``python -m benchmarks.bench_megatron`` and ``ftmem bench megatron`` at a tiny size: each
runs end to end (restoring bitwise, which the benchmark checks), frees its shared
memory and ends with one RESULT line of positive figures. No timing is asserted."""
import subprocess
import sys

import pytest

from ftmem import jobs

KEYS = {"ftmem_save_s", "torch_save_s", "save_vs_torch_x", "ftmem_restore_s", "torch_restore_s",
        "restore_vs_torch_x", "persist_save_s", "persist_vs_memory_save_x", "flush_s", "flush_gbps",
        "torch_save_gbps", "params", "step_s", "cycle_s", "cycle_cost_s", "cycle_cost_vs_torch_save_x", "drains_s"}


@pytest.mark.parametrize("command", [
    ["-m", "benchmarks.bench_megatron", "--tiny", "--saves", "2"],
    ["-m", "ftmem.cli", "bench", "megatron", "--tiny"],
], ids=["module", "cli"])
def test_megatron_bench_ends_with_a_result_line(command, shm_dir):
    out = subprocess.run([sys.executable, *command, "--shm-dir", shm_dir], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1
    result = {k: float(v) for k, v in (kv.split("=") for kv in lines[-1].split()[1:])}
    assert KEYS <= result.keys()
    # A save can cost an iteration nothing (noise): the cycle cost alone may be negative.
    assert all(v > 0 for k, v in result.items() if not k.startswith("cycle_cost")), result
    assert abs(result["cycle_cost_s"] - (result["cycle_s"] - result["step_s"])) < 1e-6 + 1e-3 * result["cycle_s"]
    assert "target >= 20x" in out.stdout and "(target <= 1.05x); written from memory" in out.stdout
    assert jobs.list_jobs(shm_dir) == []  # the benchmark's job freed its shared memory
