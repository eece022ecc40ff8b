"""``ftmem bench save``: what an ftmem save costs the training loop, against
``torch.save`` to a file and against a plain memory copy of the same bytes, all
measured in one run on the same state."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from ftmem import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem.engine import SnapshotEngine


def model_like_state(total_mb: int) -> dict:
    """fp32 parameters with Adam's two moments, in a mix of large and small tensors."""
    per_copy = total_mb * (1 << 20) // 3 // 4  # floats per copy (params, exp_avg, exp_avg_sq)
    shapes, left = [], per_copy
    while left > 0:
        n = min(left, 8 << 20)
        shapes += [(n,), (min(left, 4096),)]
        left -= n + min(left, 4096)
    gen = torch.Generator().manual_seed(0)

    def group() -> list[torch.Tensor]:
        return [torch.randn(s, generator=gen) for s in shapes]

    return {"params": group(), "optim": {"exp_avg": group(), "exp_avg_sq": group()}, "step": 10}


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_save(total_mb: int = 500, repeat: int = 5, shm_dir: str = "/dev/shm") -> dict:
    state = model_like_state(total_mb)
    tensors = state["params"] + state["optim"]["exp_avg"] + state["optim"]["exp_avg_sq"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"state: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB; torch threads: {torch.get_num_threads()}")
    job = f"bench-{os.getpid()}"
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)
    try:
        for version in range(2):  # first use of both slots: allocation and page mapping
            engine.save(state, version).wait_reusable()
        save_s, reusable_s = [], []
        for version in range(2, 2 + repeat):
            # In training the copy thread checksums and commits a version during the next
            # forward/backward; here nothing else runs, so let it finish rather than compete.
            engine.wait()
            t0 = time.perf_counter()
            handle = engine.save(state, version)
            t1 = time.perf_counter()
            handle.wait_reusable()
            t2 = time.perf_counter()
            save_s.append(t1 - t0)
            reusable_s.append(t2 - t0)
        engine.close(job_finished=True)
    finally:
        jobs.clean(shm_dir, job)

    copies = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for dst, src in zip(copies, tensors):
            dst.copy_(src)

    memcpy()  # map the destination pages first, as the engine's slots are after warm-up
    memcpy_s = _median_time(memcpy, repeat)
    del copies

    path = os.path.abspath(f"ftmem_bench_{os.getpid()}.pt")
    try:
        torch_save_s = _median_time(lambda: torch.save(state, path), max(2, repeat // 2))
    finally:
        os.unlink(path)

    result = {
        "save_s": statistics.median(save_s),
        "reusable_s": statistics.median(reusable_s),
        "torch_save_s": torch_save_s,
        "memcpy_s": memcpy_s,
    }
    result["vs_torch_save_x"] = result["torch_save_s"] / result["save_s"]
    result["vs_memcpy_x"] = result["reusable_s"] / result["memcpy_s"]
    print(f"ftmem save blocks the caller      {result['save_s'] * 1e3:9.2f} ms (median of {repeat})")
    print(f"source reusable after             {result['reusable_s'] * 1e3:9.2f} ms")
    print(f"plain memory copy of same bytes   {result['memcpy_s'] * 1e3:9.2f} ms")
    print(f"torch.save to {os.path.dirname(path)}  {result['torch_save_s'] * 1e3:9.2f} ms")
    print(f"save blocks {result['vs_torch_save_x']:.0f}x less than torch.save (target >= 10x); "
          f"reusable at {result['vs_memcpy_x']:.2f}x the memory copy (target <= 1.5x)")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    parser = Parser(prog="ftmem bench save", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mb", type=positive_int, default=None, help="state size in MiB (default 500)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed saves (default 5)")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    bench_save(total_mb=args.mb or 500, repeat=args.repeat, shm_dir=args.shm_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
