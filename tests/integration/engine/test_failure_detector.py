"""The failure detector against a real TCP store when a beat fails: the connection of one
rank's beats is reset (a proxy between it and the store, as a NAT or a load balancer drops a
flow), and the beats must go on over a new one, so that the rank watching it sees no silence
(the ends of a whole job at a hung or lost node run through DeepSpeed:
test_deepspeed.py::test_a_hung_or_killed_node_ends_the_survivors_at_the_detector_s_timeout...)."""
import os
import subprocess
import sys
import textwrap

from harness.ranks import REPO

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
    proxy.reset()
    print("reset", file=sys.stderr, flush=True)  # (ftmem's log lines go to stderr)
    counter = lambda: store.add("ftmem/failure_detection/run/alive/0", 0)
    after_reset = counter()
    time.sleep(3 * TIMEOUT_S)  # a verdict ends this process with exit code 75
    print("beats after the reset:", counter() - after_reset, file=sys.stderr, flush=True)
    for detector in detectors:
        detector.stop()
""")


def test_a_beat_that_fails_takes_a_new_connection_and_the_watcher_sees_no_silence():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, env=dict(os.environ, FTMEM_LOG_LEVEL="DEBUG"))
    said = proc.stdout
    assert proc.returncode == 0, said  # 75: rank 1 took rank 0 for a lost node
    assert "rank 0: a heartbeat failed" in said.split("reset", 1)[1], said  # the reset broke a beat for real
    beats = int(said.split("beats after the reset:")[1].split()[0])
    assert beats >= 5, said  # 6 s at a beat every 0.4 s: the beats went on
