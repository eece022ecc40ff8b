"""The shell commands a newcomer runs: the demo and the benchmarks."""
import re

from harness.common import run_cli


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
    assert set(figures) == {"save_s", "reusable_s", "torch_save_s", "memcpy_s", "vs_torch_save_x", "vs_memcpy_x",
                            "protected_s", "step_s", "cycle_s", "cycle_cost_s", "cycle_cost_vs_torch_save_x"}
    values = {k: float(v) for k, v in figures.items()}
    # A save can cost a step nothing (noise): the cycle cost alone may be negative.
    assert all(v > 0 for k, v in values.items() if not k.startswith("cycle_cost"))
    assert abs(values["vs_memcpy_x"] - values["reusable_s"] / values["memcpy_s"]) < 1e-3 * values["vs_memcpy_x"]
    assert abs(values["cycle_cost_s"] - (values["cycle_s"] - values["step_s"])) < 1e-6 + 1e-3 * values["cycle_s"]
    assert values["protected_s"] >= values["reusable_s"]


def test_bench_ec_ends_with_a_result_line(shm_dir):
    out = run_cli("bench", "ec", "--mb", "16", "--piece-mb", "4", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert {"encode_gbps", "rebuild_gbps", "memcpy_gbps", "protect_s", "overhead_x"} <= set(figures)
    assert all(float(v) > 0 for v in figures.values())
    assert abs(float(figures["overhead_x"]) - 0.5) < 0.005  # k=2, m=1: parity is half the data


def test_bench_protect_ends_with_a_result_line_and_draws_its_plot(shm_dir, tmp_path):
    plot = tmp_path / "protect.png"
    out = run_cli("bench", "protect", "--nodes", "2,3", "--m", "1", "--mb", "4", "--repeat", "1", "--plot", str(plot),
                  "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = {k: float(v) for k, v in
               (kv.split("=") for kv in out.stdout.strip().splitlines()[-2].removeprefix("RESULT ").split())}
    per_case = {"protect_{}_s", "protect_{}_gbps", "copy_{}_s", "alltoall_{}_gbps", "memcpy_{}_gbps",
                "protect_vs_alltoall_{}_x"}
    assert set(figures) == {key.format(case) for case in ("n2_m1", "n3_m1") for key in per_case} | {
        "protect_growth_m1_x"}
    assert all(v > 0 for v in figures.values())
    assert abs(figures["protect_vs_alltoall_n3_m1_x"] - figures["protect_n3_m1_gbps"] / figures["alltoall_n3_m1_gbps"]
               ) < 1e-3 * figures["protect_vs_alltoall_n3_m1_x"]
    assert f"plot: {plot}" in out.stdout and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
