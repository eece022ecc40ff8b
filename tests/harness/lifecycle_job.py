"""A job on the adapter runtime (ftmem.adapter.AdapterRuntime) for the lifecycle tests: every
rank saves a replicated tensor per step, protected, and ends the way ``--end`` says.

    python -m tests.harness.lifecycle_job --out DIR --steps N --end WAY [--end-of-rank R=WAY ...] [--persist DIR]
        [--persist-interval N] [--persist-keep N] [--persist-fsync {on,off}] [--no-failure-detection] [--destroys-group] [--load-version V] [--ranks-per-node R] [--runtimes N]
        [--restore-into {rank-0,every-rank}] [--load-while-saving] [--other-worlds] [--dp-collective-each-save]

``--end close`` closes the runtime itself, keeping the memory, before it returns; ``--end
hang`` waits in ``signal.pause()``, its last version protected, as a rank stuck in a collective
that never fails by itself (NCCL's, whose peer died), until the test or its failure detector
ends it. The other ways (:data:`ENDS`) exit with a status: ``exit0``, ``exit1``, ``exit3`` and
``exit42`` call ``sys.exit(N)``, ``builtin-exit42`` calls the builtin ``exit(42)``, ``raise``
raises an uncaught exception, ``thread-exit3`` calls ``sys.exit(3)`` in a thread of its own
(which ends that thread only) and returns, and ``store-get`` waits in a ``get`` on the job's
store of a key nobody sets, as a framework's main thread may (the store's timeout bounds it).
``--end-of-rank R=WAY`` ends rank R that way instead of ``--end``'s; with ``--end-after PATH``
such a rank first waits for PATH to exist (the test makes it once the other ranks are where it
wants them: in their pause, say). With
``--destroys-group`` the script ends torch.distributed itself, in a ``finally:``, as
PyTorch asks scripts to; else an exit hook does it after ftmem's end. ``--runtimes N``
runs N jobs side by side in each process (as a script with several DeepSpeed engines
does), the others saving into subdirectories of ``--out``; their ids derive from those.
``--restore-into`` names a tensor of the rank's own for the restore to write the replicated
tensor into (``AdapterRuntime.restore(plan, into=...)``), on rank 0 only or on every rank.
``--load-while-saving`` loads the newest version again right after the last step's save,
its protection still in flight (DeepSpeed's rollback mid-run does so); rank 1 first lets
its save thread reach the job-wide agreement, so that the ranks start the load's
collectives in different orders against their save threads' unless ftmem waits.
``--dp-collective-each-save`` makes an all-reduce on the runtime's DP group right after each
save, its protection and flush in flight (Megatron's adapter does so at every save); rank 1
first waits for the flush of that save to be on disk, so that rank 0's all-reduce would meet
rank 1's flush's gather of the DP-sharded state if the two shared a group.
``--other-worlds`` lets the restore adopt a version that a job on another world saved
(as DeepSpeed's adapter does), and refuses a fresh start where memory could not serve.
"""
import argparse
import atexit
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ftmem import FtmemConfig, ParallelLayout
from ftmem.adapter import (DISK, MEMORY, AdapterRuntime, DiskCheckpoint, FrameworkFormat, OtherWorlds, flushed,
                           save_atomically, write_atomically)


class TensorFiles(FrameworkFormat):
    """One file per rank and version: enough of a framework for the persistent tier."""

    name = "test-tensor-files"

    def checkpoint_name(self, version, state):
        return f"v{version}"

    def write_rank(self, state, directory, rank, first_replica, wrote):
        path = os.path.join(directory, f"rank{rank}.pt")
        save_atomically(state["w"], path)
        wrote(path)

    def publish(self, root, name):
        write_atomically(os.path.join(root, "newest"), name.encode())


ENDS = ("return", "exit0", "exit1", "exit3", "exit42", "builtin-exit42", "raise", "close", "hang", "thread-exit3",
        "store-get")


def end_of_rank(value: str) -> tuple[int, str]:
    rank, _, way = value.partition("=")
    if not rank.isdigit() or way not in ENDS:
        raise argparse.ArgumentTypeError(f"{value!r}: expected R=WAY, WAY one of {', '.join(ENDS)}")
    return int(rank), way


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def report_threads_and_end(before: int) -> None:
    print(f"rank {os.environ['RANK']}: {before} threads before ftmem, {threads()} after its end", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--elements", type=int, default=1000, help="of the one tensor each step saves")
    p.add_argument("--end", choices=ENDS, default="return")
    p.add_argument("--end-of-rank", action="append", default=[], type=end_of_rank, metavar="R=WAY",
                   help="rank R ends this way instead of --end's (repeatable)")
    p.add_argument("--end-after", default=None,
                   help="a rank named by --end-of-rank ends only once this file exists (at most 10 minutes)")
    p.add_argument("--persist", default=None)
    p.add_argument("--persist-interval", type=int, default=1)
    p.add_argument("--persist-fsync", choices=("on", "off"), default="on", help='the tier\'s "fsync" key')
    p.add_argument("--persist-keep", type=int, default=None, help="checkpoints the tier keeps (default: all)")
    p.add_argument("--no-failure-detection", action="store_true",
                   help="no failure detector (it would end the others when a test stops a rank)")
    p.add_argument("--destroys-group", action="store_true")
    p.add_argument("--load-version", type=int, default=None,
                   help="resume from this version, named (AdapterRuntime.plan_resume's named), not the newest")
    p.add_argument("--ranks-per-node", type=int, default=1, help="with all ranks on one node, no parity (m=0)")
    p.add_argument("--runtimes", type=int, default=1)
    p.add_argument("--restore-into", choices=("rank-0", "every-rank"), default=None)
    p.add_argument("--load-while-saving", action="store_true")
    p.add_argument("--other-worlds", action="store_true")
    p.add_argument("--dp-collective-each-save", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # Registered before the runtime, so run after its end (atexit is last in, first out):
    # by then ftmem's gloo threads must be gone, not left for interpreter shutdown.
    atexit.register(report_threads_and_end, threads())
    try:
        train(args, world)
    finally:
        if args.destroys_group:
            dist.destroy_process_group()


def train(args, world: int) -> None:
    one_node = args.ranks_per_node == world
    config = FtmemConfig.from_dict({"ranks_per_node": args.ranks_per_node, "ec": {"k": 1, "m": 0 if one_node else 1},
                                    "shm_dir": os.environ["SHM_DIR"], "persist": {"fsync": args.persist_fsync == "on"},
                                    "failure_detection": {"enabled": not args.no_failure_detection}})
    runtime = AdapterRuntime(config, ParallelLayout.data_parallel(world), TensorFiles(), save_dir=args.out,
                             persist_dir=args.persist, persist_interval=args.persist_interval if args.persist else 0,
                             persist_keep=args.persist_keep)
    others = [AdapterRuntime(config, ParallelLayout.data_parallel(world), TensorFiles(),
                             save_dir=os.path.join(args.out, f"runtime{i}")) for i in range(1, args.runtimes)]
    # Where this rank reads the persistent tier's newest checkpoint: DISK_VIEW, a copy of
    # it as a node whose file system cache is behind sees it, else the tier itself.
    view = os.environ.get("DISK_VIEW", args.persist)
    on_disk = flushed(view)[-1]["version"] if view and flushed(view) else None
    own = torch.zeros(args.elements) if args.restore_into == "every-rank" or (args.restore_into and dist.get_rank() == 0) else None
    # A version named is that version or a refusal: no disk to fall back to.
    disk = DiskCheckpoint(on_disk, view) if on_disk is not None and args.load_version is None else None
    plan = runtime.plan_resume(disk,
                               OtherWorlds(refuse=lambda layout: None) if args.other_worlds else None,
                               named=args.load_version)
    into = {"w": own} if own is not None and plan.chosen is not None else None
    resumption = runtime.restore(plan, into=into)
    start = 1
    if resumption.adopted is not None:
        adopted = resumption.adopted
        runtime.resumed(resumption)
        start = adopted.version + 1
        values = sorted({v for state in adopted.states for v in state["w"].tolist()})
        print(f"rank {dist.get_rank()}: adopted version {adopted.version} of {len(adopted.states)} old ranks: "
              f"w = {values}", flush=True)
    elif resumption.source == MEMORY:
        runtime.resumed(resumption)
        start = resumption.restored.version + 1
        w = resumption.restored.state["w"]
        print(f"rank {dist.get_rank()}: restored w = {sorted(set(w.tolist()))} x {w.numel()} into "
              f"{'its own tensor' if w is own else 'new memory'}", flush=True)
    elif resumption.source == DISK:  # the state of a step is the step: nothing to read
        start = on_disk + 1
    elif args.other_worlds:  # as an adapter does: no fresh start in place of what memory held
        runtime.resumed(resumption)
    print(f"rank {dist.get_rank()}: resumes at step {start} ({resumption.source})", flush=True)
    for step in range(start, args.steps + 1):
        w = torch.full((args.elements,), float(step))  # the same on every rank: each snapshots half (DP sharding)
        for each in [runtime, *others]:
            each.save({"w": w}, step, replicated=lambda t: t is w)
            if args.dp_collective_each_save:
                dp_collective(each, step, args.persist)
            if not (args.load_while_saving and step == args.steps):
                each.wait_flushed()  # every version protected, and each interval-th on disk with --persist
    print(f"rank {dist.get_rank()}: trained to step {args.steps}", flush=True)
    if args.load_while_saving:
        load_while_saving(runtime)
    own = dict(args.end_of_rank).get(dist.get_rank())
    if own is not None and args.end_after:
        deadline = time.monotonic() + 600
        while not os.path.exists(args.end_after) and time.monotonic() < deadline:
            time.sleep(0.05)
    end(own or args.end, runtime)


def end(way: str, runtime: AdapterRuntime) -> None:
    rank = dist.get_rank()
    print(f"rank {rank}: ends with {way}", flush=True)
    if way.startswith("exit"):
        sys.exit(int(way[len("exit"):]))
    if way == "builtin-exit42":
        exit(42)  # site's Quitter, as a script typed at a prompt calls it
    if way == "raise":
        raise RuntimeError("the training script failed")
    if way == "close":
        runtime.close(job_finished=False)
    if way == "hang":
        signal.pause()
    if way == "store-get":  # as a framework waits on the store for a key a slow rank has not set yet
        dist.distributed_c10d._get_default_store().get("lifecycle_job/never-set")
    if way == "thread-exit3":
        thread = threading.Thread(target=sys.exit, args=(3,), name="exits-by-itself")
        thread.start()
        thread.join()
        print(f"rank {rank}: a thread of its own called sys.exit(3) and ended", flush=True)


def dp_collective(runtime: AdapterRuntime, step: int, persist: str) -> None:
    rank = dist.get_rank()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not any(c["version"] == step for c in flushed(persist)):
            if time.monotonic() > deadline:
                sys.exit(f"rank 1: the flush of step {step} was not on disk within 60 s")
            time.sleep(0.05)
    summed = torch.tensor([step * 10 + rank])
    dist.all_reduce(summed, group=runtime.dp_group)
    print(f"rank {rank}: step {step}'s all-reduce on the DP group: {summed.item()}", flush=True)


def load_while_saving(runtime: AdapterRuntime) -> None:
    rank = dist.get_rank()
    if rank == 1:
        runtime.wait_reusable()
        time.sleep(2)  # its save thread commits a few bytes and waits in the job-wide agreement meanwhile
    print(f"rank {rank}: loading while saving", flush=True)
    resumption = runtime.restore(runtime.plan_resume())
    w = resumption.restored.state["w"]
    runtime.resumed(resumption)
    print(f"rank {rank}: loaded version {resumption.restored.version}: w = {sorted(set(w.tolist()))} x {w.numel()}",
          flush=True)


if __name__ == "__main__":
    main()
