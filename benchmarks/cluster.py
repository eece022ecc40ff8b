"""A small virtual cluster on one machine, for ``ftmem bench scale`` (needs root).

Each host is a network namespace with a mount namespace of its own whose ``/dev/shm`` is a
private tmpfs (held by a ``sleep`` process, so that it outlives the ranks: a job restarts on
the same host and finds its memory). Every host has two links, a veth pair each, to two
bridges in a "switch" namespace of their own: the *fabric* (``fabric`` on every host,
198.18.1.<n+1>, no limit), which the training's gloo takes, and the *front-end* (``front``,
198.18.2.<n+1>), limited by ``tc`` (a token bucket each way), which ftmem's groups take.
Nothing crosses into the machine's own namespace. Everything is removed by :meth:`close`,
whatever happened; names carry the benchmark's pid.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Optional

FABRIC, FRONT = "fabric", "front"
SUBNETS = {FABRIC: "198.18.1", FRONT: "198.18.2"}


def _run(*cmd: str) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def _ns_inode(pid: int, kind: str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def tbf(rate_mbit: float) -> list[str]:
    """The ``tc qdisc ... root`` arguments of a token bucket at ``rate_mbit`` Mbit/s: a burst
    of about 2 ms of traffic (at least 32 KiB) and at most 50 ms queued."""
    burst = max(32 << 10, int(rate_mbit * 1e6 / 8 * 0.002))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


class Cluster:
    """``hosts`` hosts; :meth:`start` runs a command on one, :meth:`lose` loses one."""

    def __init__(self, hosts: int, front_mbit: float, tag: Optional[str] = None, shm_size: str = "2g"):
        if os.geteuid() != 0:
            raise SystemExit("ftmem bench scale builds network namespaces, veth pairs and tmpfs mounts: run it as root")
        self.tag = tag or f"ftscale-{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{n}" for n in range(hosts)]
        self.front_mbit, self.shm_size = front_mbit, shm_size
        self.holders: dict[int, subprocess.Popen] = {}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.names):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for bridge in ("br-fabric", "br-front"):
            _run("ip", "-n", self.switch, "link", "add", bridge, "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", bridge, "up")
        for n, ns in enumerate(self.names):
            for name, subnet in SUBNETS.items():
                port = f"{name[:2]}{n}"  # the switch's end
                _run("ip", "link", "add", name, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _run("ip", "-n", ns, "addr", "add", f"{subnet}.{n + 1}/24", "dev", name)
                _run("ip", "-n", ns, "link", "set", name, "up")
                _run("ip", "-n", self.switch, "link", "set", port, "master", f"br-{name}")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                if name == FRONT:  # both ways: what the host sends, and what the switch sends it
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", name, "root", *tbf(self.front_mbit))
                    _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port, "root",
                         *tbf(self.front_mbit))
            self._hold(n)

    def _hold(self, n: int) -> None:
        """Host n's mount namespace with a fresh tmpfs on /dev/shm, held by a sleep."""
        holder = subprocess.Popen(
            ["ip", "netns", "exec", self.names[n], "unshare", "--mount", "--propagation", "private", "--",
             "sh", "-c", f"mount -t tmpfs -o size={self.shm_size},mode=1777 {self.tag} /dev/shm && exec sleep 1000000"],
            stdin=subprocess.DEVNULL)
        self.holders[n] = holder
        deadline = time.monotonic() + 30
        while not self._comm(holder.pid) == "sleep":
            if holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {n}'s /dev/shm could not be made (exit {holder.poll()})")
            time.sleep(0.02)

    @staticmethod
    def _comm(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""

    def address(self, n: int, network: str = FABRIC) -> str:
        return f"{SUBNETS[network]}.{n + 1}"

    def start(self, n: int, argv: list[str], env: dict, log: str, cwd: str) -> subprocess.Popen:
        """Run ``argv`` on host n (its network and its mount namespace, /dev/shm its own)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["nsenter", "-t", str(self.holders[n].pid), "-m", "-n", f"--wd={cwd}", "--", *argv],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def _pids_in(self, n: int) -> list[int]:
        """Every process in host n's mount namespace but its holder (ranks, SMPs)."""
        holder = self.holders.get(n)
        if holder is None or holder.poll() is not None:
            return []
        mnt = _ns_inode(holder.pid, "mnt")
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != holder.pid and _ns_inode(int(entry), "mnt") == mnt and mnt:
                pids.append(int(entry))
        return pids

    def kill_host_processes(self, n: int) -> list[int]:
        pids = self._pids_in(n)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:  # those started here: reaped (the SMPs are not our children)
            if proc.pid in pids:
                proc.wait()
        return pids

    def shm_files(self, n: int) -> int:
        """How many files host n's /dev/shm holds."""
        out = _run("nsenter", "-t", str(self.holders[n].pid), "-m", "--", "find", "/dev/shm", "-type", "f")
        return len(out.split())

    def lose(self, n: int) -> list[int]:
        """A node loss: SIGKILL every process of host n (its ranks and its SMP), delete its
        /dev/shm (the tmpfs goes with its holder), and give it a new, empty one."""
        pids = self.kill_host_processes(n)
        _run("nsenter", "-t", str(self.holders[n].pid), "-m", "--", "sh", "-c", "rm -rf /dev/shm/* /dev/shm/.[!.]*")
        self._drop_holder(n)
        self._hold(n)
        return pids

    def _drop_holder(self, n: int) -> None:
        holder = self.holders.pop(n, None)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()

    def close(self) -> None:
        """Kill what runs on the hosts, drop their tmpfs, delete the namespaces (with them the
        veth pairs, the bridges and the qdiscs)."""
        for n in list(self.holders):
            self.kill_host_processes(n)
        for proc in self.procs:  # anything started here that left its namespace (none should)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for n in list(self.holders):
            self._drop_holder(n)
        # A process left in a host's network namespace (none should be) keeps it alive
        # after its name is deleted: kill those first.
        nets = {_ns_inode_of_netns(ns) for ns in self._made} - {None}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _ns_inode(int(entry), "net") in nets:
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self._made.clear()


def _ns_inode_of_netns(name: str) -> Optional[str]:
    try:
        st = os.stat(f"/run/netns/{name}")
    except OSError:
        return None
    return f"net:[{st.st_ino}]"
