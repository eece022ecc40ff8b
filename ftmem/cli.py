"""The ``ftmem`` command: status, clean, export, bench, demo, survival, plan.

``bench`` and ``demo`` run tools that live in ftmem's source tree beside the library
(``benchmarks/`` and ``examples/``), which the library never imports and the wheel does not
install: they are found through the entry points of group ``ftmem.tools`` (``bench-<name>``
and ``demo``), each a ``main(argv) -> int`` that parses its own flags, in the checkout
ftmem runs from (an editable install).
"""
from __future__ import annotations

import argparse
import dataclasses
import decimal
import json
import os
import pkgutil
import re
import sys
import textwrap
from importlib import metadata
from importlib.metadata import entry_points
from typing import Optional

from ftmem._shm import jobs
from ftmem import capacity
from ftmem._ec import survival
from ftmem.config import (DP_SHARD_CHOICES, FAILURE_TIMEOUT_S, MAX_COUNT, MAX_EC_NODES, MAX_WAIT_S, SHM_DIR_ADVICE,
                          shm_dir_problem)
from ftmem.errors import ConfigError, FtmemError
from ftmem._common import compat
from ftmem._common.identity import check_job_id, job_root
from ftmem._common.units import fmt_bytes


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: what is wrong``, and status 2
    (the usage is a --help away). The tools that ``ftmem bench`` and ``ftmem demo`` run
    parse their flags with it too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message.rstrip('.')} (see {self.prog} --help)\n")


def _number(text: str, kind: type, what: str, ok) -> float:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


# Types of flags, for the parsers of the command and of its tools. Every number has a range:
# a value past it is a typo, and would reach code that takes it as a size or a time.
def positive_int(text: str) -> int:
    return _number(text, int, f"an integer from 1 to {MAX_COUNT:,}", lambda v: 1 <= v <= MAX_COUNT)


def non_negative_int(text: str) -> int:
    return _number(text, int, f"an integer from 0 to {MAX_COUNT:,}", lambda v: 0 <= v <= MAX_COUNT)


def int_in(low: int, high: int):
    """The type of a flag that takes an integer from ``low`` to ``high``."""
    return lambda text: _number(text, int, f"an integer from {low:,} to {high:,}", lambda v: low <= v <= high)


def number_in(low: float, high: float):
    """The type of a flag that takes a number from ``low`` to ``high``."""
    return lambda text: _number(text, float, f"a number from {low:g} to {high:g}", lambda v: low <= v <= high)


# A parameter count: a number, in e-notation or with a K, M, B or T suffix ("70B", "7e9", "350M").
_PARAMS = re.compile(r"(?i)\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*")
_PARAMS_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
MAX_PARAMS = 10**15  # beyond any model; it keeps a typo like 70e99 from making a number of a hundred digits


def params_arg(text: str) -> int:
    match = _PARAMS.fullmatch(text)
    value = decimal.Decimal(match[1]) * _PARAMS_SUFFIX[match[2].lower()] if match else None
    if value is None or not 1 <= value <= MAX_PARAMS or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be a whole number of parameters up to 1e15, as 70000000000, 70e9 or "
                                         f"70B (suffixes K, M, B, T), got {text!r}")
    return int(value)


def shm_dir_arg(text: str) -> str:
    """A directory to keep jobs' shared memory in (for the commands that start jobs)."""
    problem = shm_dir_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}: {SHM_DIR_ADVICE}")
    return text


def existing_dir_arg(text: str) -> str:
    """A shared-memory directory that a command reads or cleans: it must exist."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory: name the shared-memory directory the job "
                                         f"runs in (its \"shm_dir\")")
    return text


def admitted_global_arg(text: str) -> object:
    """A class (or function) named as an UnadmittedType error names it, ``package.module.Name``:
    imported here, since the user's training processes admitted it in their own memory."""
    try:
        return pkgutil.resolve_name(text)
    except (ImportError, AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot import {text!r}: give the name the error printed (module path and "
                                         f"class), and run ftmem where that module imports (its PYTHONPATH)") from None


def job_id_arg(text: str) -> str:
    try:
        return check_job_id(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_status(args) -> int:
    present = jobs.list_jobs(args.shm_dir)
    if args.job and args.job not in present:
        raise FtmemError(f"no job {args.job!r} in {args.shm_dir} (jobs there: {', '.join(present) or 'none'}). "
                         f"Name the shared-memory directory it runs in with --shm-dir.")
    report = jobs.status(args.shm_dir, args.job)
    if args.json:
        print(json.dumps(report))
        return 0
    if not report["jobs"]:
        print(f"no ftmem jobs in {args.shm_dir}")
    for job in report["jobs"]:
        newest, protected = job["newest_held"], job["newest_protected"]
        if newest is None:
            held = "no version held yet"
        elif protected is None:
            held = f"newest version held {newest}, none protected yet"
        else:
            held = f"newest version held {newest}, newest protected {protected}, {newest - protected} behind"
        print(f"job {job['job']}: {held}")
        for n in job["nodes"]:
            # An SMP exits once its ranks are gone for FTMEM_SMP_GRACE_S; the versions stay.
            smp = f"SMP running (pid {n['smp_pid']})" if n["smp_pid"] else "no SMP running (a restart starts one)"
            print(f"  node {n['node']}: ranks {n['ranks']}, {smp}, versions {n['versions'] or 'none'}, "
                  f"protected {'none' if n['protected'] is None else n['protected']}  ({n['path']})")
    return 0


def _cmd_clean(args) -> int:
    present = jobs.list_jobs(args.shm_dir)
    if args.all:
        targets = present
    else:
        job = args.job or os.environ.get("FTMEM_JOB_ID")
        if not job:
            print(f"ftmem clean: name the job with --job J (or --all). Jobs in {args.shm_dir}: "
                  f"{', '.join(present) or 'none'}", file=sys.stderr)
            return 2
        if not os.path.lexists(job_root(args.shm_dir, job)):  # (what is there but no job's, clean refuses)
            raise FtmemError(f"no job {job!r} in {args.shm_dir} (jobs there: {', '.join(present) or 'none'}): nothing "
                             f"was freed. Name the shared-memory directory it runs in with --shm-dir.")
        targets = [job]
    for job in targets:
        freed = jobs.clean(args.shm_dir, job)
        print(f"job {job}: stopped its SMPs and freed {len(freed)} node director{'y' if len(freed) == 1 else 'ies'}")
    return 0


def _cmd_export(args) -> int:
    import torch

    from ftmem._disk.export import export

    torch.serialization.add_safe_globals(args.admit)
    done = export(args.shm_dir, args.job, args.out, args.version, force=args.force)
    print(f"job {args.job}: exported version {done.version} to {done.path}: {done.nbytes / 2**20:.1f} MiB written "
          f"in {done.seconds:.2f} s ({done.nbytes / max(done.seconds, 1e-9) / 1e9:.2f} GB/s)")
    return 0


TOOLS = "ftmem.tools"  # entry-point group of the tools `ftmem bench` and `ftmem demo` run
BENCHES = {
    "save": "blocking and copy time of a save vs torch.save and a memory copy",
    "savecall": "what the save call blocks against the tensors in the state: the core, DeepSpeed's save_checkpoint "
                "and Megatron's in-memory save (2 ranks each), beside torch.save's walk of the state and each "
                "framework's default save",
    "peers": "one GPT through torch.save to /dev/shm, DCP's async_save with its strongest stager, and ftmem: the "
             "save call, the iteration with a save after each, the restore in a process started anew",
    "ec": "coding throughput per core vs a memory copy, time to protection, memory overhead",
    "protect": "save to protected per node as the job grows (N virtual nodes, k = N - m), beside gloo all_to_all "
               "and a memory copy of the same run",
    "megatron": "save blocking and restore time of a megatron-core GPT (TP 2, 2 ranks) vs Megatron-LM's "
                "--ckpt-format torch",
    "deepspeed": "save_checkpoint and load_checkpoint of a DeepSpeed ZeRO-1 GPT (2 ranks) vs DeepSpeed's "
                 "default engine, and the iteration time with a save every step",
    "d2h": "device-to-host GB/s of a save of CUDA tensors into pinned shared memory vs a plain pinned copy (GPU)",
    "overhead": "the iteration time of a megatron-core GPT (about 1.1B parameters, bf16, one GPU) with an in-memory "
                "save after every iteration, against no saves and a torch save after every iteration",
    "scale": "DeepSpeed ZeRO-1 on 3 network-namespace hosts (root), ftmem on a tc-limited network slower than the "
             "step, a save every iteration: step time against no saves and against saves that wait for their "
             "protection, protection lag; then a host lost and the resume checked bitwise",
    "recovery": "a host lost (killed, or hung with SIGSTOP) in a DeepSpeed ZeRO-1 and a megatron-core job under torchrun "
                "on 3 network-namespace hosts (root): the timeline from the failure to the first step after the "
                "restart on the hosts left, against the default engine's restart from its files",
    "control-plane": "the job's TCP store under N simulated ranks (64 to 16,384) running ftmem's own store code: the "
                     "failure detector, the preemption decision, the end vote, group arrivals: requests per second "
                     "at the store, the latency a rank sees, the time from an event to every rank",
    "soak": "a save every iteration for --iters iterations on 3 ranks and nodes: growth of RSS, threads, fds, "
            "sockets and shared memory; the job's memory freed at the end",
}


def _tools() -> dict:
    """The installed tools: entry-point name -> entry point."""
    return {ep.name: ep for ep in entry_points(group=TOOLS)}


def _source_tree() -> Optional[str]:
    """The checkout this ftmem runs from, which holds the tools; None for an installed wheel."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if all(os.path.isdir(os.path.join(root, d)) for d in ("examples", "benchmarks")) else None


def _run_tool(command: str, name: str, argv: list) -> int:
    """Load the tool ``name`` from the source tree and call its ``main(argv)``; one line
    and status 2 if there is none or it cannot be imported."""
    tool, root = _tools().get(name), _source_tree()
    if tool is None or root is None:
        print(f"ftmem {command}: the benchmarks and the demo run from ftmem's source tree (examples/, benchmarks/), "
              f"which this installation does not have: run it from a checkout (pip install -e <checkout>)",
              file=sys.stderr)
        return 2
    if root not in sys.path:  # the tools, and the ranks they start with python -m, import from it
        sys.path.insert(0, root)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    try:
        main = tool.load()
    except ImportError as e:
        print(f"ftmem {command}: cannot load {tool.value} from {root}: {e}", file=sys.stderr)
        return 2
    code = main(list(argv))
    return 0 if code is None else int(code)


def _cmd_bench(args) -> int:
    return _run_tool(f"bench {args.what}", f"bench-{args.what}", args.args)


def _cmd_survival(args) -> int:
    n, k, m = args.nodes, args.k, args.m
    if args.failures is not None:
        ec = survival.ec_survival(n, k, m, args.failures)
        rep = survival.replication_survival(n, m, args.failures)
        if args.json:
            print(json.dumps({"nodes": n, "k": k, "m": m, "failures": args.failures, "ec": float(ec),
                              "replication": float(rep)}))
            return 0
        rows = [(args.failures, ec, rep, *survival.monte_carlo(n, k, m, args.failures, args.trials))]
    else:
        rows = []
        for f in range(min(n, 2 * (m + 1) + 2, survival.MAX_FAILURES) + 1):
            rows.append((f, survival.ec_survival(n, k, m, f), survival.replication_survival(n, m, f),
                         *survival.monte_carlo(n, k, m, f, args.trials)))
    print(f"{n} nodes; erasure coding k={k}, m={m} (memory overhead {survival.ec_overhead(n, k, m):.3f}x of the data) "
          f"against {m + 1} replicas in Gemini's group placement (overhead {m:.3f}x)")
    print(f"{'failures':>8}  {'P(survive) EC':>14}  {'Monte Carlo':>11}  {'P(survive) repl.':>16}  {'Monte Carlo':>11}")
    for f, ec, rep, mc_ec, mc_rep in rows:
        print(f"{f:>8}  {float(ec):>14.9f}  {mc_ec:>11.6f}  {float(rep):>16.9f}  {mc_rep:>11.6f}")
    if args.failures is None:
        lost_ec, lost_rep = survival.loss_per_day(n, k, m, args.node_mtbf_hours, args.window_minutes)
        print(f"node MTBF {args.node_mtbf_hours:g} h, failures within {args.window_minutes:g} min counted as "
              f"simultaneous: P(in-memory version lost per day) EC {lost_ec:.3g}, replication {lost_rep:.3g}")
    return 0


def _sharding(job: capacity.Job) -> str:
    if job.distributed_optimizer:
        return "Megatron's distributed optimizer"
    return f"ZeRO {job.zero}" + (" (or Megatron without the distributed optimizer)" if job.zero == 0 else "")


def _iterations(n: int) -> str:
    return f"{n} iteration{'' if n == 1 else 's'}"


def _cmd_plan(args) -> int:
    job = capacity.Job(params=args.params, dtype=args.dtype, tp=args.tp, pp=args.pp, dp=args.dp,
                       ranks_per_node=args.gpus_per_node, zero=args.zero,
                       distributed_optimizer=args.distributed_optimizer, dp_shard=args.dp_shard)
    schedule = capacity.Schedule(net_gbps=args.net_gbps, step_s=args.step_s, save_interval=args.save_interval,
                                 slots=args.slots)
    plan = capacity.plan(job, schedule, args.k, args.m, args.failure_timeout_s)
    if args.json:
        print(json.dumps(dataclasses.asdict(plan)))
        return 0
    rank = plan.rank
    print(f"{job.params:,} parameters in {job.dtype}, Adam with fp32 moments"
          f"{' and fp32 master weights' if rank.master_weights else ''}; "
          f"TP {job.tp} x PP {job.pp} x DP {job.dp} = {job.world} ranks on {plan.nodes} nodes of "
          f"{job.ranks_per_node}; {_sharding(job)}; DP sharding {'on' if rank.dp_sharded else 'off'}")
    print(f"per version: {rank.params:,} parameters per rank, {fmt_bytes(rank.replicated_bytes)} of state alike on "
          f"its {job.dp} DP replicas and {fmt_bytes(rank.unique_bytes)} its own: ftmem keeps "
          f"{fmt_bytes(rank.kept_bytes)} per rank, {fmt_bytes(plan.node_bytes)} per node")
    print(f"a save every {_iterations(schedule.save_interval)} of {schedule.step_s:g} s; {schedule.slots} data "
          f"versions and {capacity.PARITY_SLOTS} of parity (or copies) kept; {schedule.net_gbps:g} GB/s per node "
          f"each way\n")
    schemes = (plan.ec, plan.replication)
    rows = [("parity (copy) per node, per version", [fmt_bytes(p.redundancy_bytes) for p in schemes]),
            ("host memory per node", [fmt_bytes(p.memory_bytes) for p in schemes]),
            ("sent and received per node, per version", [fmt_bytes(p.sent_bytes) for p in schemes]),
            ("time to protect a version", [f"{p.protect_s:.3g} s" for p in schemes]),
            ("protection lag", [_iterations(p.lag_iterations) for p in schemes])]
    rows += [(f"P(survive {f} node failure{'s' if f > 1 else ''})", [f"{p.survival[f]:.9f}" for p in schemes])
             for f in plan.ec.survival]
    print(f"{'':40}  {f'EC k={plan.k}, m={plan.m}':>16}  {'2x replication':>16}")
    for label, (ec, rep) in rows:
        print(f"{label:40}  {ec:>16}  {rep:>16}")
    load = plan.control_plane
    print(f"\nthe job's store: {load.beats_per_s:,.0f} requests a second from the failure detector's beats (a "
          f"{load.failure_timeout_s:g} s timeout); {load.decision_requests:,} at a preemption and at the job's end, "
          f"over a second or so")
    return 0


def _cmd_demo(args) -> int:
    return _run_tool("demo", "demo", args.args)


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(f"ftmem {metadata.version('ftmem')}\n{compat.installed()}\n")
        parser.exit(0)


def parser() -> Parser:
    """The command's parser: a subcommand each, its flags typed and ranged."""
    top = Parser(prog="ftmem", description="In-memory fault tolerance for training jobs.")
    top.add_argument("--version", action=_Version, help="ftmem's version, and the installed torch, DeepSpeed and "
                     "megatron-core with whether ftmem was tested with them (docs/compatibility.md)")
    sub = top.add_subparsers(dest="command", required=True)
    _add_memory_commands(sub)
    _add_tools(sub)
    _add_survival(sub)
    _add_plan(sub)
    return top


def _add_memory_commands(sub) -> None:
    """status, clean and export: what the jobs' shared memory holds, freed, or written to disk."""

    def add(name: str, help: str, fn) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--shm-dir", default="/dev/shm", type=existing_dir_arg,
                       help="shared-memory directory (default /dev/shm)")
        p.set_defaults(fn=fn)
        return p

    p = add("status", "what each node's SMP holds", _cmd_status)
    p.add_argument("--json", action="store_true", help="one JSON object (see docs/operations.md)")
    p.add_argument("--job", type=job_id_arg, help="only this job")
    p = add("clean", "stop a job's SMPs and free its shared memory", _cmd_clean)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--job", type=job_id_arg, help="the job (default: FTMEM_JOB_ID)")
    which.add_argument("--all", action="store_true", help="every ftmem job in the shared-memory directory")
    p = add("export", "write a held version to disk in the framework's own checkpoint layout", _cmd_export)
    p.add_argument("--job", type=job_id_arg, required=True, help="the job (see ftmem status)")
    p.add_argument("--version", type=non_negative_int, help="the version (default: the newest every rank holds)")
    p.add_argument("--out", required=True, help="directory to write the checkpoint into (DeepSpeed: the tag's "
                                                 "directory and latest; Megatron: iter_XXXXXXX and its tracker)")
    p.add_argument("--force", action="store_true", help="replace the checkpoint directory and the pointer file "
                                                        "if --out already holds them (refused otherwise)")
    p.add_argument("--admit", metavar="MODULE.NAME", type=admitted_global_arg, action="append", default=[],
                   help="a type of the job's state that its processes admitted with torch.serialization."
                        "add_safe_globals; admit it here too (repeatable)")


def _add_tools(sub) -> None:
    """bench and demo, which run the tools of the checkout ftmem runs from."""
    installed = _tools()
    benches = dict(BENCHES, **{name[len("bench-"):]: f"({ep.value})" for name, ep in installed.items()
                               if name.startswith("bench-") and name[len("bench-"):] not in BENCHES})
    listing = "\n".join(textwrap.fill(text + ("" if f"bench-{name}" in installed else " [not installed]"), 100,
                                       initial_indent=f"  {name:10s} ", subsequent_indent=" " * 13)
                         for name, text in benches.items())
    p = sub.add_parser("bench", help="benchmarks; each ends with a RESULT line",
                       description="Benchmarks; each ends with one line RESULT key=value ... Every benchmark takes "
                                   "--shm-dir DIR (default /dev/shm) and its own flags: ftmem bench NAME --help.",
                       epilog="benchmarks:\n" + listing, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", metavar="NAME", choices=list(benches), help=", ".join(benches))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's flags")
    p.set_defaults(fn=_cmd_bench)
    # The demo parses its own flags (--shm-dir DIR): with no option prefix here, every
    # argument after "demo", --help included, is handed to it.
    p = sub.add_parser("demo", help="train, SIGKILL every rank, lose a node, restore from memory, compare with an "
                                    "uninterrupted run [--shm-dir DIR]", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=_cmd_demo)


def _add_survival(sub) -> None:
    p = sub.add_parser("survival", help="probability that a version survives F random node failures, EC vs replication")
    p.add_argument("--nodes", type=int_in(1, survival.MAX_NODES), required=True,
                   help=f"at most {survival.MAX_NODES:,}")
    p.add_argument("--k", type=int_in(1, MAX_EC_NODES - 1), required=True)
    p.add_argument("--m", type=int_in(0, MAX_EC_NODES - 1), required=True)
    p.add_argument("--failures", type=int_in(0, survival.MAX_FAILURES),
                   help=f"simultaneous node failures, at most {survival.MAX_FAILURES} (default: a table over F)")
    p.add_argument("--json", action="store_true", help="one JSON object (needs --failures)")
    p.add_argument("--trials", type=int_in(1, survival.MAX_DRAWS), default=100_000,
                   help=f"Monte Carlo trials for the cross-check (trials x failures at most {survival.MAX_DRAWS:,})")
    p.add_argument("--node-mtbf-hours", type=number_in(1e-3, 1e9), default=10_000.0,
                   help="mean time between failures of one node")
    p.add_argument("--window-minutes", type=number_in(1e-3, 1e7), default=10.0,
                   help="time to replace a node and re-protect")
    p.set_defaults(fn=_cmd_survival)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="memory, time to protect, lag and survival for a model on a cluster, EC vs 2x "
                                    "replication", description="Plan ftmem's memory and protection for a model on a "
                                    "cluster, beside 2x replication (see docs/operations.md).")
    p.add_argument("--params", type=params_arg, required=True, help="the model's parameters: 70000000000, 70e9, 70B")
    p.add_argument("--dtype", choices=list(capacity.PARAM_BYTES), default="bf16",
                   help="the parameters' dtype (default bf16); Adam's moments are fp32")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=positive_int, required=True, help="data-parallel size")
    p.add_argument("--gpus-per-node", type=positive_int, required=True, help="ranks per node")
    p.add_argument("--zero", type=int, choices=capacity.ZERO_STAGES, default=0,
                   help="DeepSpeed's ZeRO stage (default 0; Megatron without the distributed optimizer is 0)")
    p.add_argument("--distributed-optimizer", action="store_true", help="Megatron's distributed optimizer")
    p.add_argument("--k", type=int_in(1, MAX_EC_NODES - 1),
                   help="EC data nodes per group (with --m; default: ftmem's, k=min(2, N-1))")
    p.add_argument("--m", type=int_in(0, MAX_EC_NODES - 1), help="EC parity nodes per group (with --k; default 1)")
    # From a slow Ethernet's 10 Mb/s to far past any NIC; from a millisecond to a day and a half.
    p.add_argument("--net-gbps", type=number_in(1e-3, 1e4), required=True,
                   help="network GB/s per node, each way (100 Gb/s is 12.5)")
    p.add_argument("--step-s", type=number_in(1e-3, 1e5), required=True, help="seconds per iteration")
    p.add_argument("--save-interval", type=positive_int, default=1, help="iterations between saves (default 1)")
    p.add_argument("--slots", type=int, choices=capacity.SLOT_CHOICES, default=3,
                   help="data versions kept per rank, as the \"slots\" key (default 3; with 2 the saves made "
                        "during a protection are skipped)")
    p.add_argument("--dp-shard", choices=DP_SHARD_CHOICES, default="auto",
                   help="as the \"dp_shard\" config key (default auto: on with more than one DP replica)")
    p.add_argument("--failure-timeout-s", type=number_in(1, MAX_WAIT_S), default=FAILURE_TIMEOUT_S,
                   help=f"the failure detector's timeout, as \"ftmem.failure_detection\" sets it (default "
                        f"{FAILURE_TIMEOUT_S}): the load of its beats on the job's store")
    p.add_argument("--json", action="store_true", help="one JSON object (see docs/operations.md)")
    p.set_defaults(fn=_cmd_plan)



def main(argv=None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if getattr(args, "json", False) and args.command == "survival" and args.failures is None:
        top.error("survival --json needs --failures F")
    command = f"{args.command} {args.what}" if args.command == "bench" else args.command
    try:
        return args.fn(args)
    except FtmemError as e:  # what ftmem refuses, and why
        print(f"ftmem {command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave that does not work (a tool's included)
        where = f" ({e.filename})" if e.filename else ""
        print(f"ftmem {command}: {e.strerror or e}{where}: check the paths given and their permissions",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
