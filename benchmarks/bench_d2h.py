"""``ftmem bench d2h``: device-to-host bandwidth of an ftmem save of CUDA tensors into
pinned shared memory (save call to "reusable": the copies on the side stream are done),
beside a plain pinned ``cudaMemcpyAsync`` of the same bytes (``copy_(non_blocking=True)``
into ``pin_memory`` tensors) and a pageable copy, all in one run on one GPU."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from ftmem._shm import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem import SnapshotEngine

TENSORS = 8


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_d2h(total_mb: int = 1024, repeat: int = 5, shm_dir: str = "/dev/shm") -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("ftmem bench d2h: needs CUDA (a machine with an NVIDIA GPU and a CUDA build of torch).")
    per = (total_mb << 20) // TENSORS // 4
    state = {f"w{i}": torch.randn(per, device="cuda") for i in range(TENSORS)}
    nbytes = per * 4 * TENSORS
    job = f"bench-d2h-{os.getpid()}"
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)
    try:
        for version in range(2):  # both slots allocated, mapped and pinned
            engine.save(state, version).wait_protected()
        # Timed to "reusable" only: the commit (a checksum on the CPU) follows the copy.
        # Each timed save starts once the last is committed; that wait is reported apart.
        times, drains = [], []
        for version in range(2, 2 + repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = engine.save(state, version)
            handle.wait_reusable()
            t1 = time.perf_counter()
            handle.wait_protected()
            times.append(t1 - t0)
            drains.append(time.perf_counter() - t1)
        slot_s = statistics.median(times)
        engine.close(job_finished=True)
    finally:
        jobs.clean(shm_dir, job)

    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    pageable = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}

    def copy(into: dict, non_blocking: bool) -> None:
        for k, v in state.items():
            into[k].copy_(v, non_blocking=non_blocking)
        torch.cuda.synchronize()

    copy(pinned, True)
    copy(pageable, False)  # first touch of both
    pinned_s = _median_s(lambda: copy(pinned, True), repeat)
    pageable_s = _median_s(lambda: copy(pageable, False), repeat)
    result = {"d2h_slot_gbps": nbytes / slot_s / 1e9, "d2h_pinned_gbps": nbytes / pinned_s / 1e9,
              "d2h_pageable_gbps": nbytes / pageable_s / 1e9, "commit_drain_s": statistics.median(drains)}
    result["d2h_slot_vs_pinned_x"] = result["d2h_slot_gbps"] / result["d2h_pinned_gbps"]
    print(f"{torch.cuda.get_device_name()}: {nbytes / 2**20:.0f} MiB in {TENSORS} CUDA tensors, medians of {repeat}")
    print(f"  ftmem save into pinned shared memory, call to reusable  {result['d2h_slot_gbps']:7.2f} GB/s")
    print(f"  plain pinned cudaMemcpyAsync of the same bytes          {result['d2h_pinned_gbps']:7.2f} GB/s")
    print(f"  pageable copy of the same bytes                         {result['d2h_pageable_gbps']:7.2f} GB/s")
    print(f"  (untimed: after each timed save, its commit, a CPU checksum, took {result['commit_drain_s']:.3f} s "
          f"before the next save)")
    print(f"ftmem at {result['d2h_slot_vs_pinned_x']:.2f}x the pinned copy (target >= 0.8x)")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    parser = Parser(prog="ftmem bench d2h", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mb", type=positive_int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed saves (default 5)")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    bench_d2h(args.mb, args.repeat, args.shm_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
