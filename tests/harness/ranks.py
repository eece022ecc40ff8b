"""Starting a job's ranks as local processes, one per rank, so that single ranks can be
SIGKILLed and the job restarted: what torchrun does, minus its restart policy.

A rank is forked from a fork server (tests/harness/zygote.py) that has imported its
framework already (torch, and DeepSpeed or megatron-core; never both, since importing one
changes what the other's run sees: megatron-core admits ``argparse.Namespace`` to torch's
``weights_only`` loading). One server per framework and environment of imports
(``PYTHONPATH``, torch's backend autoload, threads), started with that environment, so that
a rank finds what a cold ``python -m`` would have imported. A server whose ``PYTHONPATH``
brings the framework's own tree (Megatron-LM's, a patched DeepSpeed) imports it from there;
one whose path may change the framework otherwise imports only torch and numpy ahead. A rank
where CUDA is present starts cold. Either way it is a real process, killed for real.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Optional, Sequence

from examples import launch

#: the repository's root: ranks run from it, as ``python -m`` of its modules
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: what every rank gets (OMP_NUM_THREADS is read at torch's import: its server is started with it too)
RANK_ENV = launch.RANK_ENV
free_port, wait_until = launch.free_port, launch.wait_until
# Read while torch and DeepSpeed are imported: each set of their values has its server.
# DeepSpeed picks its accelerator at import; a server's is the CPU, which is also what a
# rank on a machine without CUDA finds by itself (a rank asking for another starts cold).
_IMPORT_ENV = ("PYTHONPATH", "PYTHONHOME", "TORCH_DEVICE_BACKEND_AUTOLOAD", "OMP_NUM_THREADS")


def _import_env(env: dict) -> tuple:
    return tuple(env.get(name) for name in _IMPORT_ENV)


class _ForkServer:
    """A fork server for ranks of one environment of imports, and what it reports: the
    pid of each child it forked (in order) and the exit code of each that ended."""

    def __init__(self, imports: tuple, framework: str):
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        for name, value in zip(_IMPORT_ENV, imports):
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        preload = _preload_for(framework, env.get("PYTHONPATH"))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.harness.zygote", preload], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._changed = threading.Condition()
        self._forked: list[int] = []
        self._codes: dict[int, int] = {}
        self._lock = threading.Lock()  # one request and its pid at a time
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "code" in message:
                    self._codes[message["pid"]] = message["code"]
                else:
                    # A pid the kernel gave again (pids wrap at pid_max within a suite's run): the
                    # code of the child that had it before is not this one's. The server reports
                    # that code before this fork (it reaps, then reports, and only then is the pid free).
                    self._codes.pop(message["pid"], None)
                    self._forked.append(message["pid"])
                self._changed.notify_all()
        with self._changed:  # the server is gone: no more reports
            self._changed.notify_all()

    def fork(self, module: str, args: Sequence[str], env: dict, log: str) -> int:
        request = {"module": module, "args": list(args), "env": env, "cwd": os.getcwd(), "log": log}
        with self._lock, self._changed:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self._changed.wait_for(lambda: self._forked or self.proc.poll() is not None, timeout=60):
                raise TimeoutError("the rank fork server (tests/harness/zygote.py) did not fork within 60 s")
            if not self._forked:
                raise RuntimeError(f"the rank fork server exited with {self.proc.returncode}")
            return self._forked.pop(0)

    def kill(self, pid: int) -> None:
        """SIGKILL child ``pid`` unless it has ended (the server knows; this side may not yet)."""
        if self.proc.poll() is not None:  # the server ended, and killed its children first
            return
        with self._lock:
            self.proc.stdin.write(json.dumps({"kill": pid}) + "\n")
            self.proc.stdin.flush()

    def code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self.proc.poll() is not None, timeout=timeout)
            return self._codes.get(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills the children left and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_servers: dict[tuple, _ForkServer] = {}
_servers_lock = threading.Lock()


def _framework_of(module: str) -> str:
    """Which framework the rank module ``module`` runs (the fork server's preload)."""
    if "megatron" in module:
        return "megatron"
    if "deepspeed" in module or module == "stock_load":
        return "deepspeed"
    return "torch"


def _preload_for(framework: str, pythonpath: Optional[str]) -> str:
    """What a server preloads: its framework, from the interpreter's packages, or from the
    server's ``PYTHONPATH`` where that path brings the framework's package itself (a
    Megatron-LM tree: the server imports it from the same path as the rank would, Megatron-LM's
    training package included). A path that may change what the interpreter's own framework does
    on import (a ``sitecustomize``, a patch) gets torch alone."""
    if pythonpath is None:
        return framework
    package, preload = {"megatron": (("megatron", "training"), "megatron-lm"),
                        "deepspeed": (("deepspeed",), "deepspeed")}.get(framework, ((), "torch"))
    if package and any(os.path.isdir(os.path.join(entry, *package)) for entry in pythonpath.split(os.pathsep)):
        return preload
    return "torch"


def _fork_server(module: str, env: dict) -> Optional[_ForkServer]:
    """The server for a rank running ``module`` with ``env``; None where the rank must start
    cold (CUDA present: its accelerator is chosen at import; or another accelerator asked for)."""
    import torch

    if torch.cuda.is_available() or env.get("DS_ACCELERATOR", "cpu") != "cpu":
        return None
    key = (_import_env(env), _framework_of(module))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _servers[key] = _ForkServer(*key)
        return server


def stop_fork_servers() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


class ForkedRank:
    """A rank forked by the fork server, as ``subprocess.Popen`` would show it."""

    def __init__(self, server: _ForkServer, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.code(self.pid, timeout)
        if self.returncode is None and self.server.proc.poll() is not None:
            raise RuntimeError(f"the fork server that started rank pid {self.pid} exited "
                               f"({self.server.proc.returncode}) before the rank's end was reported")
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """As a scheduler sends it (SIGTERM: a preemption), to a rank that still runs."""
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        # Through the server: a rank may end, and be reaped, between a poll here and a kill
        # here (its report still on the way), and its pid be another process's by then.
        if self.poll() is None:
            self.server.kill(self.pid)


#: every rank started here, so that a harness cut short (a test past its time limit) can end those left
_started: list = []


def kill_ranks_left_running() -> None:
    """SIGKILL every rank started here that still runs, and reap it."""
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _started.clear()


def start_rank(module: str, args: Sequence[str], env: dict, log_path: str, wrapper: Sequence[str] = ()):
    """One rank running ``python -m <module> <args>`` with ``env``, its output appended to
    ``log_path``: forked by the server of its imports, or started cold (:func:`_fork_server`),
    always so under a ``wrapper`` command (``prlimit --nofile=...``, say)."""
    # The log exists once the rank is started, as a cold start's does (its parent opens it):
    # a test may read it before the forked child has opened it for itself.
    open(log_path, "ab").close()
    server = None if wrapper else _fork_server(module, env)
    if server is not None:
        proc = ForkedRank(server, server.fork(module, args, env, log_path))
    else:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*wrapper, sys.executable, "-m", module, *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    _started.append(proc)
    return proc


class LocalJob(launch.LocalJob):
    """The job of examples/launch.py, its ranks forked by the fork server of their imports
    (:func:`start_rank`) and ended with the test (:func:`kill_ranks_left_running`); each under
    the command ``wrapper`` where the class has one."""

    wrapper: Sequence[str] = ()

    def start_rank(self, module: str, args: Sequence[str], env: dict, log_path: str):
        return start_rank(module, args, env, log_path, self.wrapper)


def script_outputs(script: str, args: Sequence[Sequence[str]], timeout: float, env: Optional[dict] = None) -> list:
    """What each of the processes running ``python -c script *args[i]`` printed (its output and
    errors, with the repository as working directory), once all ended; each one still running
    after ``timeout`` is killed."""
    procs = [subprocess.Popen([sys.executable, "-c", script, *each], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for each in args]
    try:
        return [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
