"""``ftmem bench megatron`` (or ``python -m benchmarks.bench_megatron``): an ftmem
in-memory save against Megatron-LM's ``--ckpt-format torch`` save (torch.save to disk)
on the same megatron-core GPT and parallel layout in one run — what ``save_checkpoint``
blocks and what ``load_checkpoint`` takes into a freshly built model and optimizer — and
a persistent save written from memory (:mod:`ftmem_megatron.format`): what its call
blocks against the in-memory save's, and its background write against the torch save of
the same files.

Run without ``--worker`` it starts the ranks (run_for_figures), each running :func:`worker`;
rank 0 prints the figures, and this process prints them and a ``RESULT`` line.

The model and optimizer come from the driver's building blocks
(:mod:`examples.megatron.pretrain_gpt`). Each save follows a training iteration; the
kinds take turns (a persistent save after one iteration, the in-memory and the torch
save after the next), so load from outside the benchmark hits them alike. Before each
timed ftmem save the previous snapshot is waited for (protected), and before each
persistent one the previous flush, so the figure is what the call itself blocks;
before each torch save too, so ftmem's background work is not billed to torch.save.
The first save of each kind allocates (shared memory, files) and is left out; the
figure is the median of the rest. Every time is the maximum over the ranks. torch.save
writes into the page cache (no fsync), as Megatron-LM's does; the flush writes the
same files with torch.save, so the two differ by the page cache's state, not the work.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time

from ftmem._shm import jobs

from benchmarks import restore_breakdown
from examples.launch import report_figures, run_for_figures
from examples.process_end import end_process

WORLD = 2
# ~53M parameters (the embedding is 24.6M of them), ~26M per rank at TP 2.
CYCLE_BLOCK = 3  # iterations per block of the cycle-cost measurement
MODEL = {"num_layers": 4, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 128, "vocab_size": 32000}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128}
TARGET_X = 20.0


def model_flags(shape: dict) -> list[str]:
    """The driver's flags for a GPT of ``shape`` (MODEL's keys)."""
    return [
        "--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
        "--num-attention-heads", str(shape["num_attention_heads"]), "--seq-length", str(shape["seq_length"]),
        "--max-position-embeddings", str(shape["seq_length"]), "--vocab-size", str(shape["vocab_size"]),
    ]


def print_result(result: dict) -> None:
    """The benchmark's last line, ``RESULT key=value ...``, with counts as integers."""
    print("RESULT " + " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.6g}" for k, v in result.items()))


def driver_argv(shape: dict, tp: int, ftmem_dir: str, shm_dir: str, job: str) -> list[str]:
    """The driver's flags for the model, with in-memory checkpoints through ftmem."""
    return [
        *model_flags(shape),
        "--tensor-model-parallel-size", str(tp), "--micro-batch-size", "1", "--global-batch-size",
        str(WORLD // tp), "--train-iters", "1000", "--lr", "1e-4", "--mock-data",
        "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
        "--save", ftmem_dir, "--load", ftmem_dir, "--save-interval", "1000",
        "--ftmem-shm-dir", shm_dir, "--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1",
        "--ftmem-job-id", job,
    ]


def worker(argv=None) -> None:
    import torch
    from megatron.core import parallel_state

    from examples.megatron import torch_checkpoint
    from ftmem_megatron import checkpointing

    from examples.megatron.pretrain_gpt import (build_model, build_optimizer, initialize, parse_args, state_digest,
                                                train_step, transformer_config)

    parser = argparse.ArgumentParser(allow_abbrev=False)  # not --saves for the driver's --save
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--work", required=True)
    parser.add_argument("--saves", type=int, required=True)
    parser.add_argument("--restore", choices=("ftmem", "torch"), default=None)
    mine, driver = parser.parse_known_args(argv)
    args = parse_args(driver)
    initialize(args)
    if mine.restore:
        restore_worker(args, mine)
        return
    rank = args.rank
    # The persistent baseline in a directory of its own: ftmem's load restores from
    # memory only when memory holds a newer iteration than --load's disk does.
    torch_args = copy.copy(args)
    torch_args.save = torch_args.load = os.path.join(mine.work, "torch")
    figures: dict = {}

    def build():
        config = transformer_config(args)
        model = build_model(args, config)
        optimizer, scheduler = build_optimizer(args, model, config)
        for chunk in model:
            chunk.train()
        return model, optimizer, scheduler

    def timed(fn) -> float:
        """Seconds ``fn`` takes, from a barrier; the maximum over the ranks."""
        torch.distributed.barrier()
        t0 = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
        return took.item()

    model, optimizer, scheduler = build()
    # Parameters split across TP ranks counted on each, the replicated ones on TP rank 0.
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counted = torch.tensor([sum(p.numel() for chunk in model for p in chunk.module.parameters()
                                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)])
    torch.distributed.all_reduce(counted)
    figures["params"] = counted.item() // args.data_parallel_size
    saves = {"ftmem": [], "torch": [], "persist": []}
    # The save kinds take turns, and each starts with the last snapshot protected (and
    # flushed), so that none is billed another's background work. Those drains are
    # timed and reported; the cycle cost below bills every wait.
    drains = []
    flushes = []  # (bytes written by all ranks, seconds of the slowest rank)
    iteration = 0
    for _ in range(mine.saves + 1):  # + 1: the warm-up saves
        # A persistent save after one iteration, then the in-memory and torch saves after
        # the next: each ftmem save is of a new iteration, as in training.
        iteration += 1
        train_step(args, iteration, model, optimizer, scheduler)
        drains.append(timed(checkpointing.wait_protected))
        saves["persist"].append(timed(lambda: checkpointing.save_checkpoint(
            iteration, model, optimizer, scheduler, 0.0, args, persistent=True)))
        drains.append(timed(checkpointing.wait_flushed))
        written, seconds, _ = checkpointing.last_flush()
        flush = torch.tensor([written, seconds], dtype=torch.float64)
        torch.distributed.all_reduce(flush[:1])
        torch.distributed.all_reduce(flush[1:], op=torch.distributed.ReduceOp.MAX)
        flushes.append(tuple(flush.tolist()))
        iteration += 1
        train_step(args, iteration, model, optimizer, scheduler)
        drains.append(timed(checkpointing.wait_protected))
        saves["ftmem"].append(timed(lambda: checkpointing.save_checkpoint(
            iteration, model, optimizer, scheduler, 0.0, args)))
        drains.append(timed(checkpointing.wait_protected))
        saves["torch"].append(timed(lambda: torch_checkpoint.save_checkpoint(
            iteration, model, optimizer, scheduler, 0.0, torch_args)))
        if rank == 0 and iteration > 2:  # keep one checkpoint of each on disk
            shutil.rmtree(torch_checkpoint.iteration_dir(torch_args.save, iteration - 2))
            shutil.rmtree(torch_checkpoint.iteration_dir(args.save, iteration - 3))
        if rank == 0:
            print(f"iterations {iteration - 1}, {iteration}: persistent ftmem save blocked {saves['persist'][-1]:.4f} s "
                  f"and wrote {flushes[-1][0] / 2**20:.1f} MiB in {flushes[-1][1]:.3f} s in the background; ftmem "
                  f"save blocked {saves['ftmem'][-1]:.4f} s, torch save {saves['torch'][-1]:.3f} s", flush=True)
    for name, times in saves.items():
        figures[f"{name}_save_s"] = statistics.median(times[1:])
        figures[f"{name}_first_save_s"] = times[0]
        figures[f"{name}_saves_s"] = times
    figures["flush_bytes"] = flushes[-1][0]
    figures["flush_s"] = statistics.median(seconds for _, seconds in flushes[1:])
    figures["drains_s"] = sum(drains[4:])  # past the warm-up round

    # The cycle cost: blocks of iterations with an in-memory save after each take turns
    # with blocks without saves; a block with saves ends when its last snapshot is
    # protected, inside its timer.
    per_iteration = {"save": [], "nosave": []}
    for block in range(1 + mine.saves):  # block 0 warms up
        for kind in ("nosave", "save"):
            def block_of_iterations():
                nonlocal iteration
                for _ in range(CYCLE_BLOCK):
                    iteration += 1
                    train_step(args, iteration, model, optimizer, scheduler)
                    if kind == "save":
                        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0.0, args)
                if kind == "save":
                    checkpointing.wait_protected()

            took = timed(block_of_iterations)
            if block:
                per_iteration[kind].append(took / CYCLE_BLOCK)
    figures["step_s"] = statistics.median(per_iteration["nosave"])
    figures["cycle_s"] = statistics.median(per_iteration["save"])
    # What the restores load, each in freshly started ranks (restore_worker): the newest
    # in-memory version, and a torch checkpoint of it (untimed: the save figures above are taken).
    torch_checkpoint.save_checkpoint(iteration, model, optimizer, scheduler, 0.0, torch_args)
    with open(os.path.join(mine.work, f"digest.rank{rank}"), "w") as f:
        f.write(f"{iteration} {state_digest(model, optimizer)}")
    checkpointing.wait_protected()
    checkpointing.close(job_finished=False)  # the snapshots stay, as after a crash
    if rank == 0:
        report_figures(figures)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def restore_worker(args, mine) -> None:
    """A restarted rank: a fresh process builds the model and optimizer and loads what the
    training ranks left (``mine.restore``: ftmem's newest in-memory version, or the torch
    checkpoint of the same iteration), timed; the state is checked against the saved one.
    Each kind runs in processes of its own, so that neither reuses memory the other paged in."""
    import torch

    from examples.megatron import torch_checkpoint
    from ftmem_megatron import checkpointing

    from examples.megatron.pretrain_gpt import build_model, build_optimizer, state_digest, transformer_config

    config = transformer_config(args)
    model = build_model(args, config)
    optimizer, scheduler = build_optimizer(args, model, config)
    for chunk in model:
        chunk.train()
    with open(os.path.join(mine.work, f"digest.rank{args.rank}")) as f:
        iteration, digest = f.read().split()
    if mine.restore == "torch":
        args.save = args.load = os.path.join(mine.work, "torch")
    loader = checkpointing.load_checkpoint if mine.restore == "ftmem" else torch_checkpoint.load_checkpoint
    loaded = []
    torch.distributed.barrier()
    t0 = time.perf_counter()
    loaded.append(loader(model, optimizer, scheduler, args))
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
    if not loaded[0] or loaded[0][0] != int(iteration):
        raise RuntimeError(f"the {mine.restore} restore returned {loaded[0]}, not iteration {iteration}")
    same = torch.tensor([int(state_digest(model, optimizer) == digest)])
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    if not same.item():
        raise RuntimeError(f"the {mine.restore} restore does not reproduce the saved parameters and optimizer state")
    figures = {f"{mine.restore}_restore_s": took.item()}
    if mine.restore == "ftmem":
        figures.update(restore_breakdown.figures(checkpointing.last_restore()))
        model = optimizer = scheduler = None
        # Untimed, with the other rank waiting in a barrier: what first-touch page faults cost here.
        torch.distributed.barrier()
        if args.rank == 0:
            figures.update(restore_breakdown.copy_bandwidths())
        torch.distributed.barrier()
        checkpointing.close(job_finished=True)
    if args.rank == 0:
        report_figures(figures)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def bench_megatron(shape: dict = MODEL, tp: int = 2, saves: int = 3, shm_dir: str = "/dev/shm",
                   timeout_s: float = 1800) -> dict:
    work = tempfile.mkdtemp(prefix="ftmem-bench-mg-", dir=os.getcwd())
    job = f"bench-mg-{os.getpid()}"
    argv = ["--worker", "--work", work, "--saves", str(saves),
            *driver_argv(shape, tp, os.path.join(work, "ftmem"), shm_dir, job)]
    started = time.monotonic()
    try:
        f = run_for_figures("benchmarks.bench_megatron", argv, WORLD, job, os.path.join(work, "logs"), "Megatron",
                            timeout_s)
        for kind in ("torch", "ftmem"):  # each restore in ranks started anew, as after a crash
            f.update(run_for_figures("benchmarks.bench_megatron", argv + ["--restore", kind], WORLD, job,
                                     os.path.join(work, f"logs-{kind}"), f"Megatron {kind} restore", timeout_s))
    finally:
        jobs.clean(shm_dir, job)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "ftmem_save_s": f["ftmem_save_s"], "torch_save_s": f["torch_save_s"],
        "save_vs_torch_x": f["torch_save_s"] / f["ftmem_save_s"],
        "ftmem_restore_s": f["ftmem_restore_s"], "torch_restore_s": f["torch_restore_s"],
        "restore_vs_torch_x": f["torch_restore_s"] / f["ftmem_restore_s"],
        "ftmem_first_save_s": f["ftmem_first_save_s"], "torch_first_save_s": f["torch_first_save_s"],
        "persist_save_s": f["persist_save_s"], "persist_vs_memory_save_x": f["persist_save_s"] / f["ftmem_save_s"],
        "flush_s": f["flush_s"], "flush_gbps": f["flush_bytes"] / f["flush_s"] / 1e9,
        "torch_save_gbps": f["flush_bytes"] / f["torch_save_s"] / 1e9,
        "params": f["params"],
        "step_s": f["step_s"], "cycle_s": f["cycle_s"], "cycle_cost_s": f["cycle_s"] - f["step_s"],
        "cycle_cost_vs_torch_save_x": (f["cycle_s"] - f["step_s"]) / f["torch_save_s"],
        "drains_s": f["drains_s"],
        **{key: f[key] for key in restore_breakdown.KEYS},
    }
    print(f"megatron-core GPT of {f['params'] / 1e6:.1f}M parameters ({shape}), TP {tp} on {WORLD} ranks "
          f"(CPU, gloo), Adam; ftmem EC k=1 m=1, one rank per node; times are the max over ranks, "
          f"median of {saves} saves after a warm-up save:")
    print(f"  save_checkpoint blocks   torch (--ckpt-format torch) {result['torch_save_s']:.3f} s   "
          f"ftmem {result['ftmem_save_s']:.4f} s   ({result['save_vs_torch_x']:.0f}x less, "
          f"target >= {TARGET_X:.0f}x: {'met' if result['save_vs_torch_x'] >= TARGET_X else 'NOT met'})")
    print(f"  first save of each kind  torch {result['torch_first_save_s']:.3f} s   "
          f"ftmem {result['ftmem_first_save_s']:.4f} s   persistent {f['persist_saves_s'][0]:.4f} s   "
          f"(the job's first save allocates its shared memory)")
    for name in ("torch", "ftmem", "persist"):
        print(f"  each {name} save (s)     " + " ".join(f"{t:.4f}" for t in f[f"{name}_saves_s"]))
    print(f"  persistent save          blocks {result['persist_save_s']:.4f} s, "
          f"{result['persist_vs_memory_save_x']:.2f}x the in-memory save (target <= 1.05x); written from memory "
          f"in the background in {result['flush_s']:.3f} s ({result['flush_gbps']:.2f} GB/s) against "
          f"torch.save of the same files {result['torch_save_s']:.3f} s ({result['torch_save_gbps']:.2f} GB/s)")
    print(f"  an in-memory save after every iteration: {result['step_s']:.3f} s per iteration without saves, "
          f"{result['cycle_s']:.3f} s with (cycle cost {result['cycle_cost_s']:+.3f} s, "
          f"{result['cycle_cost_vs_torch_save_x']:.2f}x the torch save; every wait billed)")
    print(f"  the timed saves above each started from a protected (and flushed) snapshot: those drains took "
          f"{result['drains_s']:.3f} s in all, outside the save timers")
    print(f"  load_checkpoint          torch {result['torch_restore_s']:.3f} s   "
          f"ftmem {result['ftmem_restore_s']:.3f} s   ({result['restore_vs_torch_x']:.2f}x torch's speed, "
          f"target >= 2x; each in ranks started anew; restored state checked bitwise for both)")
    print(restore_breakdown.describe(result))
    print(f"  wall time {time.monotonic() - started:.0f} s")
    print_result(result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared with ``ftmem bench megatron``), less --shm-dir."""
    parser.add_argument("--tiny", action="store_true", help=f"a tiny GPT ({TINY}), for tests")
    for key, value in MODEL.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {value}")
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2), help="tensor-parallel size (default 2)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves of each kind after the warm-up one")


def run(args) -> int:
    shape = dict(TINY if args.tiny else MODEL)
    shape.update({k: getattr(args, k) for k in MODEL if getattr(args, k) is not None})
    bench_megatron(shape, tp=args.tp, saves=args.saves, shm_dir=args.shm_dir)
    return 0


def main(argv=None) -> int:
    """The benchmark; with ``--worker``, one of its ranks (started by :func:`bench_megatron`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker(argv)
        end_process()  # the framework's gloo groups outlive the worker: see examples/process_end.py
    parser = argparse.ArgumentParser(prog="ftmem bench megatron",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
