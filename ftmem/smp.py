"""The snapshot management process (SMP): one per node, started by the first rank
of the node that needs it, detached from the training processes (its own session),
so it outlives their crashes.

It owns the node's shared memory: it allocates the ranks' slots (after checking the
budget), seals committed versions with their checksums off the training critical
path, and frees the node's memory when every local rank says the job finished.
The filesystem is the source of truth: a restarted SMP rescans the node directory
and seals whatever was committed while no SMP ran, so killing it loses no version.

Started by :func:`ftmem.smp_client.ensure_smp` as ``main(["--node-dir", D, "--ranks", "0,1"])``.
Requests (tuples over a ``multiprocessing.connection`` on an abstract Unix socket):
``("alloc", rank, nbytes, parity_nbytes)``, ``("committed", rank, version)``, ``("sync",)``,
``("hello", rank)``, ``("finished", rank)``, ``("ping",)``. Replies are ``("ok", ...)`` or ``("err", kind, msg)``.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import queue
import shutil
import threading
from multiprocessing.connection import Connection, Listener

from .errors import FtmemError
from . import integrity
from .allocation import allocate
from .slots import RankStore, ranks_in, unlink_if_present

log = logging.getLogger("ftmem.smp")

PID_FILE = "smp.pid"
KEY_FILE = "smp.key"
LOG_FILE = "smp.log"
LOCK_FILE = "smp.lock"


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
        self._seal_queue: "queue.Queue[tuple[int, int] | None]" = queue.Queue()
        self._lock = threading.Lock()
        # Held while a seal is written; once the node is being freed no seal may
        # start, or it could recreate a file in the directory being deleted.
        self._seal_lock = threading.Lock()
        self._releasing = False

    # -- sealing (off the training critical path) ----------------------------
    def _unsealed(self) -> list[tuple[int, int]]:
        todo = []
        for rank in ranks_in(self.node_dir):
            store = RankStore(self.node_dir, rank)
            todo += [(rank, v) for v in store.committed() if store.read_seal(v) is None]
        return todo

    def _sealer(self) -> None:
        while True:
            rank, version = self._seal_queue.get()
            try:
                with self._seal_lock:
                    store = RankStore(self.node_dir, rank)
                    if not self._releasing and store.read_seal(version) is None:
                        integrity.seal(store, version)
            except Exception:  # one bad shard must not stop sealing the others
                log.exception("sealing rank %d version %d failed", rank, version)
            finally:
                self._seal_queue.task_done()

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
        if kind == "committed":
            self._seal_queue.put((msg[1], msg[2]))
            return ("ok",)
        if kind == "sync":
            for item in self._unsealed():
                self._seal_queue.put(item)
            self._seal_queue.join()
            return ("ok",)
        if kind == "hello":
            # A (re)started rank is running again: any earlier "finished" of it is stale.
            unlink_if_present(self._finished_marker(msg[1]))
            return ("ok", os.getpid())
        if kind == "finished":
            # Kept as files so that an SMP restarted in between still counts them.
            open(self._finished_marker(msg[1]), "w").close()
            return ("ok", all(os.path.exists(self._finished_marker(r)) for r in self.ranks))
        return ("err", "FtmemError", f"unknown SMP request {kind!r}")

    def _finished_marker(self, rank: int) -> str:
        return os.path.join(self.node_dir, f"finished.rank{rank:05d}")

    def _serve_connection(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = self._handle(msg)
                except FtmemError as e:
                    reply = ("err", type(e).__name__, str(e))
                except Exception as e:
                    log.exception("request %r failed", msg[:1])
                    reply = ("err", "SmpError", f"SMP of {self.node_dir} failed on {msg[0]!r}: {e}")
                try:
                    conn.send(reply)
                except OSError:
                    return
                if msg[0] == "finished" and reply[1]:
                    self._release_and_exit()

    def _release_and_exit(self) -> None:
        """The job ended cleanly on every local rank: free the node's memory and go."""
        log.info("all local ranks %s finished; freeing %s", self.ranks, self.node_dir)
        with self._seal_lock:
            self._releasing = True
        shutil.rmtree(self.node_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.node_dir))  # the job directory, once empty
        except OSError:
            pass
        os._exit(0)

    def serve(self) -> None:
        listener = Listener(smp_address(self.node_dir), family="AF_UNIX", authkey=read_key(self.node_dir))
        threading.Thread(target=self._sealer, daemon=True, name="sealer").start()
        for item in self._unsealed():  # committed while no SMP ran
            self._seal_queue.put(item)
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
    os.nice(10)  # its work (checksums) must yield the cores to training
    ranks = [int(r) for r in args.ranks.split(",")]
    SnapshotManager(args.node_dir, ranks).serve()

