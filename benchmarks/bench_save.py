"""``ftmem bench save``: what an ftmem save costs the training loop, against
``torch.save`` to a file and against a plain memory copy of the same bytes, all
measured in one run on the same state.

The saves run in a steady loop, one after every step, and nothing is drained outside
a timer: the cycle cost is a step with a save minus a step without, the two taking
turns in the same run, and a block of steps with saves ends when its last snapshot is
protected. One rank, one node: "protected" means committed (there is no parity)."""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import torch

from ftmem._shm import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem import SnapshotEngine


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


COMPUTE_MATMULS = 40  # the forward/backward stand-in: matmuls that leave the state alone


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Timeline:
    """When each save's snapshot became reusable and protected, seen from a watcher
    thread (which waits, so that the training loop does not)."""

    def __init__(self):
        self.reusable_s, self.protected_s, self._threads = [], [], []

    def watch(self, handle, started: float) -> None:
        def wait() -> None:
            handle.wait_reusable()
            self.reusable_s.append(time.perf_counter() - started)
            handle.wait_protected()
            self.protected_s.append(time.perf_counter() - started)

        self._threads.append(threading.Thread(target=wait, daemon=True))
        self._threads[-1].start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()


def steady_loop(engine: SnapshotEngine, state: dict, tensors: list, repeat: int, blocks: int) -> dict:
    """A training loop's shape: compute that reads nothing of the state, then an in-place
    update of every state tensor (which first waits until the last snapshot's copy is
    done, as the adapters make the optimizer step wait). Blocks of ``repeat`` steps with
    a save after every step take turns with blocks without saves; a block with saves
    ends when its last snapshot is protected, so all the saves' work is billed to it."""
    work = torch.randn(384, 384)
    save_call_s, per_step = [], {"saves": [], "no saves": []}
    timeline, handle, version = _Timeline(), None, 0

    def step(save: bool) -> None:
        nonlocal handle, version
        for _ in range(COMPUTE_MATMULS):
            work @ work
        if handle is not None:
            handle.wait_reusable()
        for t in tensors:
            t.mul_(0.999)
        if save:
            t0 = time.perf_counter()
            handle = engine.save(state, version)
            save_call_s.append(time.perf_counter() - t0)
            timeline.watch(handle, t0)
            version += 1

    for warm_up in range(2):  # first use of both slots: allocation and page mapping
        step(save=True)
    handle.wait_protected()
    for block in range(blocks):
        for kind in ("no saves", "saves"):
            t0 = time.perf_counter()
            for _ in range(repeat):
                step(save=kind == "saves")
            if kind == "saves":
                handle.wait_protected()
                handle = None
            per_step[kind].append((time.perf_counter() - t0) / repeat)
    timeline.join()
    step_s, cycle_s = statistics.median(per_step["no saves"]), statistics.median(per_step["saves"])
    return {"save_s": statistics.median(save_call_s[2:]), "reusable_s": statistics.median(timeline.reusable_s[2:]),
            "protected_s": statistics.median(timeline.protected_s[2:]), "step_s": step_s, "cycle_s": cycle_s,
            "cycle_cost_s": cycle_s - step_s}


def bench_save(total_mb: int = 500, repeat: int = 5, shm_dir: str = "/dev/shm", blocks: int = 3) -> dict:
    state = model_like_state(total_mb)
    tensors = state["params"] + state["optim"]["exp_avg"] + state["optim"]["exp_avg_sq"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"state: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB; torch threads: {torch.get_num_threads()}")
    job = f"bench-{os.getpid()}"
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)
    try:
        loop = steady_loop(engine, state, tensors, repeat, blocks)
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

    result = {**loop, "torch_save_s": torch_save_s, "memcpy_s": memcpy_s}
    result["vs_torch_save_x"] = result["torch_save_s"] / result["save_s"]
    result["vs_memcpy_x"] = result["reusable_s"] / result["memcpy_s"]
    result["cycle_cost_vs_torch_save_x"] = result["cycle_cost_s"] / result["torch_save_s"]
    print(f"a step (compute, then an in-place update of the state)  {result['step_s'] * 1e3:9.2f} ms without saves")
    print(f"the same step with a save after it                      {result['cycle_s'] * 1e3:9.2f} ms "
          f"(cycle cost {result['cycle_cost_s'] * 1e3:+.2f} ms: every wait billed, medians of {blocks} "
          f"blocks of {repeat} steps)")
    print(f"the save call blocks                                    {result['save_s'] * 1e3:9.2f} ms")
    print(f"snapshot reusable after / protected after               {result['reusable_s'] * 1e3:9.2f} ms / "
          f"{result['protected_s'] * 1e3:.2f} ms")
    print(f"plain memory copy of the same bytes                     {result['memcpy_s'] * 1e3:9.2f} ms")
    print(f"torch.save to {os.path.dirname(path)}  {result['torch_save_s'] * 1e3:9.2f} ms")
    print(f"save blocks {result['vs_torch_save_x']:.0f}x less than torch.save (target >= 10x); "
          f"reusable at {result['vs_memcpy_x']:.2f}x the memory copy (target <= 1.5x); "
          f"a save costs a step {result['cycle_cost_vs_torch_save_x']:.2f}x torch.save")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    parser = Parser(prog="ftmem bench save", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mb", type=positive_int, default=None, help="state size in MiB (default 500)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="steps per block (default 5)")
    parser.add_argument("--blocks", type=positive_int, default=3,
                        help="blocks of each kind, with and without saves, taking turns (default 3)")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    bench_save(total_mb=args.mb or 500, repeat=args.repeat, shm_dir=args.shm_dir, blocks=args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
