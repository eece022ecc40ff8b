"""Helpers every tier shares: test identities, private shared memory, the ``ftmem``
command, corrupting a byte, reading contract lines, and runs kept once per session."""
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import uuid

from ftmem import SnapshotEngine
from ftmem._shm import jobs
from ftmem._shm.procs import cmdline, pid_alive

from . import ranks

REPO = ranks.REPO  # the repository's root

# Per session, so that a suite running beside another (a local run during CI) checks only its own.
TEST_SHM_PREFIX = f"/dev/shm/ftmem-test-{uuid.uuid4().hex[:6]}-"


def leftover_smps() -> list[int]:
    """SMP processes of this session's shared memory that still run."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_alive(int(entry)):
            args = cmdline(int(entry))
            if any("ftmem._shm.smp" in a for a in args) and any(TEST_SHM_PREFIX in a for a in args):
                pids.append(int(entry))
    return pids


# What each kind of uninterrupted reference run gave, by its arguments (see run_once).
_REFERENCE_RUNS: dict = {}


class StockFailed(AssertionError):
    """A reference run without ftmem failed: the framework's default engine itself does not run
    this job here (``make test-compat`` reports the test as failing stock, not with ftmem)."""

    def __init__(self, what: str, log: str):
        errors = [ln for ln in log.splitlines() if "Error" in ln]
        super().__init__(f"{what} failed without ftmem: {errors[-1].strip() if errors else 'see its log'}\n"
                         f"{log[-5000:]}")


def run_once(key: tuple, run):
    """``run()``'s result, run once per session for each ``key``. For the uninterrupted
    reference runs that bitwise tests compare against: they are deterministic, only read
    afterwards (their folders stay for the session), and several tests compare against the
    same one; running each once saves minutes of the suite. A run that fails is not kept."""
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run()
    return _REFERENCE_RUNS[key]


def held_versions(shm_dir: str, job: str) -> dict:
    """The versions each node of ``job`` holds in shared memory (``{}``: the job's memory is freed)."""
    return {n["node"]: n["versions"] for n in jobs.status(shm_dir, job)["jobs"][0]["nodes"]}


def new_shm_dir() -> str:
    path = TEST_SHM_PREFIX + uuid.uuid4().hex[:8]
    os.makedirs(path)
    return path


def free_shm_dir(path: str) -> None:
    for job in jobs.list_jobs(path):
        jobs.clean(path, job)
    shutil.rmtree(path, ignore_errors=True)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftmem.cli", *args], capture_output=True, text=True, timeout=120)


# The unit each RESULT key ends with: seconds, throughputs, ratios, sizes in MiB, counts.
UNITS = ("_s", "_gbps", "_x", "_mb", "_n")


def result_figures(out) -> dict:
    """The figures of a benchmark run that ran to its end, whose output ends with its one
    RESULT line, of ``key=value`` pairs, each key once and naming its unit, each value a
    finite number."""
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    results = [line for line in lines if line.startswith("RESULT")]
    assert len(results) == 1 and lines[-1] == results[0], lines[-3:]
    pairs = [kv.split("=") for kv in results[0].removeprefix("RESULT ").split()]
    assert pairs and all(len(kv) == 2 for kv in pairs), results[0]
    figures = {key: float(value) for key, value in pairs}
    assert len(figures) == len(pairs), results[0]
    assert [key for key in figures if not key.endswith(UNITS)] == [], results[0]
    assert [key for key, value in figures.items() if not math.isfinite(value)] == [], results[0]
    return figures


def job_id() -> str:
    return "t-" + uuid.uuid4().hex[:8]


def make_engine(shm_dir, job=None, **cfg) -> SnapshotEngine:
    """A one-rank engine on one node (with its SMP) in ``shm_dir``."""
    return SnapshotEngine({"shm_dir": shm_dir, "job_id": job or job_id(), "ranks_per_node": 1, **cfg},
                          rank=0, world_size=1)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one byte of a file in place, as a bad DIMM or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


class LogLines(logging.Handler):
    """What the ``ftmem`` logger said during a test, whatever handlers the application set."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


ANY = "\x00"  # in a contract line given to logged(): any text


def logged(line: str, text: str) -> bool:
    """Whether ``text`` (a rank's log) holds ``line``, a contract line as ftmem._common.logs formats it
    (``restored_from_memory(...)``, ``restored_from_disk(...)``), where ANY stands for any text."""
    return re.search(".*?".join(map(re.escape, line.split(ANY))) + "$", text, re.MULTILINE) is not None
