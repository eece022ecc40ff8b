"""The shell commands a newcomer runs: the demo and the benchmarks."""
import re

from conftest import run_cli


def test_demo_rebuilds_a_lost_node_bitwise_and_frees_memory(shm_dir):
    out = run_cli("demo", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ftmem: restored iteration 7 from memory (rank 1, rebuilt from parity); losses of all 12 steps" in out.stdout
    assert out.stdout.count("bitwise equal to the reference: True") == 3
    assert out.stdout.rstrip().endswith("SUCCESS")


def test_bench_save_ends_with_a_result_line(shm_dir):
    out = run_cli("bench", "save", "--mb", "24", "--repeat", "2", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    figures = dict(kv.split("=") for kv in re.match(r"^RESULT (.*)$", last).group(1).split())
    assert set(figures) == {"save_s", "reusable_s", "torch_save_s", "memcpy_s", "vs_torch_save_x", "vs_memcpy_x"}
    values = {k: float(v) for k, v in figures.items()}
    assert all(v > 0 for v in values.values())
    assert abs(values["vs_memcpy_x"] - values["reusable_s"] / values["memcpy_s"]) < 1e-3 * values["vs_memcpy_x"]


def test_bench_ec_ends_with_a_result_line(shm_dir):
    out = run_cli("bench", "ec", "--mb", "16", "--piece-mb", "4", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert {"encode_gbps", "rebuild_gbps", "memcpy_gbps", "protect_s", "overhead_x"} <= set(figures)
    assert all(float(v) > 0 for v in figures.values())
    assert abs(float(figures["overhead_x"]) - 0.5) < 0.005  # k=2, m=1: parity is half the data
