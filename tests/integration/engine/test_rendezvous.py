"""ftmem.adapter.everyone_joins on a real two-rank job (gloo), on the launcher's TCPStore and on
the FileStore of ``init_method="file://..."`` (as DeepSpeed's own unit tests start their
ranks): a FileStore's wait runs out with another error than a TCPStore's."""
import os
import subprocess
import sys
import textwrap

import pytest

from harness.ranks import free_port

RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from ftmem import CollectiveNotJoined
    from ftmem.adapter import everyone_joins

    rank, init_method, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    if mode == "joined":
        for _ in range(3):
            everyone_joins("a test read", "Call it on every rank.")
        dist.barrier()  # both ranks are through all three
        keys = [f"ftmem/rendezvous/{call}/{name}" for call in range(3) for name in ("0", "1", "decision", "through")]
        print(f"keys left: {[key for key in keys if store.check([key])]}", flush=True)
    else:  # rank 1 comes only once rank 0 gave up on it
        if rank == 1:
            dist.barrier()
        try:
            everyone_joins("a test read", "Call it on every rank.")
        except CollectiveNotJoined as e:
            print(f"refused: {e}", flush=True)
        if rank == 0:
            dist.barrier()
    dist.destroy_process_group()
""")


STORES = ["tcp", "file"]


def run_ranks(tmp_path, store: str, mode: str) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    init_method = f"tcp://127.0.0.1:{free_port()}" if store == "tcp" else f"file://{tmp_path / 'store'}"
    env = dict(os.environ, FTMEM_COLLECTIVE_TIMEOUT_S="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), init_method, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


@pytest.mark.parametrize("store", STORES)
def test_a_joined_rendezvous_leaves_no_keys_on_the_job_s_store(tmp_path, store):
    outs = run_ranks(tmp_path, store, "joined")
    assert all("keys left: []" in out for out in outs), outs


@pytest.mark.parametrize("store", STORES)
@pytest.mark.fault("rank late to a collective", phase="during a restore", framework="adapter runtime",
                   expect="refuses with a reason: CollectiveNotJoined within FTMEM_COLLECTIVE_TIMEOUT_S naming rank 1, "
                          "and the late rank at once")
def test_a_rank_alone_is_refused_within_the_bound_and_a_late_one_at_once(tmp_path, store):
    outs = run_ranks(tmp_path, store, "abandoned")
    assert "refused: a test read is a collective" in outs[0] and "ranks [1] did not within 2 s" in outs[0], outs
    assert "refused: a test read is a collective" in outs[1], outs
