"""One rank of a job whose training and whose ftmem are given different networks
(tests/integration/engine/test_network.py): ftmem's bytes, one snapshot protected by a mirror
on the other node over ftmem's own groups (``"network": {"interface": ...}``), then the
training's, an all-reduce on a gloo group of its own made after ftmem's (GLOO_SOCKET_IFNAME's
interface, which making ftmem's groups must leave to the training).

Run one rank per process with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and FTMEM_JOB_ID set::

    python -m tests.harness.network_job --shm-dir DIR --interface NAME --state-bytes N --training-bytes N
"""
import argparse

import torch
import torch.distributed as dist

from examples.process_end import end_process
from ftmem import SnapshotEngine


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.network_job")
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--interface", required=True, help="ftmem's network interface")
    parser.add_argument("--state-bytes", type=int, required=True, help="the snapshot's size on each rank")
    parser.add_argument("--training-bytes", type=int, required=True, help="the training all-reduce's size")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    engine = SnapshotEngine({"ranks_per_node": 1, "shm_dir": args.shm_dir, "ec": {"k": 1, "m": 1}, "dp_shard": "off",
                             "network": {"interface": args.interface}})
    state = {"w": torch.randn(args.state_bytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))}
    engine.save(state, 1)
    engine.wait_protected()  # committed on every rank and protected: the mirror has crossed
    dist.all_reduce(torch.ones(args.training_bytes // 4), group=dist.new_group(backend="gloo"))
    engine.close(job_finished=True)
    end_process()


if __name__ == "__main__":
    main()
