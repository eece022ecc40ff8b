"""The snapshot management process (SMP): one per node, started by the first rank
of the node that needs it, detached from the training processes (its own session),
so it outlives their crashes.

It owns the node's shared memory: it allocates the ranks' slots (after checking the
budget) and frees the node's memory when every local rank says the job finished.
Checksums are not its job: each rank's copy thread takes them before a version
counts as committed (:mod:`ftmem._shm.integrity`). The filesystem is the source of truth,
so killing the SMP loses no version; the next request starts a new one.

Started by :func:`ftmem._shm.smp_client.ensure_smp` as ``main(["--node-dir", D, "--ranks", "0,1"])``.
Requests, as JSON arrays over a ``multiprocessing.connection`` on the Unix socket
``smp.sock`` in the node directory (``send_bytes``/``recv_bytes``: never a pickle, which
would run code on receipt):
``["alloc", rank, nbytes, parity_nbytes, data_slots, budget]``, ``["hello", rank, pid]``, ``["finished", rank]``,
``["ping"]``. Replies are ``["ok", ...]`` or ``["err", kind, msg]``. While it works on a slow
request (an allocation of large slots) the SMP sends ``BUSY`` every ``KEEPALIVE_S``, so a
rank can bound how long it waits for a word (:mod:`ftmem._shm.smp_client`) without bounding the
size of the request.

Only the job's user can connect: the socket is a file in the node directory, which is
0700, so no other user can reach it, bind it first, or fill the SMP with connections (an
abstract socket name, as used before, is listed in ``/proc/net/unix`` for every user to
read, connect to and squat). A connection is served only after both ends proved they hold
the key in ``smp.key`` (0600); one that has not within ``HANDSHAKE_S`` is dropped, and at
most ``MAX_HANDSHAKES`` are in progress at once.

An SMP outlives only a job that may come back: once no rank it serves runs (none ever
said hello, or all that did are dead) and none connects for ``FTMEM_SMP_GRACE_S``, it
exits. The versions the node holds stay in shared memory for a restart (which starts a
new SMP that finds them); a node that holds none (a start that failed) is freed. On SIGTERM
(the node shutting down) it exits at once and frees nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Iterator, Optional

from ftmem._common import testhooks
from ftmem.config import SLOT_CHOICES, seconds_from_env
from ftmem.errors import FtmemError
from ftmem._shm.private import (check_private_dir, open_private, read_private, unlink_if_present, write_atomically,
                                write_new)
from ftmem._shm.procs import pid_alive, process_start
from ftmem._shm.allocation import allocate
from ftmem._shm.slots import RankStore

log = logging.getLogger("ftmem.smp")

PID_FILE = "smp.pid"
KEY_FILE = "smp.key"
LOG_FILE = "smp.log"
LOCK_FILE = "smp.lock"
SOCKET_FILE = "smp.sock"

BUSY = ("busy",)  # "still working on your request": not a reply
KEEPALIVE_S = 0.5
SLOW_REQUESTS = ("alloc",)  # their time grows with the bytes; answered with keepalives
MAX_MESSAGE_BYTES = 1 << 16  # requests and replies are a few numbers and a sentence
# The SMP's exit status when another SMP of its node still listens on its socket (the rank reports it at once).
EXIT_ADDRESS_TAKEN = 3
HANDSHAKE_S = 10.0  # how long a connection may take to prove it holds the key
MAX_HANDSHAKES = 64  # connections proving it at once: a node's ranks connect at once, at most once each
GRACE_ENV = "FTMEM_SMP_GRACE_S"
GRACE_S = 600.0  # how long an SMP waits for a rank to come back once none runs
# (request kind, types of its arguments after the kind)
_REQUESTS = {"ping": (), "alloc": (int, int, int, int, int), "hello": (int, int), "finished": (int,)}


@contextlib.contextmanager
def socket_path(node_dir: str) -> Iterator[str]:
    """The path of the node's SMP socket, short enough for a Unix socket address (108
    bytes, which a node directory under a long job id exceeds): through a descriptor of
    the node directory, held while the path is used."""
    fd = os.open(node_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET_FILE}"
    finally:
        os.close(fd)


def bound_waits(sock: socket.socket, timeout: float) -> None:
    """Make each blocking read and write on ``sock`` fail with BlockingIOError after
    ``timeout`` s (0: no bound). Set on the socket itself: a multiprocessing Connection
    reads and writes its descriptor directly, past Python's own socket timeout."""
    bound = struct.pack("ll", int(timeout), int(timeout % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)


def smp_grace_s() -> float:
    """How long an SMP whose ranks are all gone waits for one to come back: FTMEM_SMP_GRACE_S, else GRACE_S."""
    return seconds_from_env(GRACE_ENV, GRACE_S, minimum=0.1,
                            what="the time an SMP waits for a rank of its job to come back once none runs, before "
                                 "it exits (its node's versions stay for a restart)")


def send_message(conn: Connection, msg: tuple) -> None:
    conn.send_bytes(json.dumps(list(msg)).encode())


def receive_message(conn: Connection) -> tuple:
    """The next message on ``conn``; ValueError if it is not a JSON array starting with a
    string (OSError if it is longer than MAX_MESSAGE_BYTES)."""
    raw = conn.recv_bytes(MAX_MESSAGE_BYTES)
    try:
        msg = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"a message that is not JSON ({e})") from e
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ValueError(f"a message that is no [kind, ...] array: {raw[:100]!r}")
    return tuple(msg)


def _check_request(msg: tuple) -> None:
    """ValueError unless ``msg`` is a known request with arguments of the right types."""
    kinds = _REQUESTS.get(msg[0])
    if kinds is None:
        raise ValueError(f"unknown SMP request {msg[0]!r:.100}")
    if len(msg) != len(kinds) + 1 or not all(type(a) is k for a, k in zip(msg[1:], kinds)):
        raise ValueError(f"SMP request {msg[0]!r} needs {len(kinds)} integer argument(s), got {list(msg[1:])!r:.200}")


@contextlib.contextmanager
def node_lock(node_dir: str, wait_s: float) -> Iterator[bool]:
    """The node's lock, held while an SMP is checked, started, stopped, or exits on its
    own; yields whether it was taken within ``wait_s``."""
    fd = open_private(os.path.join(node_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    taken = False
                    break
                time.sleep(0.01)
        yield taken
    finally:
        os.close(fd)


def owner_file(node_dir: str, rank: int) -> str:
    """Where the SMP records the process that said hello as ``rank``: ``"<pid> <start time>"``."""
    return os.path.join(node_dir, f"owner.rank{rank:05d}")


def rank_owner(node_dir: str, rank: int) -> Optional[tuple[int, bool]]:
    """(pid, whether it still runs) of the process that said hello as ``rank`` on this node
    (the start time tells a recycled pid from it); None if none did."""
    try:
        pid, started = (int(x) for x in read_private(owner_file(node_dir, rank)).split())
    except (OSError, ValueError):  # missing, a link, or not two numbers
        return None
    return pid, pid_alive(pid) and process_start(pid) == started


def read_key(node_dir: str) -> bytes:
    return read_private(os.path.join(node_dir, KEY_FILE))


class SnapshotManager:
    def __init__(self, node_dir: str, ranks: list[int]):
        self.node_dir = node_dir
        self.ranks = ranks
        self._lock = threading.Lock()
        # Open connections (a rank starting, before its hello, counts as running), under a lock
        # of their own: an allocation holds _lock for long, and a connection must not wait for it.
        self._connections = 0
        self._handshakes = 0  # of those, the ones not yet authenticated
        self._count_lock = threading.Lock()

    # -- requests -------------------------------------------------------------
    def _handle(self, msg: tuple) -> tuple:
        _check_request(msg)
        kind = msg[0]
        if kind == "ping":
            return ("ok", os.getpid())
        rank = msg[1]
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not one of this node's ranks {self.ranks}")
        if kind == "alloc":
            _, _, nbytes, parity_nbytes, data_slots, budget = msg
            if data_slots not in SLOT_CHOICES:
                raise ValueError(f"{data_slots} data slots asked; ftmem keeps one of {SLOT_CHOICES}")
            store = RankStore(self.node_dir, rank, data_slots)
            with self._lock:
                allocate(store, nbytes, parity_nbytes, len(self.ranks), budget or None)
            return ("ok", store.data_slots)
        if kind == "hello":
            pid = msg[2]
            running = self._running_as(rank)
            if running is not None and running != pid:
                return ("err", "JobAlreadyRunning", f"rank {rank} of this job is already running as pid {running} "
                        f"on this node ({self.node_dir}): two jobs share one job id. Give one of them its own id "
                        f"(FTMEM_JOB_ID, the config's \"job_id\" or --ftmem-job-id), or stop the other first.")
            write_atomically(self._owner_file(rank), f"{pid} {process_start(pid)}".encode(), private=True)
            # A (re)started rank is running again: any earlier "finished" of it is stale.
            unlink_if_present(self._finished_marker(rank))
            return ("ok", os.getpid())
        # "finished": kept as files so that an SMP restarted in between still counts them.
        # Marked and counted under the lock, so that one answer only says "last": two ranks'
        # threads both seeing every marker would both free the node and exit, the first
        # before the other's answer went out (that rank's clean end then failed).
        with self._lock:
            with contextlib.suppress(FileExistsError):
                write_new(self._finished_marker(rank), b"")
            testhooks.at("smp_finished", rank, -1)
            return ("ok", all(os.path.exists(self._finished_marker(r)) for r in self.ranks))

    def _owner_file(self, rank: int) -> str:
        return owner_file(self.node_dir, rank)

    def _running_as(self, rank: int):
        """The pid of the live process that said hello as ``rank``, if it still runs."""
        owner = rank_owner(self.node_dir, rank)
        return owner[0] if owner is not None and owner[1] else None

    def _finished_marker(self, rank: int) -> str:
        return os.path.join(self.node_dir, f"finished.rank{rank:05d}")

    def _reply(self, msg: tuple) -> tuple:
        try:
            return self._handle(msg)
        except FtmemError as e:
            return ("err", type(e).__name__, str(e))
        except ValueError as e:  # a request no ftmem rank sends
            log.warning("refused a request: %s", e)
            return ("err", "SmpError", f"SMP of {self.node_dir} refused a request: {e}")
        except Exception as e:
            log.exception("request %r failed", msg[:1])
            return ("err", "SmpError", f"SMP of {self.node_dir} failed on {msg[0]!r}: {e}")

    def _answer(self, conn: Connection, msg: tuple) -> tuple:
        """The reply to ``msg``; a slow request runs aside while ``conn`` hears BUSY every KEEPALIVE_S."""
        if msg[0] not in SLOW_REQUESTS:
            return self._reply(msg)
        done: list = []
        worker = threading.Thread(target=lambda: done.append(self._reply(msg)), daemon=True)
        worker.start()
        worker.join(KEEPALIVE_S)
        while worker.is_alive():
            send_message(conn, BUSY)
            worker.join(KEEPALIVE_S)
        return done[0]

    def _serve_connection(self, sock: socket.socket) -> None:
        # Authenticated here, not in accept(): a client that stalls halfway through the
        # handshake holds up its own thread only, never the next rank's connection, and
        # only for HANDSHAKE_S.
        with self._count_lock:
            crowded = self._handshakes >= MAX_HANDSHAKES
            if not crowded:
                self._connections += 1
                self._handshakes += 1
        if crowded:
            log.warning("refused a connection: %d others are proving their key already", MAX_HANDSHAKES)
            sock.close()
            return
        try:
            bound_waits(sock, HANDSHAKE_S)
            conn = Connection(sock.detach())
            with conn:
                try:
                    deliver_challenge(conn, self._key)
                    answer_challenge(conn, self._key)
                except (AuthenticationError, EOFError, OSError) as e:
                    log.warning("refused a connection: %s", e or type(e).__name__)
                    return
                finally:
                    with self._count_lock:
                        self._handshakes -= 1
                # A rank's connection stays open, idle between its requests, as long as it runs.
                with socket.socket(fileno=os.dup(conn.fileno())) as same:
                    bound_waits(same, 0)
                self._serve_requests(conn)
        finally:
            with self._count_lock:
                self._connections -= 1

    def _serve_requests(self, conn: Connection) -> None:
        while True:
            try:
                msg = receive_message(conn)
            except ValueError as e:  # not from an ftmem rank: answered once, then the connection closes
                log.warning("refused a message: %s", e)
                with contextlib.suppress(OSError):
                    send_message(conn, ("err", "SmpError", f"SMP of {self.node_dir} refused {e}"))
                return
            except (EOFError, OSError):  # the rank went away (or gave up waiting)
                return
            reply = self._answer(conn, msg)
            try:
                send_message(conn, reply)
            except (EOFError, OSError):
                return
            if msg[0] == "finished" and reply[0] == "ok" and reply[1]:
                self._release_and_exit()

    def _release_and_exit(self) -> None:
        """The job ended cleanly on every local rank: free the node's memory and go."""
        log.info("all local ranks %s finished; freeing %s", self.ranks, self.node_dir)
        shutil.rmtree(self.node_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.node_dir))  # the job directory, once empty
        except OSError:
            pass
        os._exit(0)

    # -- its own end -------------------------------------------------------------
    def _anyone_running(self) -> bool:
        with self._count_lock:
            if self._connections:
                return True
        return any(self._running_as(r) is not None for r in self.ranks)

    def _watch(self, grace_s: float) -> None:
        """Exit once no rank has run or connected for ``grace_s`` (checked about every second)."""
        idle_since = time.monotonic()
        while True:
            time.sleep(min(grace_s / 4, 1.0))
            if not os.path.isdir(self.node_dir):  # removed under it (rm -r): nothing left to keep
                log.info("%s was removed: exiting", self.node_dir)
                os._exit(0)
            if self._anyone_running():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= grace_s:
                # Under the node's lock: a rank starting now waits, then finds no SMP and starts one.
                with node_lock(self.node_dir, 0) as taken:
                    if taken and not self._anyone_running():
                        self._exit_idle(grace_s)

    def _exit_idle(self, grace_s: float) -> None:
        held = sorted({v for r in self.ranks for v in (*RankStore(self.node_dir, r).committed(),
                                                         *RankStore(self.node_dir, r).parity_held())})
        if held:
            log.info("no rank of %s has run for %g s (%s): exiting; versions %s stay in shared memory for a "
                     "restart", self.node_dir, grace_s, GRACE_ENV, held)
            os._exit(0)
        log.info("no rank of %s has run for %g s and the node holds no version (a start that failed)",
                 self.node_dir, grace_s)
        self._release_and_exit()

    def _listen(self) -> Optional[socket.socket]:
        """A socket listening on the node's ``smp.sock``; None if another SMP of the node
        still listens there (one that lost its pid file). A socket file that nothing listens
        on is what a killed SMP left: it is replaced. Only this user can write in the node
        directory, so no other user can have put anything there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket_path(self.node_dir) as path:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                return None
            except (ConnectionRefusedError, FileNotFoundError):
                unlink_if_present(os.path.join(self.node_dir, SOCKET_FILE))
            finally:
                probe.close()
            sock.bind(path)
            os.chmod(path, 0o600)  # as every file of the node's (the directory alone keeps others out already)
        # Room for every rank of a node connecting at once: a full backlog makes them wait.
        sock.listen(64)
        return sock

    def serve(self, grace_s: float) -> None:
        # The directory may have been replaced since the rank that started this SMP checked it.
        for path in (os.path.dirname(os.path.dirname(self.node_dir)), os.path.dirname(self.node_dir), self.node_dir):
            check_private_dir(path)
        self._key = read_key(self.node_dir)
        listener = self._listen()
        if listener is None:
            log.error("cannot listen: another SMP of %s (one that lost its pid file) still listens on %s; "
                      "`ss -xlp | grep %s` names it", self.node_dir, SOCKET_FILE, self.node_dir)
            sys.exit(EXIT_ADDRESS_TAKEN)
        # The pid file says "ready": it is written only once the socket accepts.
        write_atomically(os.path.join(self.node_dir, PID_FILE), str(os.getpid()).encode(), private=True)
        log.info("SMP %d serving %s for ranks %s; exits %g s after its last rank is gone", os.getpid(),
                 self.node_dir, self.ranks, grace_s)
        threading.Thread(target=self._watch, args=(grace_s,), daemon=True).start()
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="ftmem.smp", description=__doc__.splitlines()[0])
    parser.add_argument("--node-dir", required=True)
    parser.add_argument("--ranks", required=True, help="comma-separated ranks of this node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ftmem.smp[%(process)d] %(message)s")
    os.nice(10)  # its work (allocating, freeing) must yield the cores to training
    ranks = [int(r) for r in args.ranks.split(",")]
    # A rank may start this process from one of ftmem's threads, which block the signals sent
    # to the process (ftmem/_common/threads.py); exec keeps that mask: take none of it.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGTERM, _exit_keeping_versions)
    SnapshotManager(args.node_dir, ranks).serve(smp_grace_s())


def _exit_keeping_versions(signum, frame) -> None:
    """SIGTERM (the node shutting down, a preemption): go, and leave every version where it
    is. Ranks flushing a version read it from their own mappings, which outlive the SMP; a
    restart on this node finds what is left."""
    log.info("SIGTERM: exiting; the versions this node holds stay in shared memory")
    os._exit(0)

