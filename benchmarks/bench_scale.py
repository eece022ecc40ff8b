"""``ftmem bench scale`` (or ``python -m benchmarks.bench_scale``; needs root): DeepSpeed
ZeRO-1 saving with ftmem after every iteration on a network slower than the step, then a
node loss. A virtual cluster on this machine (benchmarks/cluster.py): every host a network
namespace with its own /dev/shm, two links each, an unlimited *fabric* for the training's
gloo (GLOO_SOCKET_IFNAME) and a *front-end* that ``tc`` limits for ftmem's groups
(``"network": {"interface": "front"}``), one rank per host, ``ec`` k=2 m=1 on 3 hosts.

It reports the step time without saves and with an ftmem save every iteration (blocks of
steps taking turns, each block with saves ending once its last snapshot is protected,
inside its timer; the target is judged on the steps alone, since a run pays that drain once,
at its end, and both are printed), the same with every save waiting for its protection (what the old
engine did inside the save: the blocking design), how long a protection takes and how
far it lags. Then it loses a host while protection lags (SIGKILL of its rank and its SMP,
its /dev/shm deleted; the other ranks are killed too, their memory kept), restarts the job
on a host with an empty /dev/shm, and checks that the resume from the newest protected
version gives bitwise the losses and final weights of an uninterrupted run with
DeepSpeed's default checkpoint engine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import torch

from benchmarks.bench_deepspeed import zero1_config
from examples.launch import FIGURES, report_figures
from examples.process_end import end_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = 3
EC = {"k": 2, "m": 1}
# ~3.3M parameters; no dropout: a resume restores no RNG state, and the runs are compared bitwise
SHAPE = {"hidden": 256, "layers": 4, "seq_len": 64, "dropout": 0.0}
MICRO_BATCH = 8
FRONT_MBIT = 100
BLOCK_STEPS = 20
BLOCKS = 3
CRASH_AFTER = 12  # steps of the run that loses a host
ITERS = 20  # steps of the runs compared bitwise
KINDS = ("nosave", "ftmem", "blocking")


def _config(ftmem: bool, micro_batch: int) -> dict:
    section = {"ranks_per_node": 1, "shm_dir": "/dev/shm", "ec": dict(EC), "network": {"interface": "front"}}
    return zero1_config(micro_batch, 1e-3, section if ftmem else None)


class ProtectionWatch:
    """Polls the runtime's lag every 10 ms on a thread: when each version became protected."""

    def __init__(self, checkpoint_engine):
        self.checkpoint_engine, self.saved_at, self.protected_at = checkpoint_engine, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        newest = None
        while not self._stop.wait(0.01):
            runtime = self.checkpoint_engine.runtime
            if runtime is None:
                continue
            protected = runtime.lag().newest_protected
            if protected is not None and protected != newest:
                newest = protected
                self.protected_at[protected] = time.perf_counter()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def protect_times(self) -> list[float]:
        """Save call to protected, for each version seen protected."""
        return [at - self.saved_at[v] for v, at in self.protected_at.items() if v in self.saved_at]


def worker(argv=None) -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see examples.deepspeed.train_gpt
    import deepspeed

    import ftmem_deepspeed  # noqa: F401

    from examples.deepspeed.gpt import GPT, GPTConfig, batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", choices=("timing", "crash", "resume", "reference", "ds-resume"), required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--shape", default=json.dumps(SHAPE))
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--block-steps", type=int, default=BLOCK_STEPS)
    parser.add_argument("--crash-after", type=int, default=CRASH_AFTER)
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument("--save-at", type=int, default=None, help="reference: a default checkpoint after this step")
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(**json.loads(args.shape))
    torch.manual_seed(99 + rank)

    def engine_for(ftmem: bool):
        model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(ftmem, args.micro_batch))
        return engine

    def train_step(engine, step) -> float:
        x, y = batch(cfg, step, rank, engine.train_micro_batch_size_per_gpu())
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    if args.mode == "timing":
        # The engine without saves and the one with take turns in blocks of steps, so that
        # load from outside hits them alike; "blocking" is the ftmem engine with every save
        # waiting for its protection. Every block's time counts its own waits: a block of
        # ftmem saves ends when its last snapshot is protected (the drain, also timed apart).
        engines = {"nosave": engine_for(False), "ftmem": engine_for(True)}
        engines["blocking"] = engines["ftmem"]
        ckpt = os.path.join(args.work, "timing-ckpt")
        watch = ProtectionWatch(engines["ftmem"].checkpoint_engine)
        per_step = {kind: [] for kind in KINDS}  # block time / steps, drain included
        steady = {kind: [] for kind in KINDS}  # the steps alone, drain excluded
        cpu = {kind: [] for kind in KINDS}  # the process's CPU seconds (every thread) per step
        drains, trace, save_calls = [], [], []  # trace: (block, kind, step seconds, protection lag in iterations)
        steps = {kind: 0 for kind in KINDS}
        blocking_steps = max(5, args.block_steps // 3)  # a protection each: blocks as long would take minutes
        for block in range(1 + args.blocks):  # block 0 warms up: allocation, first mappings
            for kind in KINDS:
                engine = engines[kind]
                torch.distributed.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                n_steps = blocking_steps if kind == "blocking" else args.block_steps
                for _ in range(n_steps):
                    s0 = time.perf_counter()
                    train_step(engine, steps[kind])
                    steps[kind] += 1
                    lag = None
                    if kind != "nosave":
                        watch.saved_at[engine.global_steps] = c = time.perf_counter()
                        engine.save_checkpoint(ckpt)
                        if kind == "ftmem" and block:
                            save_calls.append(time.perf_counter() - c)
                        if kind == "blocking":
                            engine.checkpoint_engine.wait_protected()  # the old engine's save did this
                        lag = engine.checkpoint_engine.runtime.lag().versions
                    trace.append((block, kind, time.perf_counter() - s0, lag))
                t1 = time.perf_counter()
                if kind != "nosave":
                    engine.checkpoint_engine.wait_protected()
                t2 = time.perf_counter()
                if block:
                    cpu[kind].append((time.process_time() - c0) / n_steps)
                    per_step[kind].append((t2 - t0) / n_steps)
                    steady[kind].append((t1 - t0) / n_steps)
                    if kind == "ftmem":
                        drains.append(t2 - t1)
        watch.stop()
        runtime = engines["ftmem"].checkpoint_engine.runtime
        lag = runtime.lag()
        lags = [t[3] for t in trace if t[1] == "ftmem" and t[0] and t[3] is not None]
        figures = {
            "params": sum(p.numel() for p in engines["nosave"].module.parameters()),
            "state_mb": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk("/dev/shm") for f in fs
                            if ".slot" in f) / 3 / 2**20,
            **{f"{kind}_step_s": statistics.median(per_step[kind]) for kind in KINDS},
            **{f"{kind}_steady_step_s": statistics.median(steady[kind]) for kind in KINDS},
            **{f"{kind}_cpu_s": statistics.median(cpu[kind]) for kind in KINDS},
            "drain_s": statistics.median(drains), "save_call_s": statistics.median(save_calls), "block_steps": args.block_steps, "blocks": args.blocks,
            "protect_s": statistics.median(watch.protect_times()),
            "protect_lag_iters": statistics.median(lags), "protect_lag_max_iters": max(lags),
            "versions_saved": lag.newest_saved, "versions_unprotected": lag.unprotected,
            "trace": trace,
        }
        runtime.close(job_finished=True)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, {k: figures[k] for k in ("protect_s", "nosave_step_s",
                                                                               "ftmem_step_s", "blocking_step_s")})
        if rank == 0:
            # A step is as slow as the slowest rank's; each rank's medians, the worst taken.
            for key in gathered[0]:
                figures[key] = max(g[key] for g in gathered)
            report_figures(figures)
        return

    out = os.path.join(args.work, args.mode)
    os.makedirs(out, exist_ok=True)
    losses = open(os.path.join(out, f"rank{rank}.losses.jsonl"), "w")
    if args.mode == "crash":
        # Saves every step, then stops where it is (protection still behind) to be killed.
        engine = engine_for(True)
        for step in range(args.crash_after):
            train_step(engine, step)
            engine.save_checkpoint(os.path.join(args.work, "ftmem-ckpt"), client_state={"next_step": step + 1})
        lag = engine.checkpoint_engine.runtime.lag()
        print(f"REACHED step {args.crash_after} saved {lag.newest_saved} protected {lag.newest_protected} "
              f"unprotected {lag.unprotected}", flush=True)
        while True:
            time.sleep(3600)
    ftmem = args.mode == "resume"
    engine = engine_for(ftmem)
    save_dir = os.path.join(args.work, "ftmem-ckpt" if ftmem else "default-ckpt")
    start = 0
    if args.mode in ("resume", "ds-resume"):
        path, client_state = engine.load_checkpoint(save_dir, None if ftmem else f"global_step{args.save_at}")
        if path is None:
            raise RuntimeError("nothing to resume from")
        start = client_state["next_step"]
        print(f"RESUMED at step {start}, global step {engine.global_steps}", flush=True)
    for step in range(start, args.iters):
        losses.write(json.dumps({"it": step, "loss": train_step(engine, step).hex()}) + "\n")
        if args.mode == "reference" and step + 1 == args.save_at:
            engine.save_checkpoint(save_dir, client_state={"next_step": step + 1})
    losses.close()
    params = dict(engine.module.named_parameters())
    torch.save({**{k: v.detach().clone() for k, v in params.items()},
                **{k: v.clone() for k, v in engine.module.named_buffers()}}, os.path.join(out, f"rank{rank}.final.pt"))
    if ftmem:
        engine.checkpoint_engine.runtime.close(job_finished=True)
    if rank == 0:
        report_figures({"start": start})


class Job:
    """One rank per host of the cluster, the training's gloo on the fabric."""

    def __init__(self, cluster, args: list[str], work: str, name: str, port: int, env: dict):
        self.cluster, self.log_dir = cluster, os.path.join(work, f"logs-{name}")
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs = []
        for n in range(len(cluster.names)):
            rank_env = dict(os.environ, RANK=str(n), WORLD_SIZE=str(len(cluster.names)), LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="1", MASTER_ADDR=cluster.address(0), MASTER_PORT=str(port),
                            GLOO_SOCKET_IFNAME="fabric", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **env)
            rank_env.pop("FTMEM_SOCKET_IFNAME", None)  # the config's "network" key names ftmem's interface
            self.procs.append(cluster.start(n, [sys.executable, "-m", "benchmarks.bench_scale", "--worker", *args],
                                            rank_env, self.log(n), REPO))

    def log(self, n: int) -> str:
        return os.path.join(self.log_dir, f"rank{n}.log")

    def text(self, n: int) -> str:
        with open(self.log(n), errors="replace") as f:
            return f.read()

    def tails(self) -> str:
        return "\n".join(f"--- rank {n} ---\n{self.text(n)[-3000:]}" for n in range(len(self.procs)))

    def wait(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not finish in {timeout:.0f} s:\n{self.tails()}")
                if any(p.poll() not in (None, 0) for p in self.procs):
                    raise RuntimeError(f"a rank failed:\n{self.tails()}")
                time.sleep(0.1)
        codes = [p.returncode for p in self.procs]
        line = next((ln for ln in self.text(0).splitlines() if ln.startswith(FIGURES)), None)
        if codes != [0] * len(self.procs) or line is None:
            raise RuntimeError(f"the ranks failed (exit codes {codes}):\n{self.tails()}")
        return json.loads(line[len(FIGURES):])

    def wait_for_all(self, marker: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            lines = [next((ln for ln in self.text(n).splitlines() if ln.startswith(marker)), None)
                     for n in range(len(self.procs))]
            if all(lines):
                return lines
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a rank exited before {marker!r}:\n{self.tails()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {marker!r} in {timeout:.0f} s:\n{self.tails()}")
            time.sleep(0.02)


def compare(work: str, run: str, reference: str, start: int, hosts: int) -> list[str]:
    """Where ``run`` (from step ``start``) differs from ``reference``: losses and final weights, bitwise."""
    differences = []
    for n in range(hosts):
        def losses(name):
            with open(os.path.join(work, name, f"rank{n}.losses.jsonl")) as f:
                return {r["it"]: r["loss"] for r in map(json.loads, f)}
        mine, theirs = losses(run), losses(reference)
        for it, loss in mine.items():
            if it < start:
                continue
            if theirs.get(it) != loss:
                differences.append(f"rank {n} step {it}: loss {float.fromhex(loss)!r} vs "
                                   f"{float.fromhex(theirs[it]) if it in theirs else None!r}")
        a = torch.load(os.path.join(work, run, f"rank{n}.final.pt"))
        b = torch.load(os.path.join(work, reference, f"rank{n}.final.pt"))
        differences += [f"rank {n}: final {k} differs" for k in a if k not in b or not torch.equal(a[k], b[k])]
    return differences


def node_loss(cluster, common, work, port, env, hosts, crash_after, iters) -> dict:
    """Lose a host while protection lags; resume; compare bitwise."""
    # 2. a node loss while protection lags: the crash run stops after its last save, at
    # once (its protection still behind), and host `lost` is lost.
    lost = hosts - 1
    crash = Job(cluster, [*common, "--mode", "crash", "--crash-after", str(crash_after)], work, "crash",
                port + 1, env)
    reached = crash.wait_for_all("REACHED", 900)
    killed = cluster.lose(lost)
    for n in range(hosts):  # the job is down: the other ranks too, their SMPs and memory kept
        if crash.procs[n].poll() is None:
            crash.procs[n].kill()
            crash.procs[n].wait()
    t_resume = time.perf_counter()
    resumed = Job(cluster, [*common, "--mode", "resume", "--iters", str(iters)], work, "resume", port + 2,
                  env).wait(900)["start"]
    resume_s = time.perf_counter() - t_resume
    # 3. the uninterrupted run with DeepSpeed's default engine; its own resume where needed
    Job(cluster, [*common, "--mode", "reference", "--iters", str(iters), "--save-at", str(resumed)], work,
        "reference", port + 3, env).wait(900)
    differences = compare(work, "resume", "reference", resumed, hosts)
    reference = "an uninterrupted run with DeepSpeed's default checkpoint engine"
    if differences:
        print("the resume differs from the uninterrupted run:\n  " + "\n  ".join(differences[:10]))
        Job(cluster, [*common, "--mode", "ds-resume", "--iters", str(iters), "--save-at", str(resumed)], work,
            "ds-resume", port + 4, env).wait(900)
        differences = compare(work, "resume", "ds-resume", resumed, hosts)
        reference = f"DeepSpeed's own resume from its own files at step {resumed}"
    return {"reached": reached, "killed": killed, "resumed": resumed, "resume_s": resume_s,
            "differences": differences, "reference": reference, "lost": lost}


def bench_scale(hosts: int = HOSTS, front_mbit: float = FRONT_MBIT, micro_batch: int = MICRO_BATCH,
                shape: dict = SHAPE, blocks: int = BLOCKS, block_steps: int = BLOCK_STEPS,
                crash_after: int = CRASH_AFTER, iters: int = ITERS, plot: str = None, keep: bool = False, loss: bool = True) -> dict:
    from benchmarks.cluster import Cluster

    if hosts != EC["k"] + EC["m"]:
        raise SystemExit(f"the erasure coding here is k={EC['k']} m={EC['m']}: {EC['k'] + EC['m']} hosts")
    work = tempfile.mkdtemp(prefix="ftmem-bench-scale-", dir=os.getcwd())
    # The ranks are SIGKILLed: never in a shared torch extensions directory (a build cut
    # short leaves its lock, on which every later DeepSpeed start waits).
    env = {"TORCH_EXTENSIONS_DIR": os.path.join(work, "torch_extensions"), "FTMEM_COLLECTIVE_TIMEOUT_S": "120"}
    common = ["--work", work, "--shape", json.dumps(shape), "--micro-batch", str(micro_batch)]
    port = 29500 + os.getpid() % 1000
    cluster, loss_result = None, None
    t_start = time.perf_counter()
    try:
        cluster = Cluster(hosts, front_mbit)
        # 1. the iteration times, with and without saves, and the blocking design
        f = Job(cluster, [*common, "--mode", "timing", "--blocks", str(blocks), "--block-steps", str(block_steps)],
                work, "timing", port, env).wait(1800)
        if loss:
            loss_result = node_loss(cluster, common, work, port, env, hosts, crash_after, iters)
    finally:
        if cluster is not None:
            cluster.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    nosave, ftmem, blocking = f["nosave_step_s"], f["ftmem_step_s"], f["blocking_step_s"]
    result = {
        "step_s": nosave, "ftmem_step_s": ftmem, "overhead_pct": (ftmem / nosave - 1) * 100,
        "overhead_x": ftmem / nosave, "ftmem_steady_step_s": f["ftmem_steady_step_s"],
        "steady_overhead_pct": (f["ftmem_steady_step_s"] / f["nosave_steady_step_s"] - 1) * 100,
        "drain_s": f["drain_s"], "save_call_s": f["save_call_s"], "protect_s": f["protect_s"], "protect_steps": f["protect_s"] / f["ftmem_steady_step_s"],
        "protect_lag_iters": f["protect_lag_iters"], "protect_lag_max_iters": f["protect_lag_max_iters"],
        "versions_saved": f["versions_saved"], "versions_unprotected": f["versions_unprotected"],
        "blocking_step_s": blocking, "blocking_overhead_x": blocking / nosave,
        **{f"{kind}_cpu_s": f[f"{kind}_cpu_s"] for kind in KINDS},
    }
    if loss_result:
        result.update({"crash_after_step": crash_after, "resumed_at_step": loss_result["resumed"],
                       "resume_s": loss_result["resume_s"], "bitwise_equal": int(not loss_result["differences"])})
    result["total_s"] = time.perf_counter() - t_start
    print(f"{hosts} hosts (network namespaces, each its own /dev/shm), 1 rank each, ZeRO-1 (CPU, gloo), "
          f"GPT of {f['params'] / 1e6:.1f}M parameters, {f['state_mb']:.0f} MiB of snapshot per rank, ec k={EC['k']} "
          f"m={EC['m']}; the training on the fabric (no limit), ftmem on the front-end (tc: {front_mbit:g} Mbit/s "
          f"each way)")
    print(f"  step without saves             {nosave * 1e3:7.1f} ms")
    steady_pct = result["steady_overhead_pct"]
    print(f"  step with an ftmem save every  {f['ftmem_steady_step_s'] * 1e3:7.1f} ms  ({steady_pct:+.1f}%, target <= +10%: "
          f"{'met' if steady_pct <= 10 else 'not met'}; the steps alone, each version's protection running behind them)")
    print(f"  the drain                      {f['drain_s'] * 1e3:7.1f} ms  (the wait for the last save's protection, which a "
          f"run pays once, at its end; billed here to each {block_steps}-step block, as the kinds take turns: "
          f"{ftmem * 1e3:.1f} ms a step, {result['overhead_pct']:+.1f}%)")
    print(f"  of which save_checkpoint      {f['save_call_s'] * 1e3:7.1f} ms  (median; the training waits for the copy "
          f"of its state into shared memory, not for the protection)")
    print(f"  blocking design                {blocking * 1e3:7.1f} ms  ({blocking / nosave:.2f}x: every save waits for "
          f"its protection, as the old engine's save did; measured in the same run, blocks of "
          f"{max(5, block_steps // 3)} steps with wait_protected() after each save)")
    print("  CPU of a rank's process per step (all its threads): "
          + ", ".join(f"{kind} {f[kind + '_cpu_s'] * 1e3:.0f} ms" for kind in KINDS)
          + f"; load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  protection: {f['protect_s']:.2f} s from save to protected ({result['protect_steps']:.1f} steps with "
          f"saves); "
          f"it ran {f['protect_lag_iters']:g} iteration(s) behind the saves (median, at most "
          f"{f['protect_lag_max_iters']:g}); {f['versions_unprotected']} of {f['versions_saved']} versions "
          f"never protected (replaced by newer saves while a protection ran)")
    if loss_result:
        reached, killed, resumed, resume_s, differences, reference, lost = (loss_result[k] for k in (
            "reached", "killed", "resumed", "resume_s", "differences", "reference", "lost"))
        saved = reached[0].split()
        print(f"  node loss: the ranks stopped after step {crash_after} ({' '.join(saved[2:])}); host {lost} lost "
              f"(SIGKILL of {len(killed)} processes, its rank and its SMP; its /dev/shm deleted), the other ranks "
              f"killed; the job restarted and resumed at step {resumed} (the newest protected version) in "
              f"{resume_s:.1f} s (start included)")
        print(f"  the resume, steps {resumed}..{iters - 1} and the final weights, against {reference}: "
              + ("bitwise equal" if not differences else "DIFFERS:\n    " + "\n    ".join(differences[:10])))
    if plot:
        plot_scale(f["trace"], f["protect_s"], front_mbit, plot)
        print(f"plot: {plot}")
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def plot_scale(trace: list, protect_s: float, front_mbit: float, path: str) -> None:
    """Step time and protection lag over the iterations of rank 0, by kind of block."""
    from benchmarks.plots import pyplot

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    colors = {"nosave": "tab:grey", "ftmem": "tab:blue", "blocking": "tab:red"}
    labels = {"nosave": "no saves", "ftmem": "ftmem save every step",
              "blocking": "every save waits for its protection (old design)"}
    for kind in KINDS:
        points = [(i, t[2], t[3]) for i, t in enumerate(trace) if t[1] == kind]
        top.plot([p[0] for p in points], [p[1] * 1e3 for p in points], ".", color=colors[kind], label=labels[kind],
                 markersize=4)
        if kind == "ftmem":  # each block apart
            for block in sorted({t[0] for t in trace}):
                mine = [(i, t[3]) for i, t in enumerate(trace) if t[1] == kind and t[0] == block]
                bottom.plot([p[0] for p in mine], [p[1] if p[1] is not None else float("nan") for p in mine], ".-",
                            color=colors[kind], markersize=3, linewidth=0.6)
    top.set_ylabel("step time (ms)")
    top.set_yscale("log")
    top.legend(fontsize="small")
    top.set_title(f"rank 0; ftmem's network limited to {front_mbit:g} Mbit/s; protection {protect_s:.2f} s")
    bottom.set_ylabel("protection lag\n(iterations)")
    bottom.set_xlabel("iteration of the benchmark (blocks take turns: no saves, ftmem, blocking)")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    """``ftmem bench scale``; with ``--worker``, one of its ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker(argv)
        end_process()
    signal.signal(signal.SIGTERM, _interrupted)  # the cluster is removed in a finally, on SIGTERM too
    from ftmem.cli import Parser, positive_int

    parser = Parser(prog="ftmem bench scale", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--front-mbit", type=float, default=FRONT_MBIT,
                        help=f"the front-end's limit each way, Mbit/s (default {FRONT_MBIT})")
    parser.add_argument("--micro-batch", type=positive_int, default=MICRO_BATCH,
                        help=f"sequences per rank per step (default {MICRO_BATCH})")
    parser.add_argument("--hidden", type=positive_int, default=SHAPE["hidden"], help="the GPT's width (default 256)")
    parser.add_argument("--layers", type=positive_int, default=SHAPE["layers"], help="its layers (default 4)")
    parser.add_argument("--blocks", type=positive_int, default=BLOCKS, help=f"timed blocks per kind (default {BLOCKS})")
    parser.add_argument("--block-steps", type=positive_int, default=BLOCK_STEPS,
                        help=f"steps per block (default {BLOCK_STEPS})")
    parser.add_argument("--crash-after", type=positive_int, default=CRASH_AFTER)
    parser.add_argument("--iters", type=positive_int, default=ITERS)
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw step time and lag (needs matplotlib)")
    parser.add_argument("--no-loss", action="store_true", help="the iteration times only, no node loss")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, losses, weights)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="ignored: every host has its own /dev/shm")
    args = parser.parse_args(argv)
    if args.iters <= args.crash_after:
        parser.error("--iters must be more than --crash-after")
    shape = dict(SHAPE, hidden=args.hidden, layers=args.layers)
    bench_scale(HOSTS, args.front_mbit, args.micro_batch, shape, args.blocks, args.block_steps, args.crash_after,
                args.iters, os.path.abspath(args.plot) if args.plot else None, args.keep, not args.no_loss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
