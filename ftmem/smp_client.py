"""A rank's connection to its node's SMP, starting the SMP when none runs.

No special launcher is needed: whichever rank of a node gets here first starts the
SMP (under a file lock, so only one starts), under torchrun, the deepspeed launcher
or plain processes alike. If the SMP dies, the next request starts a new one and
retries once: the snapshots live in files that outlive the SMP, and the new SMP
rescans them, so a killed SMP costs a restart, never a version.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection
from typing import Optional

from . import errors
from .procs import cmdline, pid_alive, read_pid
from .slots import unlink_if_present
from .smp import KEY_FILE, LOCK_FILE, LOG_FILE, PID_FILE, read_key, smp_address

SMP_START_TIMEOUT_S = 60.0
NODE_FILE = "node.json"

# Not `-m ftmem.smp`: the package __init__ imports ftmem.smp first, which runpy warns about.
# The command line keeps "ftmem.smp" and the node dir, which is how running_smp() knows it.
_SMP_ENTRY = "import sys; from ftmem.smp import main; main(sys.argv[1:])"

# SMPs this process started; polled so that a killed one does not linger as a zombie.
_spawned: list[subprocess.Popen] = []


def running_smp(node_dir: str) -> Optional[int]:
    """PID of the live SMP serving ``node_dir``, or None."""
    pid = read_pid(os.path.join(node_dir, PID_FILE))
    if pid is None or not pid_alive(pid):
        return None
    args = cmdline(pid)
    if not any("ftmem.smp" in a for a in args) or node_dir not in args:
        return None  # a recycled pid
    return pid


def _log_tail(node_dir: str, lines: int = 15) -> str:
    try:
        with open(os.path.join(node_dir, LOG_FILE), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def ensure_smp(node_dir: str, ranks: list[int]) -> int:
    """Start the node's SMP unless one is running; return its pid."""
    for p in list(_spawned):
        if p.poll() is not None:
            _spawned.remove(p)
    os.makedirs(node_dir, exist_ok=True)
    with open(os.path.join(node_dir, LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = running_smp(node_dir)
        if pid is not None:
            return pid
        key_path = os.path.join(node_dir, KEY_FILE)
        if not os.path.exists(key_path):
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, os.urandom(32))
            os.close(fd)
        with open(os.path.join(node_dir, NODE_FILE), "w") as f:
            json.dump({"ranks": ranks}, f)
        unlink_if_present(os.path.join(node_dir, PID_FILE))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(os.path.join(node_dir, LOG_FILE), "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-c", _SMP_ENTRY, "--node-dir", node_dir,
                 "--ranks", ",".join(map(str, ranks))],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,  # not in the trainers' process group: survives their kill
                close_fds=True, env=env,
            )
        _spawned.append(proc)
        deadline = time.monotonic() + SMP_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if read_pid(os.path.join(node_dir, PID_FILE)) == proc.pid:
                return proc.pid
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        proc.kill()
        raise errors.SmpError(
            f"the SMP for {node_dir} did not start within {SMP_START_TIMEOUT_S:.0f} s "
            f"(exit code {proc.poll()}). Its log:\n{_log_tail(node_dir)}"
        )


class SmpClient:
    """Thread-safe request/reply channel to the node's SMP."""

    def __init__(self, node_dir: str, ranks: list[int]):
        self.node_dir = node_dir
        self.ranks = ranks
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def _connect(self) -> Connection:
        ensure_smp(self.node_dir, self.ranks)
        return Client(smp_address(self.node_dir), family="AF_UNIX", authkey=read_key(self.node_dir))

    def request(self, *msg) -> tuple:
        with self._lock:
            reply = None
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    self._conn.send(msg)
                    reply = self._conn.recv()
                    break
                except (OSError, EOFError) as e:
                    # The SMP went away (killed, or never started): start one and retry once.
                    self._close_conn()
                    if attempt == 1:
                        raise errors.SmpError(
                            f"lost the SMP of {self.node_dir} twice during {msg[0]!r} ({e}). "
                            f"Its log:\n{_log_tail(self.node_dir)}"
                        ) from e
        if reply[0] == "err":
            raise getattr(errors, reply[1], errors.SmpError)(reply[2])
        return reply

    def finish(self, rank: int) -> None:
        """Tell the SMP this rank's job ended cleanly. The last rank of the node waits
        until the SMP has freed the node's memory and exited."""
        pid = running_smp(self.node_dir)
        _, last = self.request("finished", rank)
        deadline = time.monotonic() + SMP_START_TIMEOUT_S
        while last and pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            for p in _spawned:
                p.poll()  # reap it if this process started it
            time.sleep(0.01)

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close_conn()
