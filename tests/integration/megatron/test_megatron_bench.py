"""``python -m benchmarks.bench_megatron`` and ``ftmem bench megatron`` at a tiny size: each
runs end to end (restoring bitwise, which the benchmark checks), frees its shared
memory and ends with one RESULT line of positive figures. No timing is asserted."""
import subprocess
import sys

import pytest

from benchmarks import restore_breakdown
from ftmem._shm import jobs
from harness.common import result_figures, run_cli

KEYS = {"ftmem_save_s", "torch_save_s", "save_vs_torch_x", "ftmem_restore_s", "torch_restore_s",
        "restore_vs_torch_x", "persist_save_s", "persist_vs_memory_save_x", "flush_s", "flush_gbps",
        "torch_save_gbps", "params", "step_s", "cycle_s", "cycle_cost_s", "cycle_cost_vs_torch_save_x", "drains_s",
        *restore_breakdown.KEYS}


def test_megatron_bench_ends_with_a_result_line(shm_dir):
    """`ftmem bench megatron` (the command routes to benchmarks.bench_megatron)."""
    out = subprocess.run([sys.executable, "-m", "ftmem.cli", "bench", "megatron", "--tiny", "--saves", "2",
                          "--shm-dir", shm_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1
    result = {k: float(v) for k, v in (kv.split("=") for kv in lines[-1].split()[1:])}
    assert KEYS <= result.keys()
    # A save can cost an iteration nothing (noise): the cycle cost alone may be negative. A
    # restore with no node lost rebuilds nothing, and TP 2 has no DP replica to gather from.
    phases = [f"ftmem_restore_{phase}_s" for phase in restore_breakdown.PHASES]
    assert all(v > 0 for k, v in result.items() if not k.startswith("cycle_cost") and k not in phases), result
    assert all(result[k] >= 0 for k in phases) and result["ftmem_restore_copy_s"] > 0, result
    # The phases are rank 0's, inside its load, which the restore figure times.
    assert sum(result[k] for k in phases) <= result["ftmem_restore_s"], result
    assert abs(result["cycle_cost_s"] - (result["cycle_s"] - result["step_s"])) < 1e-6 + 1e-3 * result["cycle_s"]
    assert "target >= 20x" in out.stdout and "(target <= 1.05x); written from memory" in out.stdout
    assert jobs.list_jobs(shm_dir) == []  # the benchmark's job freed its shared memory


OVERHEAD_KEYS = {"params", "checkpoint_gb", "step_s", "ftmem_cycle_s", "torch_cycle_s", "ftmem_overhead_pct",
                 "torch_overhead_pct", "ftmem_save_call_s", "torch_save_call_s", "ftmem_copy_s",
                 "ftmem_protect_s", "ftmem_steady_cycle_s", "ftmem_steady_overhead_pct", "ftmem_drain_s"}


def test_the_overhead_bench_ends_with_a_result_line(shm_dir):
    """``ftmem bench overhead --tiny`` (the 1.1B-parameter bf16 default needs a GPU): each
    kind's blocks ran, and the overheads are those of the printed per-iteration times."""
    out = subprocess.run([sys.executable, "-m", "ftmem.cli", "bench", "overhead", "--tiny", "--rounds", "2",
                          "--shm-dir", shm_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1
    result = {k: float(v) for k, v in (kv.split("=") for kv in lines[-1].split()[1:])}
    assert result.keys() == OVERHEAD_KEYS
    assert all(result[k] > 0 for k in OVERHEAD_KEYS if not k.endswith("_pct")), result
    for kind in ("ftmem", "torch", "ftmem_steady"):
        expected = 100 * (result[f"{kind}_cycle_s"] / result["step_s"] - 1)
        assert abs(result[f"{kind}_overhead_pct"] - expected) < 1e-3 * abs(expected) + 1e-3
    # Each block's steady figure is its whole time less the drain, so the medians keep that order.
    assert result["ftmem_steady_cycle_s"] < result["ftmem_cycle_s"]
    for kind in ("nosave", "ftmem", "torch"):
        assert sum(ln.startswith(f"  {kind:7s} s per iteration: ") and len(ln.split(": ")[1].split()) == 2
                   for ln in lines) == 1, out.stdout
    assert "nothing is drained outside it" in out.stdout and "a checkpoint is" in out.stdout
    assert sum(ln.startswith("  steady state, the drain left out: ") and ln.endswith(" s, timed apart")
               for ln in lines) == 1, out.stdout
    assert jobs.list_jobs(shm_dir) == []  # the benchmark's job freed its shared memory


def test_blocks_of_one_iteration_report_no_steady_state():
    """With one iteration per block no earlier save runs beside an iteration, so the figures
    leave the steady state out instead of calling an iteration plus its save call steady; blocks
    of two keep it. (The report's arithmetic on a worker's report, without a model.)"""
    from benchmarks.bench_overhead import figures

    report = {"params": 10, "checkpoint_bytes": 4e9, "per_iteration_s": {"nosave": [1.0, 1.2], "ftmem": [1.5, 1.7]},
              "save_calls_s": {"ftmem": [0.05, 0.07]}, "copies_s": [0.2, 0.4], "protects_s": [0.3, 0.5],
              "steady_s": [1.02, 1.04], "drains_s": [0.4, 0.6]}
    one = figures(report, block=1)
    assert not any(k.startswith(("ftmem_steady", "ftmem_drain")) for k in one), one
    assert one["ftmem_cycle_s"] == pytest.approx(1.6) and one["ftmem_overhead_pct"] == pytest.approx(100 * (1.6 / 1.1 - 1))
    two = figures(report, block=2)
    assert two["ftmem_steady_cycle_s"] == pytest.approx(1.03) and two["ftmem_drain_s"] == pytest.approx(0.5)
    assert two["ftmem_steady_overhead_pct"] == pytest.approx(100 * (1.03 / 1.1 - 1))
    assert one.keys() | {"ftmem_steady_cycle_s", "ftmem_steady_overhead_pct", "ftmem_drain_s"} == two.keys()


def test_the_overhead_bench_refuses_an_empty_block():
    out = subprocess.run([sys.executable, "-m", "ftmem.cli", "bench", "overhead", "--tiny", "--block", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--rounds and --block must be at least 1 (got --rounds 3 --block 0)" in out.stderr


def test_the_save_call_bench_ends_with_a_result_line_for_the_core_and_both_adapters(shm_dir):
    """``ftmem bench savecall --tiny``: the core in this process, DeepSpeed and megatron-core on
    2 ranks each; each adapter's figures beside its default save and its framework's own part,
    ftmem's share the difference; the memory freed."""
    result = result_figures(run_cli("bench", "savecall", "--tiny", "--shm-dir", shm_dir))
    for name in ("deepspeed", "megatron"):
        figures = {key.removeprefix(f"{name}_"): value for key, value in result.items() if key.startswith(name)}
        assert set(figures) == {"tensors_n", "call_s", "call_max_s", "default_s", "framework_s", "ftmem_share_s",
                                "vs_default_x", "share_vs_target_x"}, figures
        assert figures["tensors_n"] > 10 and figures["call_max_s"] >= figures["call_s"] > 0, figures
        assert abs(figures["ftmem_share_s"] - (figures["call_s"] - figures["framework_s"])) < 1e-6, figures
    assert {"core_30_call_s", "core_300_call_s", "core_vs_target_x"} <= result.keys()
    assert jobs.list_jobs(shm_dir) == []
