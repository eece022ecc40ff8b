"""``ftmem bench soak``: a long run with a save every iteration, watching for leaks. Three
ranks on three virtual nodes (k=2, m=1, DP-sharded) train a small MLP for ``--iters``
iterations; after warm-up and at a few points up to the end each rank samples itself and
its node's SMP: resident memory, threads, open fds and socket fds, and the node's shared
memory. Flat means no growth. At the end every rank closes with ``job_finished``, and the
job's shared memory and SMPs must be gone.

Figures: the growth from the first sample to the last; RSS growth is the largest of the
ranks' (of the SMPs'), the counts are summed over the six processes, shared memory over the
three nodes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ftmem._shm import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem._common.identity import job_root
from ftmem._shm.procs import pid_alive

from examples.launch import report_figures, run_for_figures

WORLD = 3
WARMUP = 20
WIDTH = 256  # input and output width of the MLP


# -- what one process holds, from /proc ---------------------------------------------------
def process_sample(pid: int) -> dict:
    """RSS (and its anonymous and shared-memory parts) in bytes, threads, fds, socket fds."""
    rss = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                rss[key] = int(value.split()[0]) * 1024
    fd_dir = f"/proc/{pid}/fd"
    fds = sockets = 0
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor, in this process)
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return {"rss": rss.get("VmRSS", 0), "anon": rss.get("RssAnon", 0), "shmem": rss.get("RssShmem", 0),
            "threads": len(os.listdir(f"/proc/{pid}/task")), "fds": fds, "sockets": sockets}


def shm_bytes(path: str) -> int:
    """Bytes of memory the files under ``path`` occupy (allocated blocks, not apparent sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


# -- one rank (python -m benchmarks.bench_soak, started by run_for_figures) -----------------
def soak_worker(argv=None) -> None:
    import torch
    import torch.distributed as dist

    from ftmem import SnapshotEngine
    from ftmem._shm.smp_client import running_smp

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--mb", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--shm-dir", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = SnapshotEngine({"shm_dir": args.shm_dir, "ranks_per_node": 1, "ec": {"k": 2, "m": 1}})

    # Parameters plus AdamW's two moments: 12 bytes per parameter, 2 * WIDTH * hidden of them.
    hidden = max(1, (args.mb << 20) // 12 // (2 * WIDTH))
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, WIDTH))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(7 + rank)

    warm = min(WARMUP, args.iters - 1)
    points = sorted({warm + round(i * (args.iters - 1 - warm) / max(1, args.samples - 1))
                     for i in range(args.samples)})
    samples, sampling_s, t_warm = [], 0.0, None
    handle = None
    for it in range(args.iters):
        g = torch.Generator().manual_seed(it * 1000 + rank)
        x, y = torch.randn(32, WIDTH, generator=g), torch.randn(32, WIDTH, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if handle is not None:
            handle.wait_reusable()  # the step overwrites what the last save copies
        optim.step()
        optim.zero_grad()
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "iteration": it}
        handle = engine.save(state, it, replicated=lambda t: True)
        if it in points:
            t0 = time.perf_counter()
            engine.wait_protected()  # the version is committed and protected everywhere: nothing in flight
            dist.barrier()
            node_dir = engine.identity.node_dir
            smp = running_smp(node_dir)
            mine = {"it": it, "rank": process_sample(os.getpid()), "smp_pid": smp,
                    "smp": process_sample(smp) if smp else None, "shm": shm_bytes(node_dir)}
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if rank == 0:
                samples.append(gathered)
            dist.barrier()
            if it == warm:
                t_warm = time.perf_counter()
            else:
                sampling_s += time.perf_counter() - t0
    t_end = time.perf_counter()
    state_mb = sum(t.numel() * t.element_size() for t in model.parameters()) * 3 / 2**20
    engine.close(job_finished=True)
    dist.destroy_process_group()
    if rank == 0:
        timed = args.iters - 1 - warm
        report_figures({"samples": samples, "state_mb": state_mb, "hidden": hidden,
                        "seconds_per_iter": (t_end - t_warm - sampling_s) / timed if timed else 0.0})


# -- the benchmark -------------------------------------------------------------------------
ROWS = (  # (label, the values of one sample point, their format)
    ("rank RSS, MiB (each)", lambda s: [r["rank"]["rss"] / 2**20 for r in s], "{:.1f}"),
    ("rank anon RSS, MiB (each)", lambda s: [r["rank"]["anon"] / 2**20 for r in s], "{:.1f}"),
    ("SMP RSS, MiB (each)", lambda s: [r["smp"]["rss"] / 2**20 for r in s], "{:.1f}"),
    ("/dev/shm of the job, MiB", lambda s: [sum(r["shm"] for r in s) / 2**20], "{:.2f}"),
    ("threads (ranks + SMPs)", lambda s: [sum(r["rank"]["threads"] for r in s),
                                          sum(r["smp"]["threads"] for r in s)], "{:.0f}"),
    ("open fds (ranks + SMPs)", lambda s: [sum(r["rank"]["fds"] for r in s), sum(r["smp"]["fds"] for r in s)],
     "{:.0f}"),
    ("socket fds (ranks + SMPs)", lambda s: [sum(r["rank"]["sockets"] for r in s),
                                             sum(r["smp"]["sockets"] for r in s)], "{:.0f}"),
)


def _cell(values: list, fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in values)


def print_table(samples: list) -> None:
    """One row per figure, one column per sample point, and the growth (last - first)."""
    heads = [f"it {s[0]['it']}" for s in samples] + ["growth"]
    rows = []
    for label, values, fmt in ROWS:
        first, last = values(samples[0]), values(samples[-1])
        growth = [b - a for a, b in zip(first, last)]
        rows.append([label] + [_cell(values(s), fmt) for s in samples] + [_cell(growth, "{:+" + fmt[2:])])
    widths = [max(len(r[i]) for r in rows + [[""] + heads]) for i in range(len(heads) + 1)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip([""] + heads, widths))))
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def bench_soak(iters: int = 1000, mb: int = 8, n_samples: int = 6, shm_dir: str = "/dev/shm") -> dict:
    job = f"bench-soak-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="ftmem-bench-soak-") as logs:
            figures = run_for_figures("benchmarks.bench_soak", ["--iters", str(iters), "--mb", str(mb), "--samples",
                                                                str(n_samples), "--shm-dir", shm_dir],
                                      WORLD, job, logs, "soak", 120 + 5 * iters)
        wall_s = time.perf_counter() - t0
        samples = figures["samples"]
        smp_pids = {r["smp_pid"] for s in samples for r in s if r["smp_pid"]}
        deadline = time.monotonic() + 10  # the SMPs exit once their node is freed
        while any(pid_alive(p) for p in smp_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        smp_left = sorted(p for p in smp_pids if pid_alive(p))
        job_left = job in jobs.list_jobs(shm_dir)
        shm_left = shm_bytes(job_root(shm_dir, job)) if job_left else 0
    finally:
        jobs.clean(shm_dir, job)  # whatever the run left (nothing, if it freed its memory)

    print(f"{WORLD} ranks on {WORLD} virtual nodes (k=2, m=1, DP-sharded), {figures['state_mb']:.1f} MiB of "
          f"parameters and AdamW state per rank, a save every iteration, {iters} iterations in {wall_s:.0f} s "
          f"({figures['seconds_per_iter'] * 1e3:.0f} ms per iteration after warm-up; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print_table(samples)
    first, last = samples[0], samples[-1]

    def growth(fn) -> float:
        return fn(last) - fn(first)

    result = {
        "iters": iters,
        "rank_rss_growth_mb": max(b["rank"]["rss"] - a["rank"]["rss"] for a, b in zip(first, last)) / 2**20,
        "smp_rss_growth_mb": max(b["smp"]["rss"] - a["smp"]["rss"] for a, b in zip(first, last)) / 2**20,
        "shm_growth_mb": growth(lambda s: sum(r["shm"] for r in s)) / 2**20,
        "thread_growth": growth(lambda s: sum(r["rank"]["threads"] + r["smp"]["threads"] for r in s)),
        "fd_growth": growth(lambda s: sum(r["rank"]["fds"] + r["smp"]["fds"] for r in s)),
        "socket_growth": growth(lambda s: sum(r["rank"]["sockets"] + r["smp"]["sockets"] for r in s)),
        "seconds_per_iter_s": figures["seconds_per_iter"],
        "smp_left": len(smp_left),
        "shm_left_mb": shm_left / 2**20,
    }
    freed = not smp_left and not job_left
    print(f"at the end: job memory {'freed' if freed else 'NOT freed'}"
          + (f" (SMPs still running: {smp_left}; {job} still in {shm_dir}: {job_left})" if not freed else
             f", no SMP left"))
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    result["freed"] = freed
    return result


def main(argv=None) -> int:
    """``ftmem bench soak``. (Run as ``python -m benchmarks.bench_soak`` this module is one
    rank of the soak, started by :func:`bench_soak`.)"""
    parser = Parser(prog="ftmem bench soak", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--iters", type=positive_int, default=1000, help="iterations, a save each (default 1000)")
    parser.add_argument("--mb", type=positive_int, default=8,
                        help="MiB of parameters and AdamW state per rank (default 8)")
    parser.add_argument("--samples", type=positive_int, default=6,
                        help=f"sample points, from iteration {WARMUP} (after warm-up) to the last (default 6)")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    if args.iters < 2:
        parser.error("--iters must be at least 2 (a first and a last sample)")
    result = bench_soak(iters=args.iters, mb=args.mb, n_samples=max(2, args.samples), shm_dir=args.shm_dir)
    return 0 if result["freed"] else 1


if __name__ == "__main__":
    soak_worker()
