"""The ``ftmem`` command: status, clean, bench, demo."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import jobs


def _cmd_status(args) -> int:
    report = jobs.status(args.shm_dir, args.job)
    if args.json:
        print(json.dumps(report))
        return 0
    if not report["jobs"]:
        print(f"no ftmem jobs in {args.shm_dir}")
    for job in report["jobs"]:
        print(f"job {job['job']}")
        for n in job["nodes"]:
            smp = f"SMP pid {n['smp_pid']}" if n["smp_pid"] else "no SMP running"
            print(f"  node {n['node']}: ranks {n['ranks']}, {smp}, versions {n['versions'] or 'none'}, "
                  f"protected {n['protected']}  ({n['path']})")
    return 0


def _cmd_clean(args) -> int:
    if args.all:
        targets = jobs.list_jobs(args.shm_dir)
    else:
        job = args.job or os.environ.get("FTMEM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
        if not job:
            present = ", ".join(jobs.list_jobs(args.shm_dir)) or "none"
            print(f"ftmem clean: name the job with --job J (or --all). Jobs in {args.shm_dir}: {present}",
                  file=sys.stderr)
            return 2
        targets = [job]
    for job in targets:
        freed = jobs.clean(args.shm_dir, job)
        print(f"job {job}: stopped its SMPs and freed {len(freed)} node director{'y' if len(freed) == 1 else 'ies'}")
    return 0


def _cmd_bench(args) -> int:
    from .bench import bench_save

    bench_save(total_mb=args.mb, repeat=args.repeat, shm_dir=args.shm_dir)
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return 0 if run_demo(shm_dir=args.shm_dir) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ftmem", description="In-memory fault tolerance for training jobs.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, fn) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
        p.set_defaults(fn=fn)
        return p

    p = add("status", "what each node's SMP holds", _cmd_status)
    p.add_argument("--json", action="store_true", help="one JSON object (DESIGN.md §5)")
    p.add_argument("--job", help="only this job")
    p = add("clean", "stop a job's SMPs and free its shared memory", _cmd_clean)
    p.add_argument("--job", help="the job (default: FTMEM_JOB_ID or TORCHELASTIC_RUN_ID)")
    p.add_argument("--all", action="store_true", help="every ftmem job in the shared-memory directory")
    p = add("bench", "benchmarks; each ends with a RESULT line", _cmd_bench)
    p.add_argument("what", choices=["save"], help="save: blocking and copy time of a save vs torch.save and memcpy")
    p.add_argument("--mb", type=int, default=500, help="size of the state in MiB (default 500)")
    p.add_argument("--repeat", type=int, default=5)
    add("demo", "train, SIGKILL a rank, restore from memory, compare with an uninterrupted run", _cmd_demo)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
