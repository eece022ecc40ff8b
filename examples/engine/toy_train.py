"""A tiny deterministic data-parallel trainer on the ftmem engine.

Used by ``ftmem demo`` and the crash tests, with real processes, a real gloo process
group and real SIGKILLs. Each rank trains a small MLP with dropout (so the RNG state
matters) on synthetic batches that depend only on (iteration, rank), averages the
gradients over the ranks, and saves model, optimizer, scheduler and RNG state to
ftmem after every step, marking model and optimizer tensors as replicated across
the ranks (so with DP sharding each rank keeps a 1/world slice of them). The copy overlaps the next forward/backward; only the next
optimizer step waits for it.

Run one rank per process with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set::

    python -m examples.engine.toy_train --iters 12 --out DIR [--stop-after N] [--ranks-per-node R] [--ec-k K --ec-m M]
    python -m examples.engine.toy_train --iters 12 --out DIR --no-snapshots

Writes ``DIR/rank<r>.losses.jsonl`` (one {"it", "loss"} per step) and, at the end,
``DIR/rank<r>.final.pt``. ``--stop-after N`` makes the rank wait, after version N is
committed and protected, until it is killed (a crash test's "between saves"). If
versions are held but none is recoverable, or none for the layout and EC geometry it runs
now, it says so and exits with status 3 (where a real trainer falls back to its disk
checkpoint, or stops). ``--no-snapshots`` trains the
same steps without ftmem: no SnapshotEngine, nothing saved or restored (the tests'
uninterrupted reference runs, which show that the snapshots change nothing in training).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from examples.process_end import end_process
from ftmem import (LayoutMismatch, NotRecoverableFromMemory, SnapshotEngine, restored_from_memory, rng_states,
                   set_rng_states)

IN, HIDDEN, OUT = 32, 64, 8
# Flags that configure the snapshots, refused with --no-snapshots (which takes none).
SNAPSHOT_FLAGS = ("stop_after", "ranks_per_node", "shm_dir", "ec_k", "ec_m", "dp_shard", "protect_each",
                  "protect_first")


def build_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # same initial weights on every rank, as DDP would broadcast
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(HIDDEN, OUT)
    )


def batch(iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(iteration * 1000 + rank)
    return torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.engine.toy_train")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--ranks-per-node", type=int, default=None)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--ec-k", type=int, default=None)
    parser.add_argument("--ec-m", type=int, default=None)
    parser.add_argument("--dp-shard", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--protect-each", action="store_true",
                        help="wait for each save's protection before the next save, so that every version is "
                             "protected in turn (for kills at one version's protection step); without it "
                             "protection runs behind the saves and takes the newest")
    parser.add_argument("--protect-first", action="store_true",
                        help="wait for the first save's protection before the next save, so that a version is "
                             "protected before protection falls behind (for tests that hold a later protection)")
    parser.add_argument("--no-snapshots", action="store_true",
                        help="train without ftmem: no SnapshotEngine, nothing saved or restored (a reference run)")
    args = parser.parse_args(argv)
    if args.no_snapshots:
        snapshot_only = [f"--{dest.replace('_', '-')}" for dest in SNAPSHOT_FLAGS
                         if getattr(args, dest) != parser.get_default(dest)]
        if snapshot_only:
            parser.error(f"{', '.join(snapshot_only)}: only for snapshots, which --no-snapshots switches off")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = None if args.no_snapshots else SnapshotEngine(
        {"ranks_per_node": args.ranks_per_node, "shm_dir": args.shm_dir, "ec": {"k": args.ec_k, "m": args.ec_m},
         "dp_shard": args.dp_shard})

    torch.manual_seed(99 + rank)  # per-rank dropout masks
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.7)

    def state(iteration: int) -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                "rng": rng_states(), "iteration": iteration}

    start = 0
    try:
        restored = engine.restore() if engine is not None else None
    except (NotRecoverableFromMemory, LayoutMismatch) as e:
        print(f"ftmem: {e}", flush=True)
        # Every rank refuses at this same point, so all can close together, and leaves as a
        # clean end does (examples.process_end): exiting with gloo's threads still running
        # aborted a rank now and then ("terminate called without an active exception")
        # instead of exiting 3.
        engine.close(job_finished=False)
        end_process(3)
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optim.load_state_dict(restored.state["optim"])
        sched.load_state_dict(restored.state["sched"])
        set_rng_states(restored.state["rng"])
        start = restored.state["iteration"] + 1
        print(restored_from_memory(restored.state["iteration"], rank, rebuilt=restored.rebuilt), flush=True)

    os.makedirs(args.out, exist_ok=True)
    losses = open(os.path.join(args.out, f"rank{rank}.losses.jsonl"), "a")
    handle = None
    for it in range(start, args.iters):
        x, y = batch(it, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if handle is not None:
            handle.wait_reusable()  # the step below overwrites what the last save copies
        optim.step()
        sched.step()
        optim.zero_grad()
        losses.write(json.dumps({"it": it, "loss": loss.item()}) + "\n")
        losses.flush()
        if engine is None:
            continue
        if handle is not None and (args.protect_each or (args.protect_first and it == start + 1)):
            handle.wait_protected()
        snapshot = state(it)
        # Model and optimizer state are identical on every rank (averaged gradients);
        # the torch RNG state (per-rank dropout) is the only tensor unique to a rank.
        handle = engine.save(snapshot, it, replicated=lambda t: t is not snapshot["rng"]["torch"])
        if it == args.stop_after:
            handle.wait_protected()
            print(f"rank {rank}: stopped after committing version {it}; waiting to be killed", flush=True)
            while True:
                time.sleep(3600)
    torch.save(model.state_dict(), os.path.join(args.out, f"rank{rank}.final.pt"))
    if engine is not None:
        engine.close(job_finished=True)
    # Not a plain return: a reference run (no ftmem at all) aborted once in a loaded test run
    # with "terminate called without an active exception" after writing everything, as
    # examples.process_end says gloo's threads make a process do at finalization.
    end_process()


if __name__ == "__main__":
    main()
