"""A rank's connection to its node's SMP, starting the SMP when none runs.

No special launcher is needed: whichever rank of a node gets here first starts the
SMP (under a file lock, so only one starts), under torchrun, the deepspeed launcher
or plain processes alike. If the SMP dies, the next request starts a new one and
retries once: the snapshots live in files that outlive the SMP, so a killed SMP costs
a restart, never a version. An SMP whose key file vanished is restarted with a new key.

Every wait on the SMP is bounded. Connecting, the handshake and each reply must come
within :func:`smp_timeout_s` of silence; the SMP says it is alive while it works on a
long request (:data:`ftmem._shm.smp.BUSY`), so the bound holds whatever the size of the
state. An SMP that falls silent (stopped, hung, starved) raises
:class:`~ftmem.errors.SmpUnresponsive` naming it, and training stops with the reason
instead of stalling without a word.

The directories on the way to the node (``<shm_dir>/ftmem-<uid>/<job>/node<i>``) are
created private (0700) and checked on every connection (:mod:`ftmem._shm.private`): one another
user owns or may write is refused with the reason, never used.

The node directory a client first connected in is its job's. If it vanishes or is
replaced while the job runs (``ftmem clean``), the client raises
:class:`~ftmem.errors.SharedMemoryRemoved` rather than start a new SMP in an empty
directory and let training go on with nothing to restore.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Iterator, Optional

from ftmem import errors
from ftmem.config import seconds_from_env
from ftmem._common.logs import log
from ftmem._shm.private import (check_private_dir, open_private, private_dir, read_private, unlink_if_present,
                      write_atomically, write_new)
from ftmem._shm.procs import cmdline, pid_alive, process_state, read_pid
from ftmem._shm.smp import (BUSY, EXIT_ADDRESS_TAKEN, KEEPALIVE_S, KEY_FILE, LOCK_FILE, LOG_FILE, PID_FILE,
                            bound_waits, node_lock, receive_message, send_message, smp_grace_s, socket_path)

SMP_START_TIMEOUT_S = 60.0
SMP_STOP_TIMEOUT_S = 5.0
# The longest a rank waits for its SMP to say anything (FTMEM_SMP_TIMEOUT_S overrides it).
SMP_TIMEOUT_S = 30.0
SMP_TIMEOUT_ENV = "FTMEM_SMP_TIMEOUT_S"
# The holder of the node's lock may be stopping one SMP and starting the next (plus a margin).
_LOCK_TIMEOUT_S = SMP_STOP_TIMEOUT_S + SMP_START_TIMEOUT_S + 10.0
NODE_FILE = "node.json"

# Not `-m ftmem._shm.smp`: the package __init__ imports ftmem._shm.smp first, which runpy warns about.
# The command line keeps "ftmem._shm.smp" and the node dir, which is how running_smp() knows it.
_SMP_ENTRY = "import sys; from ftmem._shm.smp import main; main(sys.argv[1:])"

# SMPs this process started; polled so that a killed one does not linger as a zombie.
_spawned: list[subprocess.Popen] = []
# How each reaped one ended (pid -> returncode): whichever thread reaps it, the client that
# finds its SMP gone can still say how (one entry per SMP this process started: a handful).
_ended: dict[int, int] = {}
_STATUS_WAIT_S = 2.0  # for the exit status of an SMP found gone, while another thread reaps it


def smp_timeout_s() -> float:
    """How long a rank waits for a word from its SMP: FTMEM_SMP_TIMEOUT_S, else SMP_TIMEOUT_S."""
    # A busy SMP says it is alive every KEEPALIVE_S.
    return seconds_from_env(SMP_TIMEOUT_ENV, SMP_TIMEOUT_S, minimum=2 * KEEPALIVE_S,
                            what="the time a rank waits for a word from its SMP")


def running_smp(node_dir: str) -> Optional[int]:
    """PID of the live SMP serving ``node_dir``, or None."""
    pid = read_pid(os.path.join(node_dir, PID_FILE))
    if pid is None or not pid_alive(pid):
        return None
    args = cmdline(pid)
    if not any("ftmem._shm.smp" in a for a in args) or node_dir not in args:
        return None  # a recycled pid
    return pid


def stop_smp(pid: int) -> None:
    """Stop an SMP: SIGTERM (with SIGCONT, so that a stopped one gets it), then SIGKILL
    if it has not gone within SMP_STOP_TIMEOUT_S."""
    try:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + SMP_STOP_TIMEOUT_S
        while pid_alive(pid) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.02)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap() -> None:
    for p in list(_spawned):
        if p.poll() is not None:
            _spawned.remove(p)
            _ended[p.pid] = p.returncode


def _how_it_ended(pid: int) -> str:
    """How the SMP ``pid``, found gone, ended, in words: its exit status where this process started it."""
    proc = next((p for p in list(_spawned) if p.pid == pid), None)
    code = _ended.get(pid)
    if code is None and proc is not None:
        # Not poll(): while another thread of the process polls it (a reap), poll() answers
        # "still running". It is gone: wait() waits for that thread alone, then reads the status.
        try:
            code = proc.wait(timeout=_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
    if code is None:
        return "it was not started by this process: `dmesg` says whether the kernel's OOM killer ended it"
    if code == -signal.SIGKILL:
        return "killed by SIGKILL, as the kernel's OOM killer kills: see `dmesg` and the node's memory limit"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _log_tail(node_dir: str, lines: int = 15) -> str:
    try:
        text = read_private(os.path.join(node_dir, LOG_FILE)).decode(errors="replace")
    except OSError:  # missing, or not a file of ours
        return "(no log)"
    return "".join(text.splitlines(keepends=True)[-lines:])


def _read_key(node_dir: str) -> Optional[bytes]:
    try:
        return read_private(os.path.join(node_dir, KEY_FILE)) or None
    except FileNotFoundError:
        return None


def _new_key(node_dir: str) -> bytes:
    key = os.urandom(32)
    path = os.path.join(node_dir, KEY_FILE)
    unlink_if_present(path)
    write_new(path, key)
    return key


def _write_node_file(node_dir: str, ranks: list[int]) -> None:
    write_atomically(os.path.join(node_dir, NODE_FILE), json.dumps({"ranks": ranks}).encode(), private=True)


def _private_node_dir(node_dir: str, create: bool) -> None:
    """Check (and with ``create``, make) the root, job and node directories: private to this user."""
    job_dir = os.path.dirname(node_dir)
    for path in (os.path.dirname(job_dir), job_dir, node_dir):
        if create:
            private_dir(path)
        else:
            check_private_dir(path)


@contextlib.contextmanager
def _node_lock(node_dir: str) -> Iterator[None]:
    """The node's lock, held while an SMP is checked, stopped or started; waited for, bounded."""
    with node_lock(node_dir, _LOCK_TIMEOUT_S) as taken:
        if not taken:
            lock = os.path.join(node_dir, LOCK_FILE)
            raise errors.SmpError(
                f"another process of this node has held {lock} for over {_LOCK_TIMEOUT_S:.0f} s "
                f"(`fuser {lock}` names it): it is stopped or hung while starting the SMP. "
                f"Kill it, then restart the job.")
        yield


def ensure_smp(node_dir: str, ranks: list[int], create: bool = True,
               rejected_key: Optional[bytes] = None) -> tuple[int, bytes]:
    """Start the node's SMP unless one is running; return its pid and its key.

    ``create``: the node directory may be created (a client's first connection).
    ``rejected_key``: the running SMP refused this key; if smp.key still holds it, the
    SMP is restarted with a new one.
    """
    _reap()
    _private_node_dir(node_dir, create)
    with _node_lock(node_dir):
        pid, key = running_smp(node_dir), _read_key(node_dir)
        if pid is not None and (key is None or key == rejected_key):
            # Nobody can connect to it any more; it holds nothing the files do not.
            log.warning("the key file of the SMP of %s %s: restarting it (pid %d) with a new key", node_dir,
                        "vanished" if key is None else "does not hold the key it serves", pid)
            stop_smp(pid)
            pid, key = None, None
        if pid is not None:
            if not os.path.lexists(os.path.join(node_dir, NODE_FILE)):
                log.warning("%s of %s vanished: written again", NODE_FILE, node_dir)
                _write_node_file(node_dir, ranks)
            return pid, key
        key = key or _new_key(node_dir)
        _write_node_file(node_dir, ranks)
        unlink_if_present(os.path.join(node_dir, PID_FILE))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with os.fdopen(open_private(os.path.join(node_dir, LOG_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                       "ab") as logf:
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
                return proc.pid, key
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        proc.kill()
        code = proc.poll()
        if code == EXIT_ADDRESS_TAKEN:
            raise errors.SmpError(
                f"the SMP for {node_dir} cannot listen: another SMP of this node (one that lost its pid file) still "
                f"listens on its socket. Stop that process (`ss -xlp | grep {node_dir}` names it), or run `ftmem "
                f"clean` for this job, then restart. Its log:\n{_log_tail(node_dir)}")
        what = f"exited at start (exit code {code})" if code is not None else \
            f"did not start within {SMP_START_TIMEOUT_S:.0f} s"
        raise errors.SmpError(f"the SMP for {node_dir} {what}. Its log:\n{_log_tail(node_dir)}")


def connect(node_dir: str, key: bytes, timeout: float) -> Connection:
    """An authenticated connection to the SMP of ``node_dir``, every wait on it bounded
    by ``timeout`` (what multiprocessing.connection.Client does, with the bound)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bound_waits(sock, timeout)  # first: connect() waits for room in the SMP's backlog up to it
        with socket_path(node_dir) as path:
            sock.connect(path)
        conn = Connection(sock.detach())
    finally:
        sock.close()
    try:
        # Both ways: the SMP proves it holds the key too, so a process that took its name is never trusted.
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


def exchange(conn: Connection, msg: tuple) -> tuple:
    """Send a request and return its reply, past the SMP's keepalives."""
    send_message(conn, msg)
    reply = receive_message(conn)
    while reply == BUSY:
        reply = receive_message(conn)
    return reply


def _identity(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class SmpClient:
    """Thread-safe request/reply channel to the node's SMP."""

    def __init__(self, node_dir: str, ranks: list[int]):
        self.node_dir = node_dir
        self.ranks = ranks
        self.timeout_s = smp_timeout_s()
        smp_grace_s()  # a bad FTMEM_SMP_GRACE_S stops the rank with the reason, not its SMP without a word
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()
        self._home: Optional[tuple[int, int]] = None  # the node directory it first connected in
        self._pid: Optional[int] = None
        self._key: Optional[bytes] = None

    def removed_error(self) -> Optional[errors.SharedMemoryRemoved]:
        """The error to stop with if the node directory this client started in is gone or
        was replaced since; None while it is in place (or before the first connection)."""
        if self._home is None or _identity(self.node_dir) == self._home:
            return None
        return errors.SharedMemoryRemoved(
            f"the job's shared memory in {self.node_dir} was removed (ftmem clean?) while the job ran: the "
            f"snapshots this node held are gone, and none can be taken there any more. Restart the job: it "
            f"restores from what the other nodes hold, else from disk."
        )

    def check_node_dir(self) -> None:
        """Raise SharedMemoryRemoved if the node directory is gone or was replaced."""
        error = self.removed_error()
        if error is not None:
            raise error

    def _connect(self, rejected_key: Optional[bytes]) -> Connection:
        self.check_node_dir()
        self._pid, self._key = ensure_smp(self.node_dir, self.ranks, create=self._home is None,
                                          rejected_key=rejected_key)
        if self._home is None:
            self._home = _identity(self.node_dir)
        return connect(self.node_dir, self._key, self.timeout_s)

    def request(self, *msg) -> tuple:
        with self._lock:
            rejected_key = None
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect(rejected_key)
                    reply = exchange(self._conn, msg)
                    break
                except (BlockingIOError, TimeoutError) as e:
                    self._close_conn()
                    raise self._unresponsive(msg[0]) from e
                except (OSError, EOFError, AuthenticationError) as e:
                    # The SMP went away (killed, or never started), or holds another key than
                    # smp.key: start one and retry once.
                    self._close_conn()
                    rejected_key = self._key if isinstance(e, AuthenticationError) else None
                    if attempt == 1:
                        self.check_node_dir()  # a directory removed under the request says why
                        raise errors.SmpError(
                            f"lost the SMP of {self.node_dir} twice during {msg[0]!r} ({e}). "
                            f"Its log:\n{_log_tail(self.node_dir)}"
                        ) from e
                    if self._pid is not None and not pid_alive(self._pid):
                        log.warning("the SMP of %s (pid %d) is gone (%s) during %r: starting another, which finds "
                                    "every snapshot in shared memory", self.node_dir, self._pid,
                                    _how_it_ended(self._pid), msg[0])
        if reply[0] == "err":
            kind = getattr(errors, str(reply[1]), None)
            known = isinstance(kind, type) and issubclass(kind, errors.FtmemError)
            raise (kind if known else errors.SmpError)(reply[2])
        return reply

    def _unresponsive(self, kind: str) -> errors.SmpUnresponsive:
        pid = self._pid
        stopped = " (stopped: SIGSTOP or a debugger)" if process_state(pid) in ("T", "t") else ""
        return errors.SmpUnresponsive(
            f"the SMP of {self.node_dir} (pid {pid}{stopped}) did not answer {kind!r} within {self.timeout_s:g} s "
            f"({SMP_TIMEOUT_ENV}); training stops rather than wait without end. A stopped SMP goes on after "
            f"`kill -CONT {pid}`; a hung one must be killed (`kill -9 {pid}`): the restarted job starts a new one, "
            f"which finds every snapshot. Its log:\n{_log_tail(self.node_dir)}"
        )

    def finish(self, rank: int) -> None:
        """Tell the SMP this rank's job ended cleanly. The last rank of the node waits
        until the SMP has freed the node's memory and exited."""
        if self.removed_error() is not None:
            return  # `ftmem clean` has freed the node already
        try:
            _, last = self.request("finished", rank)
        except errors.SharedMemoryRemoved:
            # Freed while the answer was on its way: the SMP frees the node only once every
            # local rank's "finished" is marked, this one's included (or `ftmem clean` did).
            return
        # The SMP that answered, not the one running before: if that one was killed, the
        # request started a new one, and it is the new one that frees the memory.
        pid = self._pid
        deadline = time.monotonic() + SMP_START_TIMEOUT_S
        while last and pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            _reap()
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
