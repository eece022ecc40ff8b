"""Faults of the machine under a job, injected for real: a file system mounted for a test (a
tmpfs of a given size, later read-only), system calls made slow in running processes
(``strace``'s delay injection: the kernel's call waits, the process sees a slow disk), the
machine's wall clock stepped (as an NTP correction or an operator's ``date -s`` does), and a
memory cgroup with a limit (a container's), whose OOM killer is the kernel's own."""
import contextlib
import fcntl
import os
import signal
import subprocess
import time
from typing import Iterator, Sequence

import pytest


@contextlib.contextmanager
def tmpfs(path: str, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (``mount``'s form: ``64m``) mounted at ``path`` (made if missing)."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        # A process that just exited (an SMP) can keep the mount busy for a moment: retry, bounded.
        for _ in range(50):
            if subprocess.run(["umount", path], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", path], check=True)


def remount(path: str, how: str) -> None:
    """Remount the file system at ``path`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{how}", path], check=True)


@contextlib.contextmanager
def slow_calls(pids: Sequence[int], calls: Sequence[str], delay_s: float) -> Iterator[None]:
    """Every ``calls`` system call of the processes ``pids`` (all their threads, present and
    future) waits ``delay_s`` before the kernel runs it, until the block ends (strace detaches)."""
    tracers = [subprocess.Popen(["strace", "-f", "-qq", "-p", str(pid), "-o", "/dev/null", "-e",
                                 f"trace={','.join(calls)}", "-e",
                                 f"inject={','.join(calls)}:delay_enter={int(delay_s * 1e6)}"],
                                stderr=subprocess.PIPE) for pid in pids]
    try:
        deadline = time.monotonic() + 30
        while not all(traced(pid) for pid in pids):  # every thread, before the block goes on
            dead = [t for t in tracers if t.poll() is not None]
            assert not dead, dead[0].stderr.read().decode()
            assert time.monotonic() < deadline, f"strace did not attach to {list(pids)} within 30 s"
            time.sleep(0.05)
        yield
    finally:
        for tracer in tracers:
            tracer.terminate()
            tracer.wait(30)


def traced(pid: int) -> bool:
    """Whether every thread of ``pid`` has a tracer."""
    tasks = f"/proc/{pid}/task"
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/status") as f:
                if next(line for line in f if line.startswith("TracerPid:")).split()[1] == "0":
                    return False
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return True


class WallClock:
    """The machine's wall clock (CLOCK_REALTIME), stepped by :meth:`step`; every process on the
    machine sees each step, as they would an NTP correction."""

    stepped = False

    def step(self, seconds: float) -> None:
        try:
            time.clock_settime(time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME) + seconds)
        except PermissionError:
            pytest.skip("this machine does not let the tests set its clock (CAP_SYS_TIME)")
        self.stepped = True


CLOCK_LOCK = "/tmp/ftmem-test-wall-clock.lock"


@contextlib.contextmanager
def stepped_clock() -> Iterator[WallClock]:
    """A :class:`WallClock` to step during the block; after it the clock reads what it would
    have read unstepped (the monotonic clock measured the time that passed). One block at a time
    on the machine (a lock file): two test runs side by side that stepped it at once would each
    put back the other's step."""
    with open(CLOCK_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        offset = time.clock_gettime(time.CLOCK_REALTIME) - time.monotonic()
        clock = WallClock()
        try:
            yield clock
        finally:
            if clock.stepped:
                time.clock_settime(time.CLOCK_REALTIME, time.monotonic() + offset)


class MemoryCgroup:
    """A memory cgroup (v1) under this process's own: processes join it with :attr:`wrapper`,
    its limit is set with :meth:`limit`, and the kernel's OOM kills in it are counted."""

    def __init__(self, path: str):
        self.path = path
        # A command that runs the command after it inside the cgroup.
        self.wrapper = ("sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh")

    def read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def limit(self, nbytes: int) -> None:
        with open(os.path.join(self.path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(nbytes))

    def usage(self) -> int:
        return int(self.read("memory.usage_in_bytes"))

    def oom_kills(self) -> int:
        return int(dict(line.split() for line in self.read("memory.oom_control").splitlines())["oom_kill"])

    def pids(self) -> list[int]:
        return [int(pid) for pid in self.read("cgroup.procs").split()]


@contextlib.contextmanager
def memory_cgroup() -> Iterator[MemoryCgroup]:
    """A :class:`MemoryCgroup` for the block; whatever runs in it at the end is SIGKILLed, and
    it is removed."""
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line), None)
    if own is None or not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.skip("no cgroup v1 memory controller here")
    path = f"/sys/fs/cgroup/memory{own.rstrip('/')}/ftmem-test-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(path)
    group = MemoryCgroup(path)
    try:
        yield group
    finally:
        deadline = time.monotonic() + 30
        while group.pids():
            for pid in group.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline, f"processes of {path} outlived SIGKILL: {group.pids()}"
            time.sleep(0.05)
        os.rmdir(path)
