"""``ftmem bench recovery``: from a failure to training again, end to end, with ftmem and with
the framework's default engine restoring from its files.

Three hosts (benchmarks/cluster.py: a network namespace and a /dev/shm each), one rank each,
each under a torchrun agent (``--nnodes 2:3 --max-restarts 1``, the c10d rendezvous on host 0).
A small GPT (DeepSpeed ZeRO-1, or megatron-core) saves every iteration; at iteration ``--at``
host 2 is lost: its processes (agent, rank, SMP) SIGKILLed and its memory deleted, or stopped
with SIGSTOP (a hung host, which raises nothing). It does not come back: the agents of hosts 0
and 1 restart the job on two hosts, which resumes from memory (ftmem's restore onto another
number of nodes, host 2's share rebuilt from parity) or from the page-cached files (the default
engine). DeepSpeed's relaunch loads the model and not the optimizer's moments, since DeepSpeed
refuses those at another DP size; both engines load the same.

The timeline, each mark the last surviving rank's (or agent's), from the failure: the failure
detected (the first survivor's line: ftmem's failure detector, or the training's collective
failing on a reset connection), the old ranks ended, the agents' rendezvous done, the new ranks
started, the framework imported, the process group made, the framework initialized (ftmem's
engine made within it), the checkpoint restored, the first step done. A hung host under the
default engine is not waited for: its survivors sit in the training's collective until gloo's
timeout (30 minutes; NCCL's is 10), which the output states, and the rest of its path is the
killed host's.

Each rank prints its marks (``TIMELINE``) from wrappers around the framework's entry points that
this module installs before the trainer runs (``--worker``); the agents' rendezvous comes from
their own log lines, and the end of the old ranks from /proc.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Optional

from benchmarks.cluster import Cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS, LOST = 3, 2  # host 0 runs the rendezvous: another one is lost
AT = 10  # the iteration at which the host is lost
DETECT_S = 10  # the failure detector's timeout in this benchmark (the default is 60 s)
LAST_CALL_S = 3  # the rendezvous's wait for more hosts once the fewest it takes (2) joined
GLOO_TIMEOUT_S = 1800
MARK = "TIMELINE "
MARKS = ("started", "imported", "process_group", "initialized", "restored", "step")
# Lines that show a survivor noticed the failure: the failure detector's, or the training's
# collective failing on the connection a kill reset.
DETECTED = re.compile(r"has not answered for|Connection reset by peer|Connection closed by peer")
RENDEZVOUS = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Rendezvous complete for workers", re.MULTILINE)
FRAMEWORKS = ("deepspeed", "megatron")
GPT = {"hidden": 64, "layers": 2, "seq_len": 32}


# -- the ranks: the trainers, with marks ---------------------------------------------------
def _mark(name: str, at: Optional[float] = None) -> None:
    print(f"{MARK}pid={os.getpid()} {name}={time.time() if at is None else at:.3f}", flush=True)


def _process_start() -> float:
    """When this process started (wall clock): its start in clock ticks after boot, from /proc."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    for _ in range(5):  # the two clocks read together: a pair that a preemption split is read again
        booted, now, booted_after = (time.clock_gettime(time.CLOCK_BOOTTIME), time.time(),
                                     time.clock_gettime(time.CLOCK_BOOTTIME))
        if booted_after - booted < 1e-3:
            break
    return now - (booted - ticks / os.sysconf("SC_CLK_TCK"))


def _marked(owner, name: str, before: Optional[str] = None, after: Optional[str] = None) -> None:
    """Wrap ``owner.name`` to print the mark ``before`` it runs and ``after`` it returns."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before:
            _mark(before)
        result = original(*args, **kwargs)
        if after:
            _mark(after)
        return result

    setattr(owner, name, wrapper)


def worker(framework: str, argv: list[str]) -> None:
    """One rank: the trainer of ``framework`` with ``argv``, its entry points marked."""
    _mark("started", _process_start())
    if framework == "deepspeed":
        if "--checkpoint-engine" not in argv:  # (ftmem's; the default engine's run names it)
            import ftmem_deepspeed  # noqa: F401  (as the trainer does, before DeepSpeed)
        import deepspeed
        from deepspeed.runtime.engine import DeepSpeedEngine

        from examples.deepspeed import train_gpt as trainer
        _mark("imported")
        _marked(deepspeed, "init_distributed", after="process_group")
        _marked(deepspeed, "initialize", after="initialized")
        _marked(DeepSpeedEngine, "load_checkpoint", after="restored")
        _marked(DeepSpeedEngine, "step", after="step")
    else:
        import megatron.core  # noqa: F401

        from examples.megatron import pretrain_gpt as trainer
        _mark("imported")
        _marked(trainer, "initialize", after="process_group")
        _marked(trainer, "build_optimizer", after="initialized")
        _marked(trainer, "train", before="restored")
        _marked(trainer, "train_step", after="step")
    trainer.main(argv)


# -- the benchmark --------------------------------------------------------------------------
def deepspeed_config(work: str, ftmem: bool) -> str:
    """ZeRO-1 whose checkpoints load onto another DP size (``elastic_checkpoint``), torch's
    AdamW (no DeepSpeed op to build), a save every iteration."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 1, "elastic_checkpoint": True}}
    if ftmem:
        config["checkpoint"] = {"engine": "ftmem"}
        config["ftmem"] = {"ranks_per_node": 1, "failure_detection": {"timeout_s": DETECT_S}}
    path = os.path.join(work, f"deepspeed-{'ftmem' if ftmem else 'default'}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def trainer_args(framework: str, ftmem: bool, work: str, save: str) -> list[str]:
    if framework == "deepspeed":
        return ["--deepspeed-config", deepspeed_config(work, ftmem), "--save-dir", save, "--iters", "100000",
                "--hidden", str(GPT["hidden"]), "--layers", str(GPT["layers"]), "--seq-len", str(GPT["seq_len"]),
                "--load", "--no-optimizer-states", *([] if ftmem else ["--checkpoint-engine", "default"])]
    args = ["--num-layers", str(GPT["layers"]), "--hidden-size", str(GPT["hidden"]), "--num-attention-heads", "4",
            "--seq-length", str(GPT["seq_len"]), "--max-position-embeddings", str(GPT["seq_len"]),
            "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "100000",
            "--lr", "1e-3", "--mock-data", "--seed", "7", "--save", save, "--load", save]
    if ftmem:
        return args + ["--save-interval", "100000", "--non-persistent-ckpt-type", "in_memory",
                       "--non-persistent-save-interval", "1", "--ftmem-ranks-per-node", "1",
                       "--ftmem-failure-detection-timeout-s", str(DETECT_S)]
    return args + ["--save-interval", "1"]


class Run:
    """One job under torchrun agents on every host, and the marks it printed."""

    def __init__(self, cluster: Cluster, framework: str, ftmem: bool, work: str, name: str, port: int):
        self.cluster, self.log_dir = cluster, os.path.join(work, name)
        os.makedirs(self.log_dir)
        save = os.path.join(self.log_dir, "ckpt")
        env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="fabric", FTMEM_SOCKET_IFNAME="front",
                   OMP_NUM_THREADS="1", LOGLEVEL="INFO", PYTHONPATH=os.environ.get("XTRA", "") + REPO,
                   # torchrun shares its rendezvous store with the ranks by default, and a restarted
                   # gloo group then reads the addresses of the attempt before (pytorch/pytorch#135712)
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        env.pop("FTMEM_JOB_ID", None)  # the relaunch on two hosts is another job, derived from the world
        self.agents = []
        for n in range(HOSTS):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{HOSTS - 1}:{HOSTS}",
                    "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{cluster.address(0)}:{port}", "--rdzv-id", name, "--local-addr",
                    cluster.address(n), "--rdzv-conf", f"last_call_timeout={LAST_CALL_S},is_host={int(n == 0)}",
                    "-m", "benchmarks.bench_recovery", "--worker", framework,
                    *trainer_args(framework, ftmem, work, save)]
            self.agents.append(cluster.start(n, argv, env, self.log(n), REPO))

    def log(self, n: int) -> str:
        return os.path.join(self.log_dir, f"host{n}.log")

    def text(self, n: int) -> str:
        with open(self.log(n), errors="replace") as f:
            return f.read()

    def tails(self) -> str:
        return "\n".join(f"--- host {n} ---\n{self.text(n)[-4000:]}" for n in range(HOSTS))

    def marks(self, n: int) -> dict[int, dict[str, list[float]]]:
        """Host n's ranks' marks: by pid, each mark's times."""
        found: dict[int, dict[str, list[float]]] = {}
        for line in self.text(n).splitlines():
            if line.startswith(MARK):
                (_, pid), (name, at) = (kv.split("=", 1) for kv in line[len(MARK):].split())
                found.setdefault(int(pid), {}).setdefault(name, []).append(float(at))
        return found

    def steps(self, n: int) -> int:
        """The iterations host n's rank has done (its first process: the job before any failure)."""
        return len(next(iter(self.marks(n).values()), {}).get("step", []))

    def restarted(self, n: int, after: float) -> Optional[dict[str, list[float]]]:
        """The marks of host n's first rank started after ``after`` that did an iteration (an
        attempt that failed before one is the launcher's time); None until there is one."""
        return next((m for m in self.marks(n).values() if m["started"][0] > after and "step" in m), None)

    def wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f} s:\n{self.tails()}")
            if any(a.poll() is not None for n, a in enumerate(self.agents) if n != LOST):
                raise RuntimeError(f"an agent ended before {what}:\n{self.tails()}")
            time.sleep(0.05)

    def workers(self, n: int) -> list[int]:
        """The pids of host n's ranks that run now (those of the benchmark's worker, not the agent)."""
        pids = []
        for pid in self.cluster._pids_in(n):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"--worker" in args and b"torch.distributed.run" not in args:
                pids.append(pid)
        return pids



def rendezvous_after(log: str, t: float) -> Optional[float]:
    """When the agent whose ``log`` this is (torchrun's, at LOGLEVEL=INFO: its lines carry the
    local time) first completed a rendezvous after ``t``; None if it has not."""
    year = datetime.fromtimestamp(t).year
    for mmdd, hms in RENDEZVOUS.findall(log):
        at = datetime.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()
        if at > t:
            return at
    return None


def lose(cluster: Cluster, how: str) -> float:
    """Lose host LOST: ``killed`` (its processes SIGKILLed, its memory deleted) or ``hung`` (its
    processes stopped); the moment it happened."""
    pids = cluster._pids_in(LOST)
    at = time.time()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        except ProcessLookupError:
            pass
    if how == "killed":
        cluster.lose(LOST)
    return at


def recover(cluster: Cluster, framework: str, ftmem: bool, how: str, work: str, port: int) -> dict:
    """One run: train to AT, lose the host, follow the survivors to their first step after the
    restore; the timeline in seconds after the failure."""
    survivors = [n for n in range(HOSTS) if n != LOST]
    run = Run(cluster, framework, ftmem, work, f"{framework}-{'ftmem' if ftmem else 'default'}-{how}", port)
    try:
        run.wait(f"iteration {AT}", lambda: all(run.steps(n) >= AT for n in range(HOSTS)), 600)
        old = {n: run.workers(n) for n in survivors}
        failed = lose(cluster, how)
        detected = ended = None
        gloo_wait = not ftmem and how == "hung"
        deadline = time.monotonic() + (DETECT_S + 10 if gloo_wait else 600)
        while ended is None and time.monotonic() < deadline:
            if detected is None and any(DETECTED.search(run.text(n)) for n in survivors):
                detected = time.time()
            if not any(pid in old[n] for n in survivors for pid in run.workers(n)):
                ended = time.time()
            time.sleep(0.02)
        if gloo_wait:
            if ended is not None:
                raise RuntimeError(f"the default engine's survivors ended by themselves:\n{run.tails()}")
            return {"waits_s": GLOO_TIMEOUT_S}
        if ended is None:
            raise TimeoutError(f"the survivors did not end within 600 s:\n{run.tails()}")
        run.wait("the first step after the restart",
                 lambda: all(run.restarted(n, failed) is not None for n in survivors), 600)
        rendezvous = [rendezvous_after(run.text(n), failed) for n in survivors]
        if None in rendezvous:
            raise RuntimeError(f"no agent's rendezvous after the failure in the logs:\n{run.tails()}")
        timeline = {"detected": (detected or ended) - failed, "ended": ended - failed,
                    "rendezvous": max(rendezvous) - failed}
        for name in MARKS:
            timeline[name] = max(run.restarted(n, failed)[name][0] for n in survivors) - failed
        timeline["restored_line"] = restored_line(run.text(0)) if ftmem else None
        timeline["resumed_at"] = resumed_at(run.text(0), framework)
        return timeline
    finally:
        for agent in run.agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        for n in range(HOSTS):
            cluster.kill_host_processes(n)
        cluster.lose(LOST)  # a fresh host for the next run (also ends the stopped one)
        for n in survivors:
            cluster.lose(n)


def restored_line(text: str) -> Optional[str]:
    """What ftmem's restore said on rank 0: the version, the world it came from, what was rebuilt."""
    found = re.findall(r"^ftmem: (restored iteration .*)$", text, re.MULTILINE)
    return found[-1] if found else None


def resumed_at(text: str, framework: str) -> Optional[int]:
    pattern = (r"resuming at step (\d+)" if framework == "deepspeed" else r"starting at iteration (\d+)")
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


SEGMENTS = (  # (key, from mark, to mark, who owns it)
    ("detect", None, "detected", "ftmem's failure detector (hung); gloo's error (killed)"),
    ("end", "detected", "ended", "the ranks' exit"),
    ("launcher", "ended", "started", "torchrun: its monitor, the rendezvous (last call), the spawn"),
    ("import", "started", "imported", "Python, torch and the framework's import"),
    ("process_group", "imported", "process_group", "torch.distributed's rendezvous of the ranks"),
    ("initialize", "process_group", "initialized", "the framework's initialization (ftmem's engine within it)"),
    ("restore", "initialized", "restored", "the checkpoint's load: ftmem's restore, or the default engine's files"),
    ("first_step", "restored", "step", "the first iteration"),
)


def segments(timeline: dict) -> dict:
    at = {None: 0.0, **timeline}
    return {key: at[end] - at[start] for key, start, end, _ in SEGMENTS}


def beat_cost(beats: int = 3000) -> float:
    """Seconds of CPU one heartbeat of the failure detector costs a rank: its three requests
    (add to its counter, read the watched rank's, check for a verdict) to a store that another
    process serves, as the job's store is."""
    import torch.distributed as dist
    from datetime import timedelta

    from examples.launch import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', "
                                                     f"{port}, is_master=True, wait_for_workers=False); time.sleep(600)"])
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        began = time.process_time()
        for _ in range(beats):
            store.add("alive/0", 1), store.add("alive/1", 0), store.check(["verdict"])
        return (time.process_time() - began) / beats
    finally:
        server.kill()
        server.wait()


def bench_recovery(frameworks=FRAMEWORKS, plot: Optional[str] = None, keep: bool = False) -> dict:
    work = tempfile.mkdtemp(prefix="ftmem-bench-recovery-")
    cluster = Cluster(HOSTS, front_mbit=1000, tag=f"ftrec-{os.getpid()}")
    results, port = {}, 29600 + os.getpid() % 1000
    try:
        for framework in frameworks:
            for ftmem, how in ((True, "killed"), (True, "hung"), (False, "killed"), (False, "hung")):
                name = f"{framework}_{'ftmem' if ftmem else 'default'}_{how}"
                print(f"{name}: training to iteration {AT}, then host {LOST} {how}...", flush=True)
                results[name] = recover(cluster, framework, ftmem, how, work, port)
                port += 1
    finally:
        cluster.close()
        if keep:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    figures = report(results, frameworks)
    figures["beat_cpu_us"] = beat_cost() * 1e6
    print(f"the failure detector's cost: {figures['beat_cpu_us']:.0f} us of CPU per beat (three store requests); "
          f"at its default timeout of 60 s a rank beats every 5 s: {figures['beat_cpu_us'] / 5e6:.1e} of a core")
    if plot:
        plot_timelines(results, frameworks, plot)
        print(f"plot: {plot}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


def report(results: dict, frameworks) -> dict:
    """Print the timelines; the RESULT figures."""
    figures = {"detect_timeout_s": float(DETECT_S), "gloo_timeout_s": float(GLOO_TIMEOUT_S)}
    print(f"\n{HOSTS} hosts, host {LOST} lost at iteration {AT} and not back: the job restarts on {HOSTS - 1} "
          f"(torchrun --nnodes {HOSTS - 1}:{HOSTS}, last call {LAST_CALL_S} s); ftmem's failure detector at "
          f"{DETECT_S} s (its default is 60 s). Seconds after the failure:")
    for framework in frameworks:
        for name in (f"{framework}_ftmem_killed", f"{framework}_ftmem_hung", f"{framework}_default_killed"):
            parts = segments(results[name])
            total = results[name]["step"]
            ftmem_owned = parts["restore"] + (parts["detect"] if "ftmem_hung" in name else 0.0)
            rendezvous = results[name]["rendezvous"] - results[name]["ended"]
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + f"; total {total:.2f}"
                  + (f"; ftmem's share {ftmem_owned:.2f} ({ftmem_owned / total:.0%})" if "ftmem" in name else "")
                  + f"; resumed at {results[name]['resumed_at']}; the agents' rendezvous took {rendezvous:.2f} "
                  f"of the launcher's part")
            if results[name].get("restored_line"):
                print(f"    {results[name]['restored_line']}")
            figures.update({f"{name}_{k}_s": v for k, v in parts.items()})
            figures[f"{name}_rendezvous_s"] = rendezvous
            figures[f"{name}_total_s"] = total
            if "ftmem" in name:
                figures[f"{name}_ftmem_share_x"] = ftmem_owned / total
        print(f"  {framework}_default_hung: the survivors were still in the training's collective "
              f"{DETECT_S + 10} s after the host stopped; they wait for gloo's timeout ({GLOO_TIMEOUT_S} s, not waited "
              f"here; NCCL's is 600 s), then take the path above")
        figures[f"{framework}_total_x"] = (results[f"{framework}_default_killed"]["step"]
                                           / results[f"{framework}_ftmem_killed"]["step"])
    return figures


def plot_timelines(results: dict, frameworks, path: str) -> None:
    from benchmarks.plots import pyplot

    plt = pyplot()
    rows = [name for f in frameworks for name in (f"{f}_ftmem_killed", f"{f}_ftmem_hung", f"{f}_default_killed")]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 2))
    colors = plt.get_cmap("tab10")
    for y, name in enumerate(rows):
        left = 0.0
        for i, (key, value) in enumerate(segments(results[name]).items()):
            ax.barh(y, value, left=left, color=colors(i), label=key if y == 0 else None)
            left += value
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the host was lost")
    ax.set_title(f"From a lost host to the first step after the restart ({HOSTS} hosts -> {HOSTS - 1}, detector "
                 f"timeout {DETECT_S} s)\nthe default engine with a hung host first waits for gloo's timeout, "
                 f"{GLOO_TIMEOUT_S} s (not drawn)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(SEGMENTS), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    """``ftmem bench recovery``; with ``--worker FRAMEWORK``, one of its ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2:])
        return 0
    signal.signal(signal.SIGTERM, _interrupted)  # the cluster is removed in a finally, on SIGTERM too
    from ftmem.cli import Parser

    parser = Parser(prog="ftmem bench recovery", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--framework", choices=FRAMEWORKS, action="append",
                        help="deepspeed, megatron (default: both; repeat for several)")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the timelines (needs matplotlib)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (the hosts' logs)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="ignored: every host has its own /dev/shm")
    args = parser.parse_args(argv)
    bench_recovery(tuple(args.framework or FRAMEWORKS), os.path.abspath(args.plot) if args.plot else None, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
