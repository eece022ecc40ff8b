"""The shell commands a newcomer runs: the demo and the benchmarks.

The benchmarks run on tiny sizes: no timing is asserted, only what a run must show
whatever the machine. Each ends with its one ``RESULT`` line, whose keys are the ones
docs/benchmarks.md lists, each naming its unit, with finite values; it frees the
shared memory it took; and the figures that count bytes rather than time are what
ftmem's layout makes them."""
import json

from harness.common import result_figures, run_cli
from benchmarks.bench_control_plane import RANKS_PER_NODE
from ftmem._common.agreement import REQUESTS_PER_DECISION
from ftmem._common.job_store import PROBE_REQUESTS
from ftmem._engine.failure_detector import REQUESTS_PER_BEAT


def assert_memory_freed(shm_dir):
    status = run_cli("status", "--json", "--shm-dir", shm_dir)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["jobs"] == [], status.stdout


def test_demo_rebuilds_a_lost_node_bitwise_and_frees_memory(shm_dir):
    out = run_cli("demo", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ftmem: restored iteration 7 from memory (rank 1, rebuilt from parity); losses of all 12 steps" in out.stdout
    assert out.stdout.count("bitwise equal to the reference: True") == 3
    assert out.stdout.rstrip().endswith("SUCCESS")


def test_bench_save_ends_with_its_result_line_and_frees_its_memory(shm_dir):
    figures = result_figures(run_cli("bench", "save", "--mb", "24", "--repeat", "2", "--shm-dir", shm_dir))
    assert set(figures) == {"save_s", "reusable_s", "torch_save_s", "memcpy_s", "vs_torch_save_x", "vs_memcpy_x",
                            "protected_s", "step_s", "cycle_s", "cycle_cost_s", "cycle_cost_vs_torch_save_x"}
    # A save can cost a step nothing (noise): the cycle cost alone may be negative.
    assert [k for k, v in figures.items() if v <= 0 and not k.startswith("cycle_cost")] == [], figures
    assert_memory_freed(shm_dir)


def test_bench_savecall_of_the_core_ends_with_its_result_line_and_frees_its_memory(shm_dir):
    figures = result_figures(run_cli("bench", "savecall", "--core-only", "--tiny", "--shm-dir", shm_dir))
    assert set(figures) == {f"core_{n}_{key}" for n in (30, 300) for key in ("call_s", "call_max_s", "walk_s",
                                                                              "vs_walk_x")} | {"core_vs_target_x"}
    assert [k for k, v in figures.items() if v <= 0] == [], figures
    assert_memory_freed(shm_dir)


def test_bench_ec_ends_with_its_result_line_and_holds_parity_and_dp_shards_as_ftmem_lays_them_out(shm_dir):
    """Three nodes at k=2, m=1, each rank holding 1.5x --mb of which half is replicated
    over the three: the parity and metadata held are m/k = 0.5 of the data (the issue's
    target: within 1%), and with DP sharding each rank copies --mb, 1.5x fewer bytes than
    it holds."""
    figures = result_figures(run_cli("bench", "ec", "--mb", "16", "--piece-mb", "4", "--shm-dir", shm_dir))
    assert set(figures) == {"encode_gbps", "rebuild_gbps", "xor_encode_gbps", "xor_rebuild_gbps", "memcpy_gbps",
                            "xor_vs_memcpy_x", "rs_vs_memcpy_x", "protect_s", "overhead_x", "dp_copied_mb",
                            "dp_held_mb", "dp_shard_saving_x"}
    assert [k for k, v in figures.items() if v <= 0] == [], figures
    assert abs(figures["overhead_x"] - 0.5) < 0.005, figures
    assert figures["dp_held_mb"] == 24 and abs(figures["dp_copied_mb"] - 16) < 0.01, figures
    assert_memory_freed(shm_dir)


def test_bench_protect_ends_with_its_result_line_draws_its_plot_and_frees_its_memory(shm_dir, tmp_path):
    plot = tmp_path / "protect.png"
    out = run_cli("bench", "protect", "--nodes", "2,3", "--m", "1", "--mb", "4", "--repeat", "1", "--plot", str(plot),
                  "--shm-dir", shm_dir)
    figures = result_figures(out)
    per_case = {"protect_{}_s", "protect_{}_gbps", "copy_{}_s", "alltoall_{}_gbps", "memcpy_{}_gbps",
                "protect_vs_alltoall_{}_x"}
    assert set(figures) == {key.format(case) for case in ("n2_m1", "n3_m1") for key in per_case} | {
        "protect_growth_m1_x"}
    assert [k for k, v in figures.items() if v <= 0] == [], figures
    assert f"plot: {plot}" in out.stdout and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_memory_freed(shm_dir)


def test_bench_control_plane_ends_with_its_result_line_and_runs_each_path_on_every_rank():
    """Every simulated rank runs each path to its end with the answer it should get (no rank
    missed): each of the others hears of the rank that fell silent, and not before the
    detector's timeout (2 s with --tiny); each records its arrival at a group in exactly two
    requests."""
    figures = result_figures(run_cli("bench", "control-plane", "--tiny", "--workers", "1"))
    paths, sizes = ("detector", "preemption", "end", "arrivals"), (16, 64)
    assert set(figures) == {f"{path}_{n}_{key}" for path in paths for n in sizes
                            for key in ("time_s", "first_to_last_s", "missed_n", "store_rps_n", "per_rank_n",
                                        "p50_s", "p99_s", "store_cpu_x")} | {
                               f"{path}_growth_x" for path in paths}, figures
    assert [k for k, v in figures.items() if k.endswith("missed_n") and v != 0] == [], figures
    assert [k for k, v in figures.items() if v <= 0 and not k.endswith(("store_cpu_x", "missed_n"))] == [], figures
    assert all(figures[f"detector_{n}_time_s"] >= 2 for n in sizes), figures
    assert all(figures[f"arrivals_{n}_per_rank_n"] == 2 for n in sizes), figures
    # What ftmem plan counts for the job's store is what the real code asks of it at most: a beat
    # an interval for each node (its beater's), so no more than 3 in the detector's steady window
    # of 3 intervals. At least one, not 2: a beat waits an interval after the last one ended, and
    # on a loaded machine the beating threads of 64 ranks in one process come late and fewer fit
    # (this check failed in a CI run beside other work, in a message too long to show which bound).
    per_node = {n: figures[f"detector_{n}_per_rank_n"] * RANKS_PER_NODE for n in sizes}
    assert all(REQUESTS_PER_BEAT <= got <= 3 * REQUESTS_PER_BEAT for got in per_node.values()), per_node
    # The decisions: at most a decision's requests for each node (its speaker's), as ftmem plan counts.
    assert all(figures[f"{path}_{n}_per_rank_n"] <= (REQUESTS_PER_DECISION + PROBE_REQUESTS) / RANKS_PER_NODE
               for path in ("preemption", "end") for n in sizes), figures
