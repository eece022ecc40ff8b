"""The failure detector against a real TCP store, in real processes: when a beat fails (the
connection of one rank's beats is reset by a proxy between it and the store, as a NAT or a
load balancer drops a flow), the beats must go on over a new one, so that the rank watching it
sees no silence; and when a rank puts a verdict on the store that its own process serves, it
must not end (and end the store) before a rank slow to read the verdict has read it. The ends
of a whole job at a hung or lost node run through DeepSpeed:
test_deepspeed.py::test_a_hung_or_killed_node_ends_the_survivors_at_the_detector_s_timeout...)."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness.ranks import REPO
from ftmem._engine.failure_detector import EXIT_CODE, interval_s
from ftmem._shm.node_beats import NodeBeats

SCRIPT = textwrap.dedent("""
    import socket, struct, sys, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from ftmem._engine.failure_detector import FailureDetector

    TIMEOUT_S = 2.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    class Proxy:
        # Forwards TCP connections to the store; reset() drops every one of them with an RST.
        def __init__(self):
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.port, self.flows, self.lock = self.listener.getsockname()[1], [], threading.Lock()
            threading.Thread(target=self._accept, daemon=True).start()

        def _accept(self):
            while True:
                client = self.listener.accept()[0]
                upstream = socket.create_connection(("127.0.0.1", store.port))
                with self.lock:
                    self.flows.append(client)
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

        @staticmethod
        def _pump(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        def reset(self):
            with self.lock:
                flows, self.flows = self.flows, []
            for s in flows:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()

    proxy = Proxy()
    def connect(port):
        return lambda: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                     timeout=timedelta(seconds=TIMEOUT_S))
    # Two nodes of one rank: rank 0 beats through the proxy, rank 1 (which watches it) directly.
    detectors = [FailureDetector(connect(port), "the store", "run", rank, 2, 1, TIMEOUT_S)
                 for rank, port in ((0, proxy.port), (1, store.port))]
    time.sleep(TIMEOUT_S / 2)
    print("RESETTING", file=sys.stderr, flush=True)  # before: the failed beat's own line says "reset"
    proxy.reset()
    counter = lambda: store.add("ftmem/failure_detection/run/alive/0", 0)
    after_reset = counter()
    time.sleep(3 * TIMEOUT_S)  # a verdict ends this process with exit code 75
    print("beats after the reset:", counter() - after_reset, file=sys.stderr, flush=True)
    for detector in detectors:
        detector.stop()
""")


@pytest.mark.fault("the store connection of a beat reset", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: a beat whose connection is reset takes a new one, and the watcher sees no silence")
def test_a_beat_that_fails_takes_a_new_connection_and_the_watcher_sees_no_silence():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, env=dict(os.environ, FTMEM_LOG_LEVEL="DEBUG"))
    said = proc.stdout
    assert proc.returncode == 0, said  # 75: rank 1 took rank 0 for a lost node
    assert "rank 0: a heartbeat failed" in said.split("RESETTING", 1)[1], said  # the reset broke a beat for real
    beats = int(said.split("beats after the reset:")[1].split()[0])
    assert beats >= 5, said  # 6 s at a beat every 0.4 s: the beats went on


VERDICT_TIMEOUT_S = 15.0  # beats every 3 s
RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from ftmem._engine.failure_detector import FailureDetector

    rank, port, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)  # rank 0 serves it
    print("PORT", store.port, flush=True)
    connect = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
    FailureDetector(connect, "the store", "run", rank, 3, 1, timeout_s)  # rank 1 never beats: lost
    time.sleep(120)  # the detector ends this process
""")


@pytest.mark.fault("rank stopped (SIGSTOP)", phase="between saves", framework="engine (toy trainer)",
                   expect="ends every rank within the detector's timeout, each naming the silent node, a rank stopped "
                          "at the verdict too")
def test_the_rank_that_serves_the_store_ends_its_verdict_only_once_a_slow_rank_read_it():
    """Ranks 0 and 2 of 3, one per node; rank 1 never beats. Rank 0 (which watches rank 1 and
    serves the store) puts the verdict on the store; rank 2 (which watches rank 0) is stopped
    right then for 1.75 beats, as a crowded node runs a thread late. Rank 0 used to end 1.5
    beats after its verdict whatever the others did, and rank 2, finding the store gone, ended
    later on the store's silence instead of naming the lost node."""
    def start(rank, port):
        return subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port), str(VERDICT_TIMEOUT_S)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = {0: start(0, 0)}
    try:
        port = int(procs[0].stdout.readline().split()[1])
        procs[2] = start(2, port)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        end = time.monotonic() + 3 * VERDICT_TIMEOUT_S
        while not store.check(["ftmem/failure_detection/run/verdict/answer"]):
            assert time.monotonic() < end, "rank 0 put no verdict on the store"
            time.sleep(0.01)
        os.kill(procs[2].pid, signal.SIGSTOP)
        time.sleep(1.75 * interval_s(VERDICT_TIMEOUT_S))
        os.kill(procs[2].pid, signal.SIGCONT)
        said = {rank: proc.communicate(timeout=3 * VERDICT_TIMEOUT_S)[0] for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    assert [procs[0].returncode, procs[2].returncode] == [EXIT_CODE] * 2, said
    for rank in (0, 2):
        assert f"rank {rank}: node 1 (host ?, rank 1) has not answered for" in said[rank], said[rank]
        assert "(seen by rank 0): ending this process" in said[rank], said[rank]


NODE_TIMEOUT_S = 6.0  # beats every 1.2 s
NODE_RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from ftmem._engine.failure_detector import FailureDetector
    from ftmem._shm.node_beats import NodeBeats

    rank, port, nodes_dir, leaves, timeout_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], 6.0
    connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
    node = NodeBeats(f"{nodes_dir}/node{rank // 2}", "run", [rank // 2 * 2, rank // 2 * 2 + 1], rank)
    detector = FailureDetector(connect, "the store", "run", rank, 4, 2, timeout_s, node)
    print("BEATING", flush=True)
    if leaves == "leaves":
        time.sleep(1)
        detector.stop()
    time.sleep(120)  # the detector ends this process
""")


def _nodes_of_two(tmp_path, leaves: bool = False):
    """A real store, and 4 ranks in processes of their own: 2 nodes of 2 ranks, each node's
    beats in a directory of its own. Rank 1 leaves after a second, where ``leaves``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir(mode=0o700)
    procs = [subprocess.Popen([sys.executable, "-c", NODE_RANK, str(rank), str(store.port), str(tmp_path),
                               "leaves" if leaves and rank == 1 else "stays"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(4)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "BEATING"
    return store, procs


@pytest.mark.parametrize("stopped, seen_by", [(3, [2]), (2, [0, 3])], ids=["a node's other rank", "a node's beater"])
@pytest.mark.fault("rank stopped (SIGSTOP)", phase="between saves", framework="engine (toy trainer)",
                   expect="ends every rank within the detector's timeout, each naming the silent node, its node's "
                          "ranks beating as one")
def test_a_node_beats_as_one_and_a_stopped_rank_of_it_ends_every_other_rank(stopped, seen_by, tmp_path):
    """2 nodes of 2 ranks: only each node's beater (ranks 0 and 2) beats on the store; ranks 1 and
    3 beat in their node's memory. Rank 3 stopped is seen by its node's beater (nobody else
    watches it), and rank 2, the beater, by rank 3 in their node and by rank 0 on the store;
    every other rank ends naming it, rank 1 told by its beater (it reads nothing on the store),
    and each within the beats the verdict's watcher waits for them (the watcher would say that
    some had not read it; without the telling, rank 1 ended on its beater's silence later)."""
    store, procs = _nodes_of_two(tmp_path)
    try:
        alive = "ftmem/failure_detection/run/alive/"
        assert store.check([alive + "0"]) and store.check([alive + "2"])
        assert not store.check([alive + "1"]) and not store.check([alive + "3"])  # their beats are their node's
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        others = [rank for rank in range(4) if rank != stopped]
        said = {rank: procs[rank].communicate(timeout=5 * NODE_TIMEOUT_S)[0] for rank in others}
        assert [procs[rank].returncode for rank in others] == [EXIT_CODE] * 3, said
        for rank in others:
            watchers = "|".join(map(str, seen_by))
            assert re.search(rf"rank {rank}: node 1 \(host [^,]+, rank {stopped}\) has not answered for \d+ s "
                             rf"\(seen by rank ({watchers})\): ending this process", said[rank]), said[rank]
            assert "had not read the verdict" not in said[rank], said[rank]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_node_s_rank_that_leaves_is_no_failure_to_its_beater(tmp_path):
    """Rank 1 leaves (its job finished): its beater, which watches it in their node's memory,
    takes its silence for no failure, and no rank ends in two timeouts."""
    store, procs = _nodes_of_two(tmp_path, leaves=True)
    try:
        time.sleep(2 * NODE_TIMEOUT_S)
        assert [proc.poll() for proc in procs] == [None] * 4, [proc.stdout.read() for proc in procs if proc.poll()]
        assert not store.check(["ftmem/failure_detection/run/verdict/answer"])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_node_s_rank_is_woken_by_the_verdict_its_beater_tells(tmp_path):
    """Between two beats a node's rank sleeps (5 s at the default timeout); the verdict its
    beater tells the node wakes it at once, so that it ends with its beater, not a beat later.
    The wait here is a minute: woken, it returns long before."""
    beater, other = (NodeBeats(str(tmp_path), "run", [0, 1], rank) for rank in (0, 1))
    waiting, slept = threading.Event(), []

    def wait() -> None:
        with other.waiting() as woken:
            waiting.set()
            start = time.monotonic()
            woken(60)
            slept.append(time.monotonic() - start)
    sleeper = threading.Thread(target=wait)
    sleeper.start()
    assert waiting.wait(30)
    beater.tell("node 1 (host h, rank 3) has not answered for 6 s (seen by rank 2)")
    sleeper.join(90)
    assert slept and slept[0] < 30, slept  # woken, not its minute run out
    assert other.verdict() == "node 1 (host h, rank 3) has not answered for 6 s (seen by rank 2)"
