"""``ftmem bench control-plane``: the load ftmem's ranks put on the job's one TCP store, and
how long an event takes to reach every rank, against the number of ranks.

One real store (torch's ``TCPStore``, the kind torchrun's agent and the deepspeed launcher
start, in a process of its own) and N simulated ranks, spread over worker processes as
threads, each rank on a connection of its own. Each rank runs ftmem's own code for each path;
only its training is left out:

* ``detector``: the failure detector
  (:class:`~ftmem._engine.failure_detector.FailureDetector`) of every rank beats and watches
  (each node's in a directory of its own in ``/dev/shm``); then one rank falls silent as a
  failing one does, and the figure is the time from its silence to every other rank's
  detector ending its rank (the rank's end is recorded in place of ``os._exit``). It includes
  the detector's timeout (``--detector-timeout-s``), which the output states beside it;
* ``preemption``: every rank told to stop (a SIGTERM to every rank, which a scheduler's
  signals deliver over a second or so: ``--spread-s``), each deciding with the others whether
  the whole job was (:func:`~ftmem._engine.preemption.whole_job_told`); the figure is the time
  from the last rank's signal until every rank has the decision;
* ``end``: every rank votes on the job's end (:func:`~ftmem._common.agreement.unanimous`,
  the engine's close), the ranks coming over the same spread; the time counts from the last;
* ``arrivals``: every rank records its arrival at a group's making, as ftmem's
  ``new_group`` does (torch's own store barrier of the group is torch's and left out).

Per path and N it prints the requests per second the store served (every request the ranks
made, over the time from the first to the last; the detector's over a steady window, before
the failure), the store's CPU seconds per second, the latency a rank saw per request (median,
p99), the event's time to every rank, and the time from the first rank knowing to the last
(the detector's: from the verdict's first reader to its last, the timeout's phase aside).
Nothing is drained outside the timers. On this machine's 2 cores the ranks' own Python and
the store share the CPU: the figures at the largest N are the machine's limit as much as the
store's, and the output says how busy the CPU was.
"""
from __future__ import annotations

import json
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ftmem._common.agreement import Decision, unanimous
from ftmem._common.job_store import StandingConnection
from ftmem._engine.failure_detector import FailureDetector, interval_s
from ftmem._engine.preemption import arrival_s, whole_job_told
from ftmem._shm.node_beats import NodeBeats
from ftmem._shm.node_round import SharedMemoryRound
from ftmem.cli import Parser, positive_int

RANKS = (64, 1024, 4096, 16384)
PATHS = ("detector", "preemption", "end", "arrivals")
WORKERS = 8
RANKS_PER_CPU = 2048
RANKS_PER_NODE = 8
DETECTOR_TIMEOUT_S = 20
PREEMPTION_GRACE_S = 30  # a scheduler's usual grace: the ranks wait arrival_s of it for each other
END_WAIT_S = 120.0  # the engine's close waits this long for the others (finish_timeout_s)
START_WAIT_S = 300.0  # for the workers to connect their ranks
CONNECTING = 64  # connections a worker makes at a time
# Paths whose ranks come over a spread of time, not at once: a scheduler's SIGTERM reaches a
# job's ranks within a second or two, and ranks end their training loops as far apart.
SPREAD = ("preemption", "end")
SPREAD_S = 1.0
STACK_BYTES = 512 * 1024  # per simulated rank's thread: tens of thousands of them


# -- a rank's connection, counting --------------------------------------------------------
class CountedStore(dist.Store):
    """A rank's own connection to the job's TCP store, which notes each request's kind, start
    and latency. Every request goes to the real store. ftmem's code takes a connection of its
    own for each thread that may wait on the store (``own_connection``), which hands a store
    that is no TCPStore back as it is: so the first thread to use this one has its connection,
    and each other thread (the preemption's watch of its host) gets a new one, counted too."""

    def __init__(self, host: str, port: int, wait_s: float):
        super().__init__()
        self._connect = lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False,  # noqa: E731
                                              timeout=timedelta(seconds=wait_s))
        self._first, self._first_thread = self._connect(), None
        self._lock, self._own = threading.Lock(), threading.local()
        self.requests: list[tuple[str, float, float]] = []  # (kind, start, latency), monotonic seconds

    def _tcp(self) -> dist.TCPStore:
        tcp = getattr(self._own, "tcp", None)
        if tcp is None:
            with self._lock:
                if self._first_thread is None:
                    self._first_thread, tcp = threading.get_ident(), self._first
            self._own.tcp = tcp = tcp or self._connect()
        return tcp

    def _timed(self, method: str, *args):
        tcp = self._tcp()
        start = time.monotonic()
        try:
            return getattr(tcp, method)(*args)
        except Exception:
            # A request that timed out leaves its answer on the way: the thread's next request
            # takes a new connection, as a rank's next own_connection would.
            if method != "wait":  # (a wait that runs out is cancelled: its connection is sound)
                self._own.tcp = None
            raise
        finally:
            self.requests.append((method, start, time.monotonic() - start))

    def set(self, key, value):
        return self._timed("set", key, value)

    def multi_set(self, keys, values):
        return self._timed("multi_set", keys, values)

    def get(self, key):
        return self._timed("get", key)

    def add(self, key, amount):
        return self._timed("add", key, amount)

    def check(self, keys):
        return self._timed("check", keys)

    def compare_set(self, key, expected, desired):
        return self._timed("compare_set", key, expected, desired)

    def wait(self, keys, timeout=None):
        return self._timed("wait", keys, *(() if timeout is None else (timeout,)))

    def delete_key(self, key):
        return self._timed("delete_key", key)

    def set_timeout(self, timeout):
        self._tcp().set_timeout(timeout)  # on this end alone: no request


class SimulatedDetector(FailureDetector):
    """ftmem's failure detector whose rank's end (``os._exit``) is recorded instead: the
    worker's other ranks go on."""

    ended_at: Optional[float] = None

    def _end(self, verdict: str) -> None:
        if self.ended_at is None and not self._stopped.is_set():
            self.ended_at = time.monotonic()
        self._stopped.set()


# -- a worker: a share of the ranks ---------------------------------------------------------
def worker(spec: dict) -> None:
    """Run ``spec["ranks"]`` of a job of ``spec["world"]`` ranks on ``spec["path"]``: connect
    them, say ready, wait for the start time on stdin, then print the figures as one JSON line."""
    threading.stack_size(STACK_BYTES)
    host, port, world, path, run = spec["host"], spec["port"], spec["world"], spec["path"], spec["run"]
    ranks = range(*spec["ranks"])
    timeout_s = float(spec["detector_timeout_s"])
    wait_s = max(timeout_s, 60.0)
    # Connected side by side: torch's store client looks the store's address up in DNS at each
    # connection (for its log lines), and where the resolver is slow that is seconds each.
    with ThreadPoolExecutor(CONNECTING) as pool:
        stores = list(pool.map(lambda _: CountedStore(host, port, wait_s), ranks))
    print("ready", flush=True)
    start = float(sys.stdin.readline())  # monotonic: the same clock in every process of the machine
    done: list[float] = []
    if path == "detector":
        # Every rank's detector starts at the start (a job's start them after a collective): a
        # watch that began before its watched rank's would count the gap as silence.
        time.sleep(max(0.0, start - time.monotonic()))
        detectors = []
        for rank, store in zip(ranks, list(stores)):
            detectors.append(SimulatedDetector(_connector(store, host, port, wait_s, stores), "the bench's store",
                                               run, rank, world, RANKS_PER_NODE, timeout_s, _node_beats(spec, rank)))
        # The steady window begins once every worker's detectors beat (the parent says when):
        # on a loaded machine, starting tens of detectors takes long enough that the first
        # beats' one-off read of the watched rank's host would fall in a window counted from
        # the start.
        print("beating", flush=True)
        fail_at = float(sys.stdin.readline())
        victim = world - 1
        time.sleep(max(0.0, fail_at - time.monotonic()))
        for d in detectors:
            if d.rank == victim:
                d.fall_silent()
        bound = fail_at + timeout_s + 6 * interval_s(timeout_s)
        while time.monotonic() < bound and any(d.ended_at is None for d in detectors if d.rank != victim):
            time.sleep(0.1)
        done = [d.ended_at - fail_at for d in detectors if d.rank != victim and d.ended_at is not None]
        missed = [f"rank {d.rank} never heard" for d in detectors if d.rank != victim and d.ended_at is None]
        for d in detectors:
            d.stop()
        window = (fail_at - spec["window_s"], fail_at)
    else:
        spread_s = spec["spread_s"] if path in SPREAD else 0.0
        missed: list[str] = []  # the answers of ranks that decided otherwise
        everyone_at = start + spread_s  # the event's end: the last rank's signal, or its end of training

        def one(rank: int, store: CountedStore) -> None:
            key = f"ftmem/{path}/{run}"
            # (A job makes the connection at the engine's start; on one made already, as here, that
            # asks nothing of the store. So does its node's round.)
            wait_s = arrival_s(PREEMPTION_GRACE_S) if path == "preemption" else END_WAIT_S
            connection, node = StandingConnection(store, wait_s), _node_round(spec, rank, key)
            # The ranks come in a shuffled order over the spread, not a worker's at a time.
            time.sleep(max(0.0, start + spread_s * (rank * 7919 % world) / (world - 1) - time.monotonic()))
            try:
                if path == "preemption":
                    answer = whole_job_told(rank, world, lambda: [], wait_s, connection, key, node)
                elif path == "end":
                    answer = unanimous(connection, key, rank, world, None, wait_s, node)
                else:
                    answer = Decision(store, "ftmem/group_arrivals/1", rank, world).arrive() and None
            except Exception as e:  # (the store did not answer in time: the row says so)
                answer = f"rank {rank} raised {e}"
            if answer is None:  # every rank was told, every rank finished
                done.append(time.monotonic() - everyone_at)
            else:
                missed.append(answer)
        threads = [threading.Thread(target=one, args=(rank, store)) for rank, store in zip(ranks, stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        window = None
    requests = [r for s in stores for r in s.requests if window is None or window[0] <= r[1] < window[1]]
    print(json.dumps({"done": done, "missed": missed, "requests": len(requests),
                      # (none where every rank of the worker heard from its node's speaker)
                      "first": min((r[1] for r in requests), default=None),
                      "last": max((r[1] + r[2] for r in requests), default=None),
                      # a wait's is how long the answer took to come, not the store's
                      "latencies": [r[2] for r in requests if r[0] != "wait"],
                      "kinds": Counter(r[0] for r in requests), "ranks": len(ranks),
                      "window": None if window is None else window[1] - window[0]}), flush=True)


def _node_round(spec: dict, rank: int, key: str) -> Optional[SharedMemoryRound]:
    """The round of ``rank``'s node, where ranks decide node by node; None where they decide
    each on its own (``--by-rank``)."""
    node = _node(spec, rank)
    return None if node is None else SharedMemoryRound(node[0], key, node[1], rank)


def _node_beats(spec: dict, rank: int) -> Optional[NodeBeats]:
    """The beats of ``rank``'s node, where a node beats as one; None where each rank beats on
    the store (``--by-rank``)."""
    node = _node(spec, rank)
    return None if node is None else NodeBeats(node[0], spec["run"], node[1], rank)


def _node(spec: dict, rank: int) -> Optional[tuple[str, range]]:
    """The directory of ``rank``'s node (under the bench's) and the node's ranks; None where
    each rank acts on its own (``--by-rank``)."""
    per_node = spec["ranks_per_node"]
    if spec["by_rank"] or per_node == 1:
        return None
    node = rank // per_node
    node_dir = os.path.join(spec["nodes_dir"], f"node{node}")
    os.makedirs(node_dir, mode=0o700, exist_ok=True)
    return node_dir, range(node * per_node, min(spec["world"], (node + 1) * per_node))


def _connector(first: CountedStore, host: str, port: int, wait_s: float, made: list):
    """A detector's ``connect``: the rank's connection ``first``, then new ones (a beat that
    failed takes one), added to ``made`` so that their requests count too."""
    pending = [first]

    def connect() -> CountedStore:
        if pending:
            return pending.pop()
        store = CountedStore(host, port, wait_s)
        made.append(store)
        return store
    return connect


# -- the store, in a process of its own -----------------------------------------------------
def serve() -> None:
    """The job's store: a TCPStore server on a free port (printed), until stdin closes."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_WAIT_S))
    print(store.port, flush=True)
    sys.stdin.read()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _readline(proc: subprocess.Popen, bound: float, who: str) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, bound - time.monotonic()))
    if not ready:
        raise SystemExit(f"ftmem bench control-plane: {who} gave nothing within its bound; its output so far is "
                         f"above")
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"ftmem bench control-plane: {who} ended (exit code {proc.wait()}) before giving its "
                         f"figures: see its error above")
    return line


def _tell(procs: list[subprocess.Popen], when: float) -> None:
    """Give every worker a time on the machine's monotonic clock (the start, the failure's)."""
    for p in procs:
        p.stdin.write(f"{when}\n")
        p.stdin.flush()


def names_from_files(directory: str) -> list[str]:
    """A command prefix under which a process resolves host names and addresses from
    /etc/hosts alone (a mount namespace of its own, where nsswitch.conf says ``hosts: files``),
    or [] where this process cannot make one (it needs root). torch's store looks up the
    address of every new connection by name (for its log lines), on the one thread that serves
    every request: a resolver that drops queries (this machine's does, 5 s each) would stall
    the whole store at each, and make the bench's start take hours at 16,384 ranks."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    conf = os.path.join(directory, "nsswitch.conf")
    with open("/etc/nsswitch.conf") as f:
        lines = [line for line in f.read().splitlines() if not line.split(":")[0].strip() == "hosts"]
    with open(conf, "w") as f:
        f.write("\n".join(lines + ["hosts: files"]) + "\n")
    prefix = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/nsswitch.conf && exec "$@"', conf]
    if subprocess.run(prefix + ["true"], capture_output=True).returncode != 0:
        return []
    return prefix


def measure(path: str, world: int, workers: int, detector_timeout_s: float, spread_s: float, by_rank: bool,
            prefix: list[str]) -> dict:
    """One path at one size, on a store of its own, its nodes' rounds in a directory of their own
    in shared memory; its processes started under ``prefix``."""
    me = prefix + [sys.executable, "-m", "benchmarks.bench_control_plane"]
    store = subprocess.Popen(me + ["--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = []
    nodes_dir = tempfile.mkdtemp(prefix="ftmem-bench-nodes-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        port = int(_readline(store, time.monotonic() + 60, "the store"))
        run, share = uuid.uuid4().hex[:8], -(-world // workers)
        # The detector's: after every rank's detector started, two beats (each has read its
        # watched rank's host), then the window of steady beats whose requests count.
        warmup_s, window_s = 2 * interval_s(detector_timeout_s), 3 * interval_s(detector_timeout_s)
        for first in range(0, world, share):
            spec = {"host": "127.0.0.1", "port": port, "world": world, "path": path, "run": run,
                    "ranks": [first, min(world, first + share)], "detector_timeout_s": detector_timeout_s,
                    "window_s": window_s, "spread_s": spread_s, "by_rank": by_rank,
                    "ranks_per_node": RANKS_PER_NODE, "nodes_dir": nodes_dir}
            procs.append(subprocess.Popen(me + ["--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        bound = time.monotonic() + START_WAIT_S
        for i, p in enumerate(procs):
            assert _readline(p, bound, f"worker {i} (connecting its ranks)").strip() == "ready"
        start = time.monotonic() + 0.5
        store_cpu, machine_cpu = _cpu_s(store.pid), _machine_cpu_s()
        _tell(procs, start)
        if path == "detector":
            bound = time.monotonic() + START_WAIT_S
            for i, p in enumerate(procs):
                assert _readline(p, bound, f"worker {i} (starting its detectors)").strip() == "beating"
            _tell(procs, time.monotonic() + warmup_s + window_s)
        bound = time.monotonic() + warmup_s + window_s + spread_s + 3 * detector_timeout_s + END_WAIT_S
        parts = [json.loads(_readline(p, bound, f"worker {i} (running {path})")) for i, p in enumerate(procs)]
        elapsed = time.monotonic() - start
        store_cpu, machine_cpu = _cpu_s(store.pid) - store_cpu, _machine_cpu_s() - machine_cpu
    finally:
        for p in procs + [store]:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(nodes_dir, ignore_errors=True)
    requests = sum(part["requests"] for part in parts)
    latencies = sorted(x for part in parts for x in part["latencies"])
    done = [d for part in parts for d in part["done"]]
    missed = [answer for part in parts for answer in part["missed"]]
    span = parts[0]["window"] or (max(part["last"] for part in parts if part["last"] is not None) -
                                  min(part["first"] for part in parts if part["first"] is not None))
    kinds = Counter()
    for part in parts:
        kinds.update(part["kinds"])
    return {"time_s": max(done, default=0.0), "first_to_last_s": max(done, default=0.0) - min(done, default=0.0),
            "missed_n": len(missed), "missed": missed[:1], "store_rps_n": requests / span,
            "per_rank_n": requests / world,
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[int(len(latencies) * 0.99)],
            "store_cpu_x": store_cpu / elapsed, "machine_cpu_x": machine_cpu / elapsed, "kinds": kinds}


def _threads_needed(path: str, world: int, by_rank: bool) -> int:
    """A rank's thread, and for the detector a judge's on each rank that beats on the store."""
    judges = 0 if path != "detector" else world if by_rank else -(-world // RANKS_PER_NODE)
    return world + judges


def bench_control_plane(sizes, paths, workers: int, detector_timeout_s: float, spread_s: float, by_rank: bool,
                        plot: Optional[str]) -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the store holds a connection per rank
    for path in paths:
        for n in sizes:
            threads = _threads_needed(path, n, by_rank)
            if threads > pid_max * 0.9:
                raise SystemExit(f"ftmem bench control-plane: {path} at {n} ranks runs {threads} "
                                 f"threads, and this machine's kernel.pid_max is {pid_max}: raise it (sysctl -w "
                                 f"kernel.pid_max=4194304) or leave {n} out of --ranks")
            if n + 64 > hard:
                raise SystemExit(f"ftmem bench control-plane: the store takes a connection per rank, and this "
                                 f"process may open {hard} files: raise the hard limit (ulimit -Hn) above {n + 64} "
                                 f"or leave {n} out of --ranks")
    prefix = names_from_files(tempfile.mkdtemp(prefix="ftmem-bench-"))
    if not prefix:
        print("(not root: the store's processes resolve names as this machine does; where the resolver is slow, "
              "so is every new connection to the store, and the bench's start)")
    print(f"ftmem bench control-plane: one TCPStore, ranks as threads of {workers} processes, {RANKS_PER_NODE} ranks "
          f"a node; the detector's timeout {detector_timeout_s:g} s (a beat every "
          f"{interval_s(detector_timeout_s):g} s); the ranks come to {' and '.join(SPREAD)} over {spread_s:g} s, "
          f"each path's time to every rank counts from the last; {os.cpu_count()} CPUs", flush=True)
    print("(each rank beats on the store, and asks it at a decision of the whole job, on its own: the design before "
          "ftmem's nodes beat and decide as one)" if by_rank else
          "(each node's beater alone beats on the store, and its speaker alone asks it at a decision of the whole job; "
          "the node's other ranks beat and hear the answer in the node's shared memory)", flush=True)
    print(f"{'path':10s} {'ranks':>6s} {'to every rank':>14s} {'first to last':>13s} {'store req/s':>12s} "
          f"{'req/rank':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'store CPU':>9s} {'all CPU':>8s}  requests", flush=True)
    result, rows = {}, {}
    for path in paths:
        for n in sizes:
            m = measure(path, n, min(workers, n), detector_timeout_s, spread_s, by_rank, prefix)
            rows[path, n] = m
            kinds = " ".join(f"{k}:{v}" for k, v in sorted(m["kinds"].items()))
            print(f"{path:10s} {n:6d} {m['time_s']:12.3f} s {m['first_to_last_s']:11.3f} s {m['store_rps_n']:12.0f} "
                  f"{m['per_rank_n']:9.1f} "
                  f"{m['p50_s'] * 1e3:8.2f} {m['p99_s'] * 1e3:8.2f} {m['store_cpu_x']:9.2f} "
                  f"{m['machine_cpu_x']:8.2f}  {kinds}", flush=True)
            if m["missed_n"]:
                print(f"  ^ {m['missed_n']} rank(s) decided otherwise or never heard, e.g. {m['missed'][0]!r} (their "
                      f"times are not in the row)", flush=True)
            for key in ("time_s", "first_to_last_s", "missed_n", "store_rps_n", "per_rank_n", "p50_s", "p99_s",
                        "store_cpu_x"):
                result[f"{path}_{n}_{key}"] = m[key]
        result[f"{path}_growth_x"] = rows[path, sizes[-1]]["time_s"] / rows[path, sizes[0]]["time_s"]
    if "detector" in paths:
        print(f"(the detector's times include its timeout of {detector_timeout_s:g} s: a silent rank is one whose "
              f"counter has not moved for that long)")
    print("(store req/s: per path, every request of the ranks over the time from the first to the last; the "
          "detector's over its steady beats before the failure. CPU: seconds busy per second, of the store's process "
          "and of the whole machine)")
    if plot:
        _plot(rows, sizes, paths, plot)
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))  # the last line, as every benchmark's


def _plot(rows: dict, sizes, paths, path_png: str) -> None:
    from benchmarks.plots import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        left.plot(sizes, [rows[path, n]["time_s"] for n in sizes], marker="o", label=path)
        right.plot(sizes, [rows[path, n]["store_rps_n"] for n in sizes], marker="o", label=path)
    for ax, label in ((left, "event to every rank (s)"), (right, "requests per second at the store")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path_png)
    print(f"plot: {path_png}")


def _default_sizes() -> tuple:
    """RANKS, those this machine can run in time: each simulated rank is a thread (two for the
    detector) running ftmem's Python, and past a few thousand a CPU the threads' contention for
    the interpreter, not the store, is what the figures measure (16,384 ranks on 2 CPUs did not
    finish a decision within minutes). --ranks runs any size."""
    fits = tuple(n for n in RANKS if n <= RANKS_PER_CPU * (os.cpu_count() or 1))
    if fits != RANKS:
        left_out = ", ".join(str(n) for n in RANKS if n not in fits)
        print(f"(leaving out {left_out} ranks: more than {RANKS_PER_CPU} a CPU on this machine's {os.cpu_count()}; "
              f"--ranks runs them)")
    return fits


def _int_list(text: str) -> tuple:
    return tuple(positive_int(part) for part in text.split(","))


def _paths(text: str) -> tuple:
    chosen = tuple(text.split(","))
    unknown = [p for p in chosen if p not in PATHS]
    if unknown:
        raise ValueError(f"unknown path(s) {unknown}: choose from {', '.join(PATHS)}")
    return chosen


def main(argv=None) -> int:
    """``ftmem bench control-plane``; with ``--serve``, the store; with ``--worker``, a share of the ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--serve"]:
        serve()
        return 0
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
        return 0
    parser = Parser(prog="ftmem bench control-plane", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ranks", type=_int_list, default=None,
                        help=f"simulated job sizes (default {','.join(map(str, RANKS))}, those up to "
                             f"{RANKS_PER_CPU} a CPU)")
    parser.add_argument("--paths", type=_paths, default=PATHS, help=f"paths to run (default {','.join(PATHS)})")
    parser.add_argument("--workers", type=positive_int, default=WORKERS,
                        help=f"processes the ranks run in (default {WORKERS})")
    parser.add_argument("--detector-timeout-s", type=positive_int, default=DETECTOR_TIMEOUT_S,
                        help=f"the failure detector's timeout (default {DETECTOR_TIMEOUT_S}; ftmem's own default "
                             f"is 60)")
    parser.add_argument("--spread-s", type=float, default=SPREAD_S,
                        help=f"seconds over which the ranks come to {' and '.join(SPREAD)} (default {SPREAD_S:g})")
    parser.add_argument("--by-rank", action="store_true",
                        help="each rank beats on the store, and makes the decisions of the whole job there, on its "
                             "own, not through its node (the design before it, for comparison)")
    parser.add_argument("--tiny", action="store_true", help="16 and 64 ranks, a detector timeout of 2 s (a check)")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.tiny:
        sizes, timeout_s = (16, 64), 2
    else:
        sizes, timeout_s = args.ranks or _default_sizes(), args.detector_timeout_s
    bench_control_plane(sizes, args.paths, args.workers, timeout_s, args.spread_s, args.by_rank, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
