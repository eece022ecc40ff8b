"""Start a job's ranks as local processes, one per rank, so that single ranks can be
SIGKILLed and the job restarted: what torchrun does, minus its restart policy, for
``ftmem demo``, the benchmarks and the tests (whose ranks tests/harness/ranks.py forks from a
server that imported the framework already: :meth:`LocalJob.start_rank`)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence


# The ports the kernel hands out by itself: to every bind to port 0 (each gloo group's listener)
# and as the local port of every outgoing connection.
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_PICK = random.SystemRandom()  # not the random module's state, which a test or a job may seed alike


def free_port() -> int:
    """A port nothing listens on, for a job's store, picked below the ephemeral range. A port
    found by binding to port 0 and closed again is an ephemeral one: another job's gloo
    listener, binding to port 0 in the seconds before this job's rank 0 listens there, could
    take it (EADDRINUSE, as a CI run failed). Below the range only another such pick can; each
    candidate is checked by binding it."""
    candidates = _below_ephemeral_range()
    for port in _PICK.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    with socket.socket() as s:  # no ports below the range here: one the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _below_ephemeral_range() -> range:
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return range(0)
    return range(max(1024, low // 2), low)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


# What every rank gets: loopback for gloo, and one thread for the CPU math of a tiny model.
RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


class LocalJob:
    """``world_size`` processes running ``python -m <module> <args>`` as ranks of one job
    (``FTMEM_JOB_ID`` ``job_id``, unless None)."""

    def __init__(self, module: str, args: Sequence[str], world_size: int, job_id: Optional[str],
                 log_dir: str, env: Optional[dict] = None, rank_env: Optional[dict] = None):
        os.makedirs(log_dir, exist_ok=True)
        port = str(free_port())
        self.log_dir = log_dir
        self.procs: list = []
        for rank in range(world_size):
            proc_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                            **RANK_ENV)
            if job_id is not None:
                proc_env["FTMEM_JOB_ID"] = job_id
            proc_env.update(env or {}, **(rank_env or {}).get(rank, {}))
            self.procs.append(self.start_rank(module, args, proc_env, self.log_path(rank)))

    def start_rank(self, module: str, args: Sequence[str], env: dict, log_path: str):
        """One rank's process (anything with ``subprocess.Popen``'s poll, wait and kill), its
        output appended to ``log_path``."""
        with open(log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    @staticmethod
    def read_log(log_dir: str, rank: int) -> str:
        """What a rank printed, across every job started with this log dir."""
        with open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace") as f:
            return f.read()

    def log(self, rank: int) -> str:
        return self.read_log(self.log_dir, rank)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait for ``predicate``; fail at once, with the logs, if a rank exits meanwhile."""
        def ready() -> bool:
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not predicate():
                codes = ", ".join(f"{r}: {self.procs[r].poll()}" for r in dead)
                raise RuntimeError(f"rank(s) {dead} exited (codes {codes}) while waiting for {what}. Logs:\n"
                                   f"{self.tails()}")
            return predicate()
        wait_until(ready, timeout, what)

    def tails(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)[-3000:]}" for r in range(len(self.procs)))

    def kill(self, rank: int) -> None:
        """SIGKILL one rank, as a crash would."""
        if self.procs[rank].poll() is None:
            self.procs[rank].kill()
        self.procs[rank].wait()

    def kill_all(self) -> None:
        for rank in range(len(self.procs)):
            self.kill(rank)

    def wait(self, timeout: float) -> list[int]:
        """Wait for every rank to exit; kill the job and raise if it takes longer."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise TimeoutError(f"job did not finish within {timeout:.0f} s; killed it. Logs:\n{self.tails()}")

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()


FIGURES = "FIGURES "


def report_figures(figures: dict) -> None:
    """A benchmark's rank 0 hands its figures to :func:`run_for_figures`."""
    print(FIGURES + json.dumps(figures), flush=True)


def run_for_figures(module: str, args: Sequence[str], world_size: int, job_id: str, log_dir: str, what: str,
                    timeout: float, env: Optional[dict] = None) -> dict:
    """Run a benchmark's ranks and return the figures its rank 0 reported; raise with
    the ranks' logs if one fails or none were reported."""
    with LocalJob(module, args, world_size, job_id, log_dir, env=env) as ranks:
        codes = ranks.wait(timeout)
    line = next((ln for ln in LocalJob.read_log(log_dir, 0).splitlines() if ln.startswith(FIGURES)), None)
    if codes != [0] * world_size or line is None:
        raise RuntimeError(f"the {what} benchmark failed (exit codes {codes}):\n{ranks.tails()}")
    return json.loads(line[len(FIGURES):])
