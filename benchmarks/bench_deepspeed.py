"""``ftmem bench deepspeed`` (or ``python -m benchmarks.bench_deepspeed``): DeepSpeed's
default checkpoint engine against ftmem on the same model in one run — save_checkpoint
blocking time and load_checkpoint time of a >= 50M-parameter GPT under ZeRO-1 on 2
ranks, the same save with a flush to disk after it (what it blocks, and the flush
against DeepSpeed's torch.save) — and the iteration time of a smaller GPT saving with
ftmem after every step against not saving. Saves follow steps with nothing drained
outside a timer: the cycle cost (a step with a save minus one without, taking turns in
the same run) bills every wait; the one drain, before the restore figures, is reported.

Run without arguments it starts the two ranks (run_for_figures), each running
:func:`worker` (``--worker``); rank 0 prints the figures.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

from ftmem._shm import jobs

from benchmarks import restore_breakdown
from examples.launch import report_figures, run_for_figures
from examples.process_end import end_process

WORLD = 2
# The worker's phases, each in ranks started anew, in this order: the big model's saves, each
# restore of them (as after a crash), then the rest (the run's ftmem memory is freed between).
PHASES = ("saves", "restore-default", "restore-ftmem", "rest")
BIG = {"hidden": 768, "layers": 8, "seq_len": 64}  # ~57M parameters
SMALL = {"hidden": 256, "layers": 4, "seq_len": 64}
MICRO_BATCH = 2
# Iteration-time cases: (micro batch, ranks per node). The overhead depends on how much
# compute a step holds per byte of state: real pretraining runs thousands of tokens per
# GPU per step, 2048 per rank is at the low end of that, and 128 is a step that is
# almost all state. With 1 rank per node the 2 ranks are 2 nodes mirroring each other
# (k=1, m=1: every save's bytes cross between them); with 2 per node they are one node
# and nothing crosses, which isolates the cost of the cross-node exchange.
ITERATION_CASES = {"tokens128": (2, 1), "tokens2048": (32, 1), "tokens128_one_node": (2, 2)}


def zero1_config(micro_batch: int, lr: float, ftmem: Optional[dict]) -> dict:
    """DeepSpeed ZeRO-1 with torch's AdamW; with ftmem's engine, configured by ``ftmem``, unless it is None."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    if ftmem is not None:
        config["checkpoint"] = {"engine": "ftmem"}
        config["ftmem"] = ftmem
    return config


def _config(ftmem: bool, shm_dir: str, micro_batch: int, ranks_per_node: int, persist_dir: str = None) -> dict:
    section = {"ranks_per_node": ranks_per_node, "shm_dir": shm_dir}
    if persist_dir:
        section["persist"] = {"dir": persist_dir, "interval": 1, "keep": 1}
    return zero1_config(micro_batch, 1e-4, section if ftmem else None)


def worker(argv=None) -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see examples.deepspeed.train_gpt
    import deepspeed

    import ftmem_deepspeed  # noqa: F401

    from examples.deepspeed.gpt import GPT, GPTConfig, batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--work", required=True)
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--phase", choices=PHASES, required=True)
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    figures = {}

    def engine_for(shape: dict, ftmem: bool, micro_batch: int = MICRO_BATCH, ranks_per_node: int = 1,
                   persist_dir: str = None):
        model = GPT(GPTConfig(**shape))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(ftmem, args.shm_dir, micro_batch, ranks_per_node,
                                                         persist_dir))
        return engine, GPTConfig(**shape)

    def train_step(engine, cfg, step):
        x, y = batch(cfg, step, rank, engine.train_micro_batch_size_per_gpu())
        engine.backward(engine(x, y))
        engine.step()

    def timed(fn) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # 1. saves of the big model, default engine then ftmem. The saves follow steps, as in
    # training, with nothing drained in between: an ftmem save call bills whatever it waits
    # for (the previous snapshot's protection). Then, for ftmem, one save timed to
    # "protected", and a drain before the restart (reported, not billed). Each restore runs
    # in ranks started anew (the restore phases), as after a crash, so that neither reuses
    # memory the other, or the saves, paged in.
    if args.phase.startswith("restore-"):
        name = args.phase.removeprefix("restore-")
        engine, cfg = engine_for(BIG, name == "ftmem")
        with open(os.path.join(args.work, f"{name}.step")) as f:
            saved_step = int(f.read())
        loaded = []
        figures[f"{name}_restore_s"] = timed(lambda: loaded.append(engine.load_checkpoint(os.path.join(args.work, name))))
        if loaded[0][0] is None or engine.global_steps != saved_step:
            raise RuntimeError(f"the {name} restore loaded step {engine.global_steps}, not {saved_step}")
        if name == "ftmem":
            figures.update(restore_breakdown.figures(engine.checkpoint_engine.runtime.last_restore))
            engine.checkpoint_engine.runtime.close(job_finished=True)
            del engine
            # Untimed, with the other rank waiting in a barrier: what first-touch page faults cost here.
            torch.distributed.barrier()
            if rank == 0:
                figures.update(restore_breakdown.copy_bandwidths())
            torch.distributed.barrier()
        if rank == 0:
            report_figures(figures)
        return
    if args.phase == "saves":
        for name, ftmem in (("default", False), ("ftmem", True)):
            engine, cfg = engine_for(BIG, ftmem)
            figures["params"] = sum(p.numel() for p in engine.module.parameters())
            ckpt = os.path.join(args.work, name)
            saves = []
            for step in range(4):
                train_step(engine, cfg, step)
                saves.append(timed(lambda: engine.save_checkpoint(ckpt)))
            figures[f"{name}_save_s"] = statistics.median(saves[1:])  # the first save allocates
            if ftmem:
                figures["ftmem_drain_before_protected_s"] = timed(engine.checkpoint_engine.wait_protected)
                train_step(engine, cfg, 4)
                figures["ftmem_protected_s"] = timed(lambda: (engine.save_checkpoint(ckpt),
                                                              engine.checkpoint_engine.wait_protected()))
                engine.checkpoint_engine.runtime.close(job_finished=False)  # keep the snapshots, as a crash would
            if rank == 0:
                with open(os.path.join(args.work, f"{name}.step"), "w") as f:
                    f.write(str(engine.global_steps))
            del engine
        if rank == 0:
            report_figures(figures)
        return

    # 1b. the cycle cost on the big model: blocks of steps with an ftmem save after every
    # step take turns with blocks without saves; a block with saves ends when its last
    # snapshot is protected, inside its timer.
    # After each save: how many iterations the newest protected version is behind it.
    engine, cfg = engine_for(BIG, True)
    per_step, lags, handles = {"save": [], "nosave": []}, [], []
    step = 0
    for block in range(1 + args.blocks):  # block 0 warms up: allocation, first mappings
        for kind in ("nosave", "save"):
            def block_of_steps():
                nonlocal step
                for _ in range(args.block_steps):
                    train_step(engine, cfg, step)
                    if kind == "save":
                        engine.save_checkpoint(os.path.join(args.work, "cycle"))
                        lags.append(engine.checkpoint_engine.runtime.lag().versions)
                        handles.append(engine.checkpoint_engine.runtime.last_save)
                    step += 1
                if kind == "save":
                    engine.checkpoint_engine.wait_protected()

            took = timed(block_of_steps)
            if block:
                per_step[kind].append(took / args.block_steps)
    lag = engine.checkpoint_engine.runtime.lag()
    engine.checkpoint_engine.runtime.close(job_finished=True)
    figures["big_step_s"] = statistics.median(per_step["nosave"])
    figures["big_cycle_s"] = statistics.median(per_step["save"])
    figures["protect_lag_iters"] = statistics.median(lag for lag in lags if lag is not None)
    figures["protect_lag_max_iters"] = max(lag for lag in lags if lag is not None)
    figures["versions_unprotected"] = lag.unprotected
    figures["save_cpu_s"] = statistics.median(h.cpu_s for h in handles if h.cpu_s is not None)
    del engine

    # 2. the same saves with every version flushed to disk: what the save call blocks
    # (the flush runs in the background), and how long a flush of this rank's files
    # takes against DeepSpeed's own torch.save of the same checkpoint above.
    engine, cfg = engine_for(BIG, True, persist_dir=os.path.join(args.work, "persist"))
    saves, flushes = [], []
    for step in range(3):
        train_step(engine, cfg, step)
        engine.checkpoint_engine.wait_flushed()
        saves.append(timed(lambda: engine.save_checkpoint(os.path.join(args.work, "persisted"))))
        engine.checkpoint_engine.wait_flushed()
        flushes.append(engine.checkpoint_engine.runtime.last_flush)
    engine.checkpoint_engine.runtime.close(job_finished=True)
    figures["persist_save_s"] = statistics.median(saves[1:])
    figures["flush_s"] = statistics.median(flush.seconds for flush in flushes[1:])
    figures["flush_sync_s"] = statistics.median(flush.sync_s for flush in flushes[1:])
    figures["flush_mb"] = flushes[-1].nbytes / 2**20
    del engine

    # 3. iteration time of the smaller GPT: ftmem save every step vs no saves. The two
    # engines take turns in blocks of steps, so load from outside the benchmark hits both
    # alike; a block with saves ends when its last snapshot is protected, inside its
    # timer, so none of its background work is billed to the engine that does not save.
    for case, (micro_batch, ranks_per_node) in ITERATION_CASES.items():
        engines = {name: engine_for(SMALL, save, micro_batch, ranks_per_node)
                   for name, save in (("nosave", False), ("save", True))}
        times = {name: [] for name in engines}
        for block in range(1 + args.blocks):  # block 0 warms up: allocation, first mappings
            for name, (engine, cfg) in engines.items():
                def block_of_steps():
                    for step in range(block * args.block_steps, (block + 1) * args.block_steps):
                        train_step(engine, cfg, step)
                        if name == "save":
                            engine.save_checkpoint(os.path.join(args.work, "every-step"))
                    if name == "save":
                        engine.checkpoint_engine.wait_protected()

                took = timed(block_of_steps)
                if block:
                    times[name].append(took / args.block_steps)
        for name in engines:
            figures[f"iter_{case}_{name}_s"] = statistics.median(times[name])
        engines["save"][0].checkpoint_engine.runtime.close(job_finished=True)
        del engines
    if rank == 0:
        report_figures(figures)


def bench_deepspeed(shm_dir: str = "/dev/shm") -> dict:
    work = tempfile.mkdtemp(prefix="ftmem-bench-ds-", dir=os.getcwd())
    job = f"bench-ds-{os.getpid()}"
    try:
        f = {}
        for phase in PHASES:
            f.update(run_for_figures("benchmarks.bench_deepspeed", ["--worker", "--work", work, "--shm-dir", shm_dir,
                                                                    "--phase", phase], WORLD, job,
                                     os.path.join(work, f"logs-{phase}"), f"DeepSpeed ({phase})", 1800,
                                     env={"DS_ACCELERATOR": "cpu"}))
    finally:
        jobs.clean(shm_dir, job)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "default_save_s": f["default_save_s"], "ftmem_save_s": f["ftmem_save_s"],
        "default_restore_s": f["default_restore_s"], "ftmem_restore_s": f["ftmem_restore_s"],
        "save_vs_default_x": f["default_save_s"] / f["ftmem_save_s"],
        "restore_vs_default_x": f["default_restore_s"] / f["ftmem_restore_s"],
        "persist_save_s": f["persist_save_s"], "persist_vs_memory_save_x": f["persist_save_s"] / f["ftmem_save_s"],
        "flush_s": f["flush_s"], "flush_vs_default_save_x": f["flush_s"] / f["default_save_s"],
        "flush_sync_s": f["flush_sync_s"], "flush_sync_share_x": f["flush_sync_s"] / f["flush_s"],
        "protected_s": f["ftmem_protected_s"], "drain_before_restore_s": f["ftmem_drain_before_protected_s"],
        "step_s": f["big_step_s"], "cycle_s": f["big_cycle_s"], "cycle_cost_s": f["big_cycle_s"] - f["big_step_s"],
        "cycle_cost_vs_default_save_x": (f["big_cycle_s"] - f["big_step_s"]) / f["default_save_s"],
        "protect_lag_iters": f["protect_lag_iters"], "protect_lag_max_iters": f["protect_lag_max_iters"],
        "save_cpu_s": f["save_cpu_s"],
        "versions_unprotected": f["versions_unprotected"],
        **{key: f[key] for key in restore_breakdown.KEYS},
    }
    for case in ITERATION_CASES:
        nosave, save = f[f"iter_{case}_nosave_s"], f[f"iter_{case}_save_s"]
        result.update({f"iter_{case}_nosave_s": nosave, f"iter_{case}_save_every_step_s": save,
                       f"iter_{case}_overhead_x": save / nosave, f"iter_{case}_cycle_cost_s": save - nosave})
    print(f"GPT of {f['params'] / 1e6:.1f}M parameters, ZeRO-1, {WORLD} ranks (CPU, gloo):")
    print(f"  save_checkpoint blocks   default {result['default_save_s']:.3f} s   ftmem {result['ftmem_save_s']:.3f} s"
          f"   ({result['save_vs_default_x']:.0f}x less, target >= 20x)")
    print(f"  load_checkpoint          default {result['default_restore_s']:.3f} s   "
          f"ftmem {result['ftmem_restore_s']:.3f} s   ({result['restore_vs_default_x']:.2f}x the default's speed, "
          f"target >= 2x; each in ranks started anew)")
    print(restore_breakdown.describe(result))
    print(f"  a save after every step: step {result['step_s']:.3f} s without saves, {result['cycle_s']:.3f} s with "
          f"(cycle cost {result['cycle_cost_s']:+.3f} s, {result['cycle_cost_vs_default_save_x']:.2f}x the default "
          f"engine's blocking save, target <= 0.25x; every wait billed); protection ran "
          f"{result['protect_lag_iters']:g} iteration(s) behind the saves (median, at most "
          f"{result['protect_lag_max_iters']:g}), {result['versions_unprotected']:g} version(s) never protected; "
          f"ftmem's threads spent {result['save_cpu_s']:.3f} s of CPU per save on its bytes (the copy, the "
          f"checksum on every thread, the commit marker; median)")
    print(f"  save -> protected {result['protected_s']:.3f} s; before the restart, the last snapshot was drained "
          f"for {result['drain_before_restore_s']:.3f} s (untimed: setup for the restore figures)")
    print(f"  with a flush to disk after every save: save_checkpoint blocks {result['persist_save_s']:.3f} s "
          f"({result['persist_vs_memory_save_x']:.2f}x the save without, target <= 1.05x); a flush of rank 0's "
          f"{f['flush_mb']:.0f} MiB takes {result['flush_s']:.3f} s, {result['flush_vs_default_save_x']:.2f}x "
          f"the default engine's whole save_checkpoint (which syncs nothing); {result['flush_sync_s']:.3f} s of it "
          f"({result['flush_sync_share_x']:.2f}x) syncing the files and directories to the disk (fsync), so "
          f"that a power loss leaves a whole checkpoint")
    print(f"smaller GPT ({SMALL}), iteration without saves vs an ftmem save every step:")
    for case, (micro_batch, ranks_per_node) in ITERATION_CASES.items():
        where = "2 nodes, mirrored" if ranks_per_node == 1 else "1 node, no cross-node parity"
        print(f"  {micro_batch * SMALL['seq_len']:5d} tokens per rank per step, {where:28s}: "
              f"{result[f'iter_{case}_nosave_s'] * 1e3:7.1f} ms vs {result[f'iter_{case}_save_every_step_s'] * 1e3:7.1f} ms"
              f"  ({(result[f'iter_{case}_overhead_x'] - 1) * 100:+.1f}%, target <= +10%)")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    """The benchmark; with ``--worker``, one of its ranks (started by :func:`bench_deepspeed`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker(argv)
        end_process()  # the framework's gloo groups outlive the worker: see examples/process_end.py
    parser = argparse.ArgumentParser(prog="ftmem bench deepspeed",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
    bench_deepspeed(parser.parse_args(argv).shm_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
