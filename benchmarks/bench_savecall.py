"""``ftmem bench savecall`` (or ``python -m benchmarks.bench_savecall``): what the save call
blocks the training loop, against the number of tensors in the state, for the core
(``SnapshotEngine.save``) and through each adapter (DeepSpeed's ``save_checkpoint``,
Megatron's in-memory ``save_checkpoint``), all in one run.

Each save follows a step, as in training: compute that evicts the caches (as a forward and
backward do), the wait for the last snapshot's copy, an in-place update of every tensor, a
fresh state dict (as ``state_dict()`` makes one), then the save call, timed. The state's
structure stays from one save to the next, its values change. Nothing is drained outside
a timer: a call that waits for the previous save is billed that wait.

Baselines, measured in the same run on the same states: for the core, the walk
``torch.save`` makes of the state (its pickling, the tensors' bytes left out), the least any
checkpoint of the state costs in Python. For the adapters, the framework's default save
(DeepSpeed's engine; Megatron-LM's ``--ckpt-format torch``), and the framework's own part of
any save, which no checkpoint engine avoids: DeepSpeed's ``save_checkpoint`` with an engine
that writes nothing (collecting its state dicts, its barriers), and megatron-core's sharded
state dicts of the model and optimizer (which ftmem's save builds, as Megatron's own
distributed checkpoints do). ftmem's share of a call is the call less that part.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time

import torch

from ftmem._shm import jobs

from examples.launch import report_figures, run_for_figures
from examples.process_end import end_process

WORLD = 2
CORE_TENSORS = (300, 1200, 3000, 12000)
CORE_TARGET_S = 0.005  # at about 3,000 tensors
ADAPTER_TARGET_S = 0.010
# Layers that give a state of about 3,000 tensors: DeepSpeed's GPT block holds 12
# parameters (ZeRO-1 keeps Adam's state flat), megatron-core's 12 or so, each with Adam's two
# moments beside it (the distributed optimizer off).
DS_LAYERS = 250
MEGATRON_LAYERS = 80
SAVES = 12


# -- the core -----------------------------------------------------------------------------
class _TorchSaveWalk(pickle.Pickler):
    """torch.save's pickling of a state, storages left out as persistent ids."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, torch.Tensor) else None


def _adam_like(tensors: int):
    """A model's parameters and Adam's state, ``tensors`` in all, and a function that makes
    the state dict anew, as ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``."""
    n = tensors // 3
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, generator=gen)) for _ in range(n)]
    moments = {i: {"exp_avg": torch.zeros(256), "exp_avg_sq": torch.zeros(256)} for i in range(n)}

    def state_dict() -> dict:
        return {"model": {f"layers.{i}.weight": p.detach() for i, p in enumerate(params)},
                "optimizer": {"state": moments, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999),
                                                                  "params": list(range(n))}]},
                "iteration": 1}

    return [p.data for p in params] + [t for m in moments.values() for t in m.values()], state_dict


def core(tensors: int, saves: int, shm_dir: str) -> dict:
    from ftmem import SnapshotEngine

    updated, state_dict = _adam_like(tensors)
    evict = torch.empty(8 << 20, dtype=torch.uint8)  # larger than the caches: what a step leaves in them
    job = f"bench-savecall-{os.getpid()}-{tensors}"
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)
    calls, walks, handle = [], [], None
    try:
        for version in range(saves + 2):  # 2 warm-up saves: the slots' first use
            evict.fill_(version)
            if handle is not None:
                handle.wait_reusable()
            torch._foreach_mul_(updated, 0.999)
            state = state_dict()
            t0 = time.perf_counter()
            handle = engine.save(state, version)
            calls.append(time.perf_counter() - t0)
            evict.fill_(version)
            t0 = time.perf_counter()
            _TorchSaveWalk(io.BytesIO(), protocol=2).dump(state)
            walks.append(time.perf_counter() - t0)
        counted = handle.tensors
        engine.close(job_finished=True)
    finally:
        jobs.clean(shm_dir, job)
    return {"tensors": counted, "call_s": statistics.median(calls[2:]), "call_max_s": max(calls[2:]),
            "walk_s": statistics.median(walks[2:])}


# -- the adapters, on their ranks ------------------------------------------------------------
class _DiscardingEngine:
    """A DeepSpeed checkpoint engine that writes nothing: what save_checkpoint costs with it
    is DeepSpeed's own part of any save (collecting its state dicts, its barriers)."""

    def __init__(self, stock):
        self._stock = stock

    def __getattr__(self, name):
        return getattr(self._stock, name)

    def save(self, state_dict, path: str) -> None:
        pass

    def commit(self, info) -> bool:
        return True


def deepspeed_worker(args) -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see examples.deepspeed.train_gpt
    import deepspeed

    import ftmem_deepspeed  # noqa: F401
    from benchmarks.bench_deepspeed import zero1_config
    from examples.deepspeed.gpt import GPT, GPTConfig, batch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(hidden=16, heads=2, layers=args.layers, seq_len=16)
    figures = {}
    for name in ("framework", "default", "ftmem"):
        ftmem = {"ranks_per_node": 1, "shm_dir": args.shm_dir} if name == "ftmem" else None
        model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=zero1_config(1, 1e-4, ftmem))
        if name == "framework":
            engine.checkpoint_engine = _DiscardingEngine(engine.checkpoint_engine)
        calls = []
        for step in range(args.saves + 2):
            x, y = batch(cfg, step, rank, 1)
            engine.backward(engine(x, y))
            engine.step()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(os.path.join(args.work, name))
            calls.append(time.perf_counter() - t0)
        figures[f"{name}_call_s"] = _slowest_rank(statistics.median(calls[2:]))
        figures[f"{name}_call_max_s"] = _slowest_rank(max(calls[2:]))
        if name == "ftmem":
            runtime = engine.checkpoint_engine.runtime
            figures["tensors"] = runtime.last_save.tensors
            runtime.close(job_finished=True)
        del engine
    if rank == 0:
        report_figures(figures)


def megatron_worker(args, driver: list) -> None:
    from examples.megatron import torch_checkpoint
    from examples.megatron.pretrain_gpt import (build_model, build_optimizer, initialize, parse_args, train_step,
                                                transformer_config)
    from ftmem_megatron import checkpointing

    margs = parse_args(driver)
    initialize(margs)
    config = transformer_config(margs)
    model = build_model(margs, config)
    optimizer, scheduler = build_optimizer(margs, model, config)

    def sharded_state_dicts(_iteration: int) -> None:
        state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model)}
        optimizer.sharded_state_dict(state)

    saves = {"framework": sharded_state_dicts,
             "default": lambda it: torch_checkpoint.save_checkpoint(it, model, optimizer, scheduler, 0.0, margs),
             "ftmem": lambda it: checkpointing.save_checkpoint(it, model, optimizer, scheduler, 0.0, margs)}
    calls = {name: [] for name in saves}
    figures = {}
    for iteration in range(1, args.saves + 3):
        train_step(margs, iteration, model, optimizer, scheduler)
        for name, save in saves.items():
            if name != "ftmem":
                checkpointing.wait_protected()  # ftmem's background work is not billed to the others
            torch.distributed.barrier()
            t0 = time.perf_counter()
            save(iteration)
            calls[name].append(time.perf_counter() - t0)
    for name, times in calls.items():
        figures[f"{name}_call_s"] = _slowest_rank(statistics.median(times[2:]))
        figures[f"{name}_call_max_s"] = _slowest_rank(max(times[2:]))
    figures["tensors"] = checkpointing.last_save().tensors
    checkpointing.wait_protected()
    checkpointing.close(job_finished=True)
    if torch.distributed.get_rank() == 0:
        report_figures(figures)


def _slowest_rank(seconds: float) -> float:
    took = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
    return took.item()


def _megatron_driver(work: str, shm_dir: str, job: str, layers: int) -> list:
    from benchmarks.bench_megatron import model_flags

    shape = {"num_layers": layers, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 128}
    save = os.path.join(work, "megatron")
    return [*model_flags(shape), "--tensor-model-parallel-size", "1", "--micro-batch-size", "1",
            "--global-batch-size", str(WORLD), "--train-iters", "1000", "--lr", "1e-4", "--mock-data",
            "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
            "--save", save, "--load", save, "--save-interval", "1000", "--ftmem-shm-dir", shm_dir,
            "--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1", "--ftmem-job-id", job]


def bench_savecall(core_tensors=CORE_TENSORS, saves: int = SAVES, shm_dir: str = "/dev/shm",
                   adapters: bool = True, layers: tuple[int, int] = (DS_LAYERS, MEGATRON_LAYERS)) -> dict:
    """``layers``: of DeepSpeed's GPT and of megatron-core's."""
    result, cores = {}, []
    print(f"the save call against the tensors in the state (median of {saves} saves, after 2 warm-up saves):")
    for n in core_tensors:
        c = core(n, saves, shm_dir)
        cores.append(c)
        key = f"core_{c['tensors']}"
        result.update({f"{key}_call_s": c["call_s"], f"{key}_call_max_s": c["call_max_s"],
                       f"{key}_walk_s": c["walk_s"], f"{key}_vs_walk_x": c["call_s"] / c["walk_s"]})
        print(f"  core      {c['tensors']:6d} tensors: {c['call_s'] * 1e3:7.2f} ms (max {c['call_max_s'] * 1e3:6.2f}), "
              f"{c['call_s'] / c['tensors'] * 1e6:5.2f} us a tensor; torch.save's walk of the state "
              f"{c['walk_s'] * 1e3:6.2f} ms ({c['call_s'] / c['walk_s']:.2f}x)")
    near = min(cores, key=lambda c: abs(c["tensors"] - 3000))
    result["core_vs_target_x"] = near["call_s"] / CORE_TARGET_S
    print(f"  core at {near['tensors']} tensors: {result['core_vs_target_x']:.2f}x the target of "
          f"{CORE_TARGET_S * 1e3:.0f} ms at about 3,000")
    if adapters:
        work = tempfile.mkdtemp(prefix="ftmem-bench-savecall-", dir=os.getcwd())
        job = f"bench-savecall-{os.getpid()}"
        try:
            for name, extra in (("deepspeed", ["--layers", str(layers[0])]),
                                ("megatron", _megatron_driver(work, shm_dir, job, layers[1]))):
                f = run_for_figures("benchmarks.bench_savecall", ["--worker", name, "--work", work, "--shm-dir",
                                                                  shm_dir, "--saves", str(saves), *extra],
                                    WORLD, job, os.path.join(work, f"logs-{name}"), f"save call ({name})", 900,
                                    env={"DS_ACCELERATOR": "cpu"} if name == "deepspeed" else None)
                jobs.clean(shm_dir, job)
                share = f["ftmem_call_s"] - f["framework_call_s"]
                result.update({f"{name}_tensors_n": f["tensors"], f"{name}_call_s": f["ftmem_call_s"],
                               f"{name}_call_max_s": f["ftmem_call_max_s"], f"{name}_default_s": f["default_call_s"],
                               f"{name}_framework_s": f["framework_call_s"], f"{name}_ftmem_share_s": share,
                               f"{name}_vs_default_x": f["ftmem_call_s"] / f["default_call_s"],
                               f"{name}_share_vs_target_x": share / ADAPTER_TARGET_S})
                print(f"  {name:9s} {f['tensors']:6d} tensors: {f['ftmem_call_s'] * 1e3:7.2f} ms (max "
                      f"{f['ftmem_call_max_s'] * 1e3:6.2f}, slowest of {WORLD} ranks); the default save "
                      f"{f['default_call_s'] * 1e3:7.2f} ms ({f['ftmem_call_s'] / f['default_call_s']:.3f}x); the "
                      f"framework's own part {f['framework_call_s'] * 1e3:7.2f} ms, so ftmem's share "
                      f"{share * 1e3:6.2f} ms, {share / ADAPTER_TARGET_S:.2f}x the target of "
                      f"{ADAPTER_TARGET_S * 1e3:.0f} ms")
        finally:
            jobs.clean(shm_dir, job)
            shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    """The benchmark; with ``--worker NAME``, one of an adapter's ranks (started by :func:`bench_savecall`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker = argparse.ArgumentParser(allow_abbrev=False)
        worker.add_argument("--worker", choices=("deepspeed", "megatron"))
        worker.add_argument("--work", required=True)
        worker.add_argument("--shm-dir", required=True)
        worker.add_argument("--saves", type=int, required=True)
        worker.add_argument("--layers", type=int, default=DS_LAYERS)
        args, driver = worker.parse_known_args(argv)
        deepspeed_worker(args) if args.worker == "deepspeed" else megatron_worker(args, driver)
        end_process()  # the framework's gloo groups outlive the worker: see examples/process_end.py
    parser = argparse.ArgumentParser(prog="ftmem bench savecall", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
    parser.add_argument("--tensors", type=int, nargs="+", default=list(CORE_TENSORS),
                        help=f"the core's state sizes, in tensors (default {' '.join(map(str, CORE_TENSORS))})")
    parser.add_argument("--saves", type=int, default=SAVES, help=f"timed saves of each kind (default {SAVES})")
    parser.add_argument("--core-only", action="store_true", help="the core alone, no adapter's ranks")
    parser.add_argument("--tiny", action="store_true", help="2 timed saves, states of tens of tensors, for tests")
    args = parser.parse_args(argv)
    if args.tiny:
        bench_savecall([30, 300], 2, args.shm_dir, adapters=not args.core_only, layers=(2, 2))
    else:
        bench_savecall(args.tensors, args.saves, args.shm_dir, adapters=not args.core_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
