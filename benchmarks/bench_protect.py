"""``ftmem bench protect``: how fast a snapshot becomes protected, per node, as the job
grows: N virtual nodes (one rank each, one EC group of k = N - m), a fixed state per
node, a save every round. Beside it, measured in the same run on the same ranks: the
raw gloo ``all_to_all_single`` bandwidth and a memory copy's.

Per-node GB/s is the node's state bytes over the time from the save call to
"protected" (every rank committed and its parity placed). The all_to_all figure is the
bytes a rank sends to the others over the time of one exchange. Nothing is drained
outside the timers: each round starts after a barrier, once the previous one is
protected (which is what the timer measured).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ftmem._shm import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem import SnapshotEngine

from examples.launch import report_figures, run_for_figures

NODES = (2, 3, 4, 6, 8)
PARITIES = (1, 2)
MB_PER_NODE = 256
REPEAT = 3


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(argv=None) -> None:
    """One rank of one (N, m) case, started by :func:`protect_case`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, required=True)
    parser.add_argument("--m", type=int, required=True)
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--repeat", type=int, required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    nodes = dist.get_world_size()
    engine = SnapshotEngine({"shm_dir": args.shm_dir, "ranks_per_node": 1, "ec": {"k": nodes - args.m, "m": args.m}})
    nbytes = args.mb << 20
    torch.manual_seed(engine.rank)
    state = {"weights": [torch.randn(nbytes // 4 // 4) for _ in range(4)]}  # unique to each node

    copy_s, protect_s = [], []
    for version in range(1 + args.repeat):  # version 0 allocates and maps the slots
        handle = None

        def save() -> None:
            nonlocal handle
            handle = engine.save(state, version)
            handle.wait_reusable()

        copied = _timed(save)
        t0 = time.perf_counter()
        handle.wait_protected()
        if version:
            copy_s.append(copied)
            protect_s.append(copied + time.perf_counter() - t0)
    engine.close(job_finished=True)

    # The transport alone: each rank sends its state's bytes, split evenly, to the others.
    send = torch.empty(nbytes // nodes * nodes, dtype=torch.uint8)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send)  # warm: connections, pages
    alltoall_s = [_timed(lambda: dist.all_to_all_single(receive, send)) for _ in range(args.repeat)]
    sent = send.numel() * (nodes - 1) // nodes

    source, target = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    target.copy_(source)  # map the destination first
    memcpy_s = [_timed(lambda: target.copy_(source)) for _ in range(args.repeat)]

    # The job is protected when its slowest rank is: each round's worst rank counts.
    worst = [max(times) for times in zip(*_gathered(protect_s))]
    if engine.rank == 0:
        report_figures({"protect_s": statistics.median(worst), "copy_s": statistics.median(copy_s),
                        "nbytes": nbytes, "alltoall_gbps": sent / statistics.median(alltoall_s) / 1e9,
                        "memcpy_gbps": nbytes / statistics.median(memcpy_s) / 1e9})
    dist.destroy_process_group()


def _gathered(obj) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def protect_case(nodes: int, m: int, mb: int, repeat: int, shm_dir: str) -> dict:
    job = f"bench-protect-{os.getpid()}-{nodes}-{m}"
    try:
        with tempfile.TemporaryDirectory(prefix="ftmem-bench-protect-") as logs:
            return run_for_figures("benchmarks.bench_protect", ["--worker", "--mb", str(mb), "--m", str(m),
                                                                "--shm-dir", shm_dir, "--repeat", str(repeat)],
                                   nodes, job, logs, f"protect ({nodes} nodes, m={m})", 1800)
    finally:
        jobs.clean(shm_dir, job)


def bench_protect(nodes=NODES, parities=PARITIES, mb: int = MB_PER_NODE, repeat: int = REPEAT,
                  shm_dir: str = "/dev/shm", plot: str = None) -> dict:
    result, rows = {}, []
    print(f"{mb} MiB per node, one rank per virtual node, one EC group of k = N - m; medians of {repeat} rounds "
          f"(the slowest rank's time in each); cores: {os.cpu_count()}")
    print(f"{'N':>3} {'m':>2} {'k':>2}  {'save->protected':>16} {'per node':>10} {'all_to_all':>11} "
          f"{'memcpy':>9}  {'protect/all_to_all':>18}")
    for m in parities:
        for n in nodes:
            if n - m < 1:
                continue
            f = protect_case(n, m, mb, repeat, shm_dir)
            gbps = f["nbytes"] / f["protect_s"] / 1e9
            key = f"n{n}_m{m}"
            result.update({f"protect_{key}_s": f["protect_s"], f"protect_{key}_gbps": gbps,
                           f"copy_{key}_s": f["copy_s"], f"alltoall_{key}_gbps": f["alltoall_gbps"],
                           f"memcpy_{key}_gbps": f["memcpy_gbps"],
                           f"protect_vs_alltoall_{key}_x": gbps / f["alltoall_gbps"]})
            rows.append((n, m, gbps, f["alltoall_gbps"], f["memcpy_gbps"]))
            print(f"{n:3d} {m:2d} {n - m:2d}  {f['protect_s']:14.3f} s {gbps:6.2f} GB/s {f['alltoall_gbps']:6.2f} GB/s "
                  f"{f['memcpy_gbps']:5.2f} GB/s  {gbps / f['alltoall_gbps']:17.2f}x")
    for m in parities:
        times = [result[f"protect_n{n}_m{m}_s"] for n in nodes if f"protect_n{n}_m{m}_s" in result]
        if len(times) > 1:
            result[f"protect_growth_m{m}_x"] = times[-1] / times[0]
            print(f"m={m}: per-node time at the largest N is {times[-1] / times[0]:.2f}x that at the smallest "
                  f"(flat = 1)")
    if plot:
        plot_protect(rows, mb, plot)
        print(f"plot: {plot}")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))  # the last line, as every benchmark's
    return result


def plot_protect(rows: list, mb: int, path: str) -> None:
    from benchmarks.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4))
    for m in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == m]
        ax.plot([r[0] for r in mine], [r[2] for r in mine], "o-", label=f"save -> protected, m={m}")
        ax.plot([r[0] for r in mine], [r[3] for r in mine], "x--", label=f"gloo all_to_all, m={m}'s run")
        ax.plot([r[0] for r in mine], [r[4] for r in mine], ".:", color="grey",
                label="memory copy, each run" if m == rows[0][1] else None)
    ax.set_xlabel("virtual nodes N (one EC group, k = N - m)")
    ax.set_ylabel(f"GB/s per node ({mb} MiB per node)")
    ax.set_yscale("log")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _int_list(text: str) -> tuple:
    return tuple(positive_int(part) for part in text.split(","))


def main(argv=None) -> int:
    """``ftmem bench protect``; with ``--worker``, one of a case's ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        argv.remove("--worker")
        worker(argv)
        return 0
    parser = Parser(prog="ftmem bench protect", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--nodes", type=_int_list, default=NODES, help="virtual node counts (default 2,3,4,6,8)")
    parser.add_argument("--m", type=_int_list, default=PARITIES, help="parity counts (default 1,2)")
    parser.add_argument("--mb", type=positive_int, default=MB_PER_NODE, help="state per node in MiB (default 256)")
    parser.add_argument("--repeat", type=positive_int, default=REPEAT, help="timed rounds (default 3)")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures (needs matplotlib)")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    bench_protect(args.nodes, args.m, args.mb, args.repeat, args.shm_dir, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
