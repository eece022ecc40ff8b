"""``ftmem bench overhead`` (or ``python -m benchmarks.bench_overhead``): what a save
after every iteration costs a megatron-core GPT's training loop on one rank: ftmem's
in-memory save against the same loop without saves and against Megatron-LM's
``--ckpt-format torch`` save (torch.save into the page cache), in one run.

Blocks of ``--block`` iterations of the three kinds take turns (no saves, an ftmem save
after each iteration, a torch save after each iteration), ``--rounds`` times after a
warm-up round that is not counted (it allocates and pins the shared memory, and lets
cuBLAS load its kernels). A block is timed from a CUDA synchronize to a CUDA synchronize,
and an ftmem block ends only when its last snapshot is committed: every wait a save
causes (the copy the next optimizer step waits for, the checksum, the commit) is inside
the timer, and nothing is drained outside it. The figure of each kind is the median over
the rounds of the block's time per iteration.

That figure bills each block the wait for its last save's commit (the drain), which a
training run pays once, at its end. So the benchmark also times that drain apart, and
prints the steady state: an ftmem block's time per iteration up to its last iteration's
CUDA synchronize, with the drain left out (and printed beside it).

The default model is a GPT of about 1.1B parameters in bf16 (the ``--bf16`` flag of the
driver), for one GPU; ``--tiny`` is a small fp32 one that runs on the CPU, for tests.
Run without ``--worker`` it starts the rank (run_for_figures), and this process prints
the figures and a ``RESULT`` line.
"""
from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

from ftmem._shm import jobs

from benchmarks.bench_megatron import model_flags, print_result
from examples.launch import report_figures, run_for_figures
from examples.process_end import end_process

# ~1.1B parameters: 20 layers of 12 * 2048^2, and a 32000 x 2048 embedding tied to the output.
MODEL = {"num_layers": 20, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
         "vocab_size": 32000, "micro_batch_size": 2, "global_batch_size": 32}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
        "micro_batch_size": 2, "global_batch_size": 4}
SAVES = ("ftmem", "torch")
KINDS = ("nosave", *SAVES)
TARGET_PCT = 2.0


def driver_argv(shape: dict, bf16: bool, ftmem_dir: str, shm_dir: str, job: str) -> list[str]:
    """The driver's flags: one rank, in-memory checkpoints through ftmem on one node."""
    return [
        *model_flags(shape),
        "--micro-batch-size", str(shape["micro_batch_size"]), "--global-batch-size", str(shape["global_batch_size"]),
        "--train-iters", "100000", "--lr", "1e-4", "--mock-data", *(["--bf16"] if bf16 else []),
        "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
        "--save", ftmem_dir, "--load", ftmem_dir, "--save-interval", "100000",
        "--ftmem-shm-dir", shm_dir, "--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "0",
        "--ftmem-job-id", job,
    ]


def worker(argv=None) -> None:
    import torch

    from examples.megatron import torch_checkpoint
    from ftmem_megatron import checkpointing

    from examples.megatron.pretrain_gpt import (build_model, build_optimizer, initialize, parse_args, train_step,
                                                transformer_config)

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--work", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--block", type=int, required=True)
    parser.add_argument("--kinds", required=True)
    mine, driver = parser.parse_known_args(argv)
    args = parse_args(driver)
    initialize(args)
    config = transformer_config(args)
    model = build_model(args, config)
    optimizer, scheduler = build_optimizer(args, model, config)
    for chunk in model:
        chunk.train()
    torch_args = copy.copy(args)
    torch_args.save = os.path.join(mine.work, "torch")

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    iteration = 0
    save_calls = {"ftmem": [], "torch": []}  # what each save call blocked, past the warm-up round
    handles = []  # of the counted ftmem saves: how long each one's copy and commit took
    steady = []  # of the counted ftmem blocks: seconds per iteration without the final drain
    drains = []  # of the counted ftmem blocks: the wait for the last save's commit

    def block(kind: str, iterations: int, counted: bool) -> float:
        """Seconds per iteration of a block of ``iterations`` of ``kind``, drain included."""
        nonlocal iteration
        synchronize()
        t0 = time.perf_counter()
        for _ in range(iterations):
            iteration += 1
            train_step(args, iteration, model, optimizer, scheduler)
            if kind == "nosave":
                continue
            called = time.perf_counter()
            if kind == "ftmem":
                handle = checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0.0, args)
                if counted:
                    handles.append(handle)
            else:
                torch_checkpoint.save_checkpoint(iteration, model, optimizer, scheduler, 0.0, torch_args)
            if counted:
                save_calls[kind].append(time.perf_counter() - called)
        if kind == "ftmem":
            synchronize()
            looped = time.perf_counter()
            checkpointing.wait_protected()
            if counted:
                steady.append((looped - t0) / iterations)
                drains.append(time.perf_counter() - looped)
        synchronize()
        took = (time.perf_counter() - t0) / iterations
        if kind == "torch":  # keep the newest torch checkpoint only (untimed): a 1.1B one is 15 GB
            newest = torch_checkpoint.iteration_dir(torch_args.save, iteration)
            for old in glob.glob(os.path.join(torch_args.save, "iter_*")):
                if old != newest:
                    shutil.rmtree(old)
        return took

    kinds = mine.kinds.split(",")
    per_iteration = {kind: [] for kind in kinds}
    for round_ in range(1 + mine.rounds):  # round 0 warms up, with two saves at least: one into each slot
        for kind in kinds:
            took = block(kind, mine.block if round_ else max(2, mine.block), counted=round_ > 0)
            if round_:
                per_iteration[kind].append(took)
            print(f"round {round_} {kind}: {took:.4f} s per iteration", flush=True)
    newest = glob.glob(os.path.join(torch_args.save, "iter_*"))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(d, name)) for path in newest for d, _, names in os.walk(path)
                           for name in names)
    checkpointing.close(job_finished=True)
    params = sum(p.numel() for chunk in model for p in chunk.module.parameters())
    report_figures({"params": params, "checkpoint_bytes": checkpoint_bytes, "per_iteration_s": per_iteration,
                    "save_calls_s": save_calls,
                    "copies_s": [h.copy_s for h in handles], "protects_s": [h.protect_s for h in handles if h.protected],
                    "steady_s": steady, "drains_s": drains,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "bf16": args.bf16})
    torch.distributed.destroy_process_group()


def figures(f: dict, block: int) -> dict:
    """The ``RESULT`` figures from the worker's report of blocks of ``block`` iterations.

    The steady state is an ftmem block without its drain, and it is one only when a block's
    later iterations run beside an earlier save's copy and commit: blocks of one iteration have
    none, so their result leaves the steady figures out rather than report a save call alone.
    """
    median = {kind: statistics.median(times) for kind, times in f["per_iteration_s"].items()}
    result = {"params": f["params"], "step_s": median["nosave"]}
    for kind in SAVES:
        if kind in median:
            result.update({f"{kind}_cycle_s": median[kind],
                           f"{kind}_overhead_pct": 100 * (median[kind] / median["nosave"] - 1),
                           f"{kind}_save_call_s": statistics.median(f["save_calls_s"][kind])})
    if "ftmem" in median:
        result.update(ftmem_copy_s=statistics.median(f["copies_s"]), ftmem_protect_s=statistics.median(f["protects_s"]))
        if block > 1:
            steady = statistics.median(f["steady_s"])
            result.update(ftmem_steady_cycle_s=steady, ftmem_steady_overhead_pct=100 * (steady / median["nosave"] - 1),
                          ftmem_drain_s=statistics.median(f["drains_s"]))
    if "torch" in median:
        result["checkpoint_gb"] = f["checkpoint_bytes"] / 1e9
    return result


def bench_overhead(shape: dict = MODEL, bf16: bool = True, rounds: int = 3, block: int = 2, kinds=KINDS,
                   shm_dir: str = "/dev/shm", timeout_s: float = 3600) -> dict:
    work = tempfile.mkdtemp(prefix="ftmem-bench-overhead-", dir=os.getcwd())
    job = f"bench-overhead-{os.getpid()}"
    argv = ["--worker", "--work", work, "--rounds", str(rounds), "--block", str(block), "--kinds", ",".join(kinds),
            *driver_argv(shape, bf16, os.path.join(work, "ftmem"), shm_dir, job)]
    started = time.monotonic()
    try:
        f = run_for_figures("benchmarks.bench_overhead", argv, 1, job, os.path.join(work, "logs"), "overhead",
                            timeout_s)
    finally:
        jobs.clean(shm_dir, job)
        shutil.rmtree(work, ignore_errors=True)
    result = figures(f, block)
    print(f"megatron-core GPT of {f['params'] / 1e6:.1f}M parameters ({shape}), {'bf16' if f['bf16'] else 'fp32'}, "
          f"Adam, one rank on {f['device']}; medians over {rounds} rounds of {block}-iteration blocks after a "
          f"warm-up round:")
    for kind, times in f["per_iteration_s"].items():
        print(f"  {kind:7s} s per iteration: " + " ".join(f"{t:.4f}" for t in times))
    print(f"  without saves {result['step_s']:.4f} s per iteration")
    if "ftmem_cycle_s" in result:
        print(f"  an ftmem save after each {result['ftmem_cycle_s']:.4f} s ({result['ftmem_overhead_pct']:+.2f}%, "
              f"target <= {TARGET_PCT:.0f}%: {'met' if result['ftmem_overhead_pct'] <= TARGET_PCT else 'NOT met'}); "
              f"the call blocks {result['ftmem_save_call_s']:.4f} s (median); each block ends when its last "
              f"snapshot is committed, inside the timer: nothing is drained outside it")
        print(f"  each ftmem save, in the background: the copy {result['ftmem_copy_s']:.4f} s, then checksum, "
              f"commit and protection {result['ftmem_protect_s']:.4f} s (medians)")
        if "ftmem_steady_cycle_s" in result:
            print(f"  steady state, the drain left out: " + " ".join(f"{t:.4f}" for t in f["steady_s"])
                  + f" s per iteration, median {result['ftmem_steady_cycle_s']:.4f} s "
                  f"({result['ftmem_steady_overhead_pct']:+.2f}%, target <= {TARGET_PCT:.0f}%: "
                  f"{'met' if result['ftmem_steady_overhead_pct'] <= TARGET_PCT else 'NOT met'}); "
                  f"the drain (waiting for the block's last save to commit, which a run pays once at its end) "
                  + " ".join(f"{t:.4f}" for t in f["drains_s"]) + " s, timed apart")
        else:
            print("  steady state: not measured with blocks of one iteration, where no earlier save runs beside "
                  "an iteration (run with --block 2 or more for it)")
    if "torch_cycle_s" in result:
        print(f"  a torch save after each {result['torch_cycle_s']:.4f} s ({result['torch_overhead_pct']:+.1f}%); the "
              f"call blocks {result['torch_save_call_s']:.3f} s (median); a checkpoint is "
              f"{result['checkpoint_gb']:.2f} GB")
    print(f"  wall time {time.monotonic() - started:.0f} s")
    print_result(result)
    return result


def main(argv=None) -> int:
    """The benchmark; with ``--worker``, its rank (started by :func:`bench_overhead`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker(argv)
        end_process()  # the framework's gloo groups outlive the worker: see examples/process_end.py
    parser = argparse.ArgumentParser(prog="ftmem bench overhead",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny fp32 GPT ({TINY}) that runs on the CPU, for tests")
    for key, value in MODEL.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {value}")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds of blocks after the warm-up round")
    parser.add_argument("--block", type=int, default=2,
                        help="iterations per block (default 2; the steady-state figure needs 2 or more)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated, of {', '.join(KINDS)} (default all; nosave is always run)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block < 1:
        parser.error(f"--rounds and --block must be at least 1 (got --rounds {args.rounds} --block {args.block})")
    shape = dict(TINY if args.tiny else MODEL)
    shape.update({k: getattr(args, k) for k in MODEL if getattr(args, k) is not None})
    kinds = ["nosave"] + [k for k in SAVES if k in args.kinds.split(",")]
    bench_overhead(shape, bf16=not args.tiny, rounds=args.rounds, block=args.block, kinds=kinds,
                   shm_dir=args.shm_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
