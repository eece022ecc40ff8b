"""``ftmem bench peers --tiny``: torch.save, DCP's async_save and ftmem on one tiny GPT, each
restore checked bitwise by the benchmark (it fails otherwise); one RESULT line of finite,
positive figures (a save may cost an iteration nothing: the cycle cost alone may be
negative; harness.common.result_figures checks the line), and nothing left in shared memory. No timing is asserted."""
import os

from ftmem._shm import jobs
from harness.common import result_figures, run_cli

PEERS = ("torch_save", "dcp_async", "ftmem")


def test_the_peers_bench_ends_with_a_result_line_and_leaves_nothing_behind(shm_dir):
    result = result_figures(run_cli("bench", "peers", "--tiny", "--shm-dir", shm_dir))
    per_peer = ("call_s", "step_s", "cycle_s", "overhead_x", "cycle_cost_s", "restore_s")
    assert set(result) == {"params_n"} | {f"{p}_{key}" for p in PEERS for key in per_peer} | {
        f"{p}_{key}" for p in PEERS[:-1] for key in ("call_vs_ftmem_x", "restore_vs_ftmem_x")}, sorted(result)
    assert [k for k, v in result.items() if v <= 0 and "cycle_cost" not in k] == [], result
    # the job freed, and no file of torch.save or DCP left
    assert jobs.list_jobs(shm_dir) == [] and [n for n in os.listdir(shm_dir) if n.startswith("bench-peers")] == []
