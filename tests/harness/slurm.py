"""A real Slurm cluster on this machine, for ``make test-slurm``: Debian's slurmctld on a host
of its own and three slurmd, each host a network namespace (one bridge between them), a mount
namespace with its own ``/dev/shm`` and a UTS namespace with its own host name (``ctl``,
``node0`` to ``node2``). munged is the machine's. Jobs are submitted with ``sbatch`` on the
controller's host, as a user's would be, and Slurm starts their steps in the nodes' namespaces.

What this does not give: a network between machines (the bridge is in this kernel), an IB
fabric, cgroups (proctrack/linuxproc), a second machine's clock.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from typing import Optional

import pytest

from ftmem._shm.procs import cmdline

NODES = 3
SUBNET = "198.18.7"
CTL_ADDRESS = f"{SUBNET}.254"
TIMEOUT_S = 60  # a Slurm command, a daemon's start


def _run(*cmd: str) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def _mnt(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


class SlurmCluster:
    """The cluster, built at construction and removed by :meth:`close` (a context manager)."""

    def __init__(self, root: str):
        for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed: make test-slurm installs Debian's slurm-wlm and munge")
        self.root, tag = root, uuid.uuid4().hex[:6]
        self.netns = {"ctl": f"slurm-{tag}-ctl", **{f"node{n}": f"slurm-{tag}-n{n}" for n in range(NODES)}}
        self.holders: dict[str, subprocess.Popen] = {}
        self.daemons: dict[str, subprocess.Popen] = {}
        self.conf = os.path.join(root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        try:
            self._network()
            self._configure()
            _munged()
            for host in self.netns:
                self._hold(host)
            self.daemons["ctl"] = self._daemon("ctl", ["slurmctld", "-D", "-i"])
            for n in range(NODES):
                self.start_node(n)
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    # -- the hosts -------------------------------------------------------------------------
    def _network(self) -> None:
        ctl = self.netns["ctl"]
        for ns in self.netns.values():
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ctl, "addr", "add", f"{CTL_ADDRESS}/24", "dev", "br0")
        _run("ip", "-n", ctl, "link", "set", "br0", "up")
        for n in range(NODES):
            ns = self.netns[f"node{n}"]
            _run("ip", "link", "add", "fabric", "netns", ns, "type", "veth", "peer", "name", f"port{n}", "netns", ctl)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(n)}/24", "dev", "fabric")
            _run("ip", "-n", ns, "link", "set", "fabric", "up")
            _run("ip", "-n", ctl, "link", "set", f"port{n}", "master", "br0")
            _run("ip", "-n", ctl, "link", "set", f"port{n}", "up")

    @staticmethod
    def address(n: int) -> str:
        return f"{SUBNET}.{n + 1}"

    def _hold(self, host: str) -> None:
        """The host's mount and UTS namespaces (its name, and for a node a fresh /dev/shm),
        held by a sleep; the host's processes are started into them."""
        shm = "" if host == "ctl" else f"mount -t tmpfs -o size=2g,mode=1777 slurm-{host} /dev/shm && "
        hosts = f"mount --bind {self.hosts} /etc/hosts && "  # the cluster's names, as its DNS would give them
        self.holders[host] = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--propagation", "private", "--", "nsenter",
             f"--net=/run/netns/{self.netns[host]}", "--", "sh", "-c",
             f"hostname {host} && {hosts}{shm}exec sleep 1000000"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT_S
        while cmdline(self.holders[host].pid)[:1] != ["sleep"]:
            if self.holders[host].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {host} could not be made (exit {self.holders[host].poll()})")
            time.sleep(0.02)

    def on(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` on ``host`` (its network, mount and UTS namespaces)."""
        return subprocess.Popen(["nsenter", "-t", str(self.holders[host].pid), "-m", "-n", "-u", "--", *argv],
                                env=kwargs.pop("env", self.env), **kwargs)

    def _daemon(self, host: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.root, f"{host}.log"), "ab")
        try:
            return self.on(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def _configure(self) -> None:
        for d in ("state", "spool"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        self.hosts = os.path.join(self.root, "hosts")
        with open(self.hosts, "w") as f:
            f.write(f"127.0.0.1 localhost\n{CTL_ADDRESS} ctl\n" +
                    "".join(f"{self.address(n)} node{n}\n" for n in range(NODES)))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=ftmem
SlurmctldHost=ctl({CTL_ADDRESS})
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmdSpoolDir={self.root}/spool/%n
StateSaveLocation={self.root}/state
SchedulerType=sched/backfill
SelectType=select/linear
JobRequeue=1
KillWait=30
NodeName=node[0-{NODES - 1}] NodeAddr={SUBNET}.[1-{NODES}] CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start_node(self, n: int) -> None:
        self.daemons[f"node{n}"] = self._daemon(f"node{n}", ["slurmd", "-D"])

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                states = self.command("sinfo", "-h", "-N", "-o", "%N %t").split("\n")
            except RuntimeError:
                states = []
            if sum(line.endswith(" idle") for line in states) == NODES:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes did not come up within {TIMEOUT_S} s: {states}")
            time.sleep(0.5)

    # -- what a user and an operator do ----------------------------------------------------
    def command(self, *argv: str) -> str:
        """A Slurm command on the controller's host (sbatch, squeue, scancel, scontrol...)."""
        proc = self.on("ctl", list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {err.strip()}")
        return out.strip()

    def job_state(self, job: str) -> str:
        out = self.command("scontrol", "show", "job", job)
        return next(word.split("=", 1)[1] for word in out.split() if word.startswith("JobState="))

    def wait_for_state(self, job: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job} is {state}, not {sorted(states)}, after {timeout} s")
            time.sleep(0.5)

    def processes(self, n: int, running: str) -> list[int]:
        """The pids of node n's processes whose command line holds ``running``."""
        mnt = _mnt(self.holders[f"node{n}"].pid)
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _mnt(int(entry)) == mnt:
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if running.encode() in f.read():
                            found.append(int(entry))
                except OSError:
                    pass
        return found

    def lose_node(self, n: int) -> None:
        """The node's machine lost and replaced: its slurmd, its job steps' processes and its
        SMP SIGKILLed, its /dev/shm gone; then a slurmd again on an empty one."""
        host = f"node{n}"
        mnt = _mnt(self.holders[host].pid)
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holders[host].pid and _mnt(int(entry)) == mnt:
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.daemons.pop(host).wait()
        self.holders.pop(host).kill()
        self._hold(host)
        self.start_node(n)

    def close(self) -> None:
        """Everything started here ended, the namespaces removed."""
        for proc in list(self.daemons.values()):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        mnts = {_mnt(h.pid) for h in self.holders.values() if h.poll() is None} - {None}
        for entry in os.listdir("/proc"):  # job steps, their ranks and SMPs
            if entry.isdigit() and _mnt(int(entry)) in mnts:
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for holder in self.holders.values():
            holder.wait()
        for ns in self.netns.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=TIMEOUT_S)

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _munged() -> None:
    """The machine's munged, started where none runs (Debian starts it as a service)."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=TIMEOUT_S)
