"""The snapshot management process (SMP): one per node, started by the first rank
of the node that needs it, detached from the training processes (its own session),
so it outlives their crashes.

It owns the node's shared memory: it allocates the ranks' slots (after checking the
budget) and frees the node's memory when every local rank says the job finished.
Checksums are not its job: each rank's copy thread takes them before a version
counts as committed (:mod:`ftmem.integrity`). The filesystem is the source of truth,
so killing the SMP loses no version; the next request starts a new one.

Started by :func:`ftmem.smp_client.ensure_smp` as ``main(["--node-dir", D, "--ranks", "0,1"])``.
Requests (tuples over a ``multiprocessing.connection`` on an abstract Unix socket):
``("alloc", rank, nbytes, parity_nbytes)``, ``("hello", rank, pid)``, ``("finished", rank)``,
``("ping",)``. Replies are ``("ok", ...)`` or ``("err", kind, msg)``. While it works on a slow
request (an allocation of large slots) the SMP sends ``BUSY`` every ``KEEPALIVE_S``, so a
rank can bound how long it waits for a word (:mod:`ftmem.smp_client`) without bounding the
size of the request.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from .errors import FtmemError
from .procs import pid_alive, process_start
from .allocation import allocate
from .slots import RankStore, unlink_if_present

log = logging.getLogger("ftmem.smp")

PID_FILE = "smp.pid"
KEY_FILE = "smp.key"
LOG_FILE = "smp.log"
LOCK_FILE = "smp.lock"

BUSY = ("busy",)  # "still working on your request": not a reply
KEEPALIVE_S = 0.5
SLOW_REQUESTS = ("alloc",)  # their time grows with the bytes; answered with keepalives


def smp_address(node_dir: str) -> str:
    """Abstract-namespace socket name (no path length limit, gone with the process)."""
    return "\0ftmem-smp-" + hashlib.sha1(os.path.realpath(node_dir).encode()).hexdigest()[:24]


def read_key(node_dir: str) -> bytes:
    with open(os.path.join(node_dir, KEY_FILE), "rb") as f:
        return f.read()


class SnapshotManager:
    def __init__(self, node_dir: str, ranks: list[int]):
        self.node_dir = node_dir
        self.ranks = ranks
        self._lock = threading.Lock()

    # -- requests -------------------------------------------------------------
    def _handle(self, msg: tuple) -> tuple:
        kind = msg[0]
        if kind == "ping":
            return ("ok", os.getpid())
        if kind == "alloc":
            _, rank, nbytes, parity_nbytes = msg
            with self._lock:
                allocate(RankStore(self.node_dir, rank), nbytes, parity_nbytes)
            return ("ok",)
        if kind == "hello":
            _, rank, pid = msg
            running = self._running_as(rank)
            if running is not None and running != pid:
                return ("err", "JobAlreadyRunning", f"rank {rank} of this job is already running as pid {running} "
                        f"on this node ({self.node_dir}): two jobs share one job id. Give one of them its own id "
                        f"(FTMEM_JOB_ID, the config's \"job_id\" or --ftmem-job-id), or stop the other first.")
            with open(self._owner_file(rank), "w") as f:
                f.write(f"{pid} {process_start(pid)}")
            # A (re)started rank is running again: any earlier "finished" of it is stale.
            unlink_if_present(self._finished_marker(msg[1]))
            return ("ok", os.getpid())
        if kind == "finished":
            # Kept as files so that an SMP restarted in between still counts them.
            open(self._finished_marker(msg[1]), "w").close()
            return ("ok", all(os.path.exists(self._finished_marker(r)) for r in self.ranks))
        return ("err", "FtmemError", f"unknown SMP request {kind!r}")

    def _owner_file(self, rank: int) -> str:
        return os.path.join(self.node_dir, f"owner.rank{rank:05d}")

    def _running_as(self, rank: int):
        """The pid of the live process that said hello as ``rank``, if it still runs (the
        start time tells a recycled pid from it)."""
        try:
            with open(self._owner_file(rank)) as f:
                pid, started = (int(x) for x in f.read().split())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) and process_start(pid) == started else None

    def _finished_marker(self, rank: int) -> str:
        return os.path.join(self.node_dir, f"finished.rank{rank:05d}")

    def _reply(self, msg: tuple) -> tuple:
        try:
            return self._handle(msg)
        except FtmemError as e:
            return ("err", type(e).__name__, str(e))
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
            conn.send(BUSY)
            worker.join(KEEPALIVE_S)
        return done[0]

    def _serve_connection(self, conn: Connection) -> None:
        # Authenticated here, not in accept(): a client that stalls halfway through the
        # handshake holds up its own thread only, never the next rank's connection.
        with conn:
            try:
                deliver_challenge(conn, self._key)
                answer_challenge(conn, self._key)
            except (AuthenticationError, EOFError, OSError) as e:
                log.warning("refused a connection: %s", e or type(e).__name__)
                return
            self._serve_requests(conn)

    def _serve_requests(self, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
                reply = self._answer(conn, msg)
                conn.send(reply)
            except (EOFError, OSError):  # the rank went away (or gave up waiting)
                return
            if msg[0] == "finished" and reply[1]:
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

    def serve(self) -> None:
        self._key = read_key(self.node_dir)
        # Room for every rank of a node connecting at once: a full backlog makes them wait.
        listener = Listener(smp_address(self.node_dir), family="AF_UNIX", backlog=64)
        # The pid file says "ready": it is written only once the socket accepts.
        tmp = os.path.join(self.node_dir, f"{PID_FILE}.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(self.node_dir, PID_FILE))
        log.info("SMP %d serving %s for ranks %s", os.getpid(), self.node_dir, self.ranks)
        while True:
            conn = listener.accept()
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="ftmem.smp", description=__doc__.splitlines()[0])
    parser.add_argument("--node-dir", required=True)
    parser.add_argument("--ranks", required=True, help="comma-separated ranks of this node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ftmem.smp[%(process)d] %(message)s")
    os.nice(10)  # its work (allocating, freeing) must yield the cores to training
    ranks = [int(r) for r in args.ranks.split(",")]
    SnapshotManager(args.node_dir, ranks).serve()

