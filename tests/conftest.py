import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from examples.launch import kill_ranks_left_running
from ftmem import jobs
from ftmem.procs import cmdline, pid_alive

#: the repository's root (tests run from it, and their scripts import examples/ from it)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per session, so that a suite running beside another (a local run during CI) checks only its own.
TEST_SHM_PREFIX = f"/dev/shm/ftmem-test-{uuid.uuid4().hex[:6]}-"


def _leftover_smps() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_alive(int(entry)):
            args = cmdline(int(entry))
            if any("ftmem.smp" in a for a in args) and any(TEST_SHM_PREFIX in a for a in args):
                pids.append(int(entry))
    return pids


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """No rank of a test outlives it: one cut by pytest-timeout never reached the kill its
    own code has, and its hung ranks would wait on their peers for gloo's half hour."""
    yield
    kill_ranks_left_running()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tails of the rank logs under its tmp_path: a test
    cut by pytest-timeout never reaches its own assertion messages, which show them."""
    report = (yield).get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and tmp is not None:
        for log in sorted(glob.glob(os.path.join(str(tmp), "**", "rank*.log"), recursive=True))[:16]:
            with open(log, errors="replace") as f:
                report.sections.append((f"log {os.path.relpath(log, str(tmp))}", f.read()[-2000:]))


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite():
    """The whole suite must leave no SMP process and no shared memory behind."""
    yield
    smps, dirs = _leftover_smps(), glob.glob(TEST_SHM_PREFIX + "*")
    for pid in smps:
        os.kill(pid, 9)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert not smps and not dirs, f"the suite leaked SMPs {smps} and shared memory {dirs}"


# What each kind of uninterrupted reference run gave, by its arguments (see run_once).
_REFERENCE_RUNS: dict = {}


def run_once(key: tuple, run):
    """``run()``'s result, run once per session for each ``key``. For the uninterrupted
    reference runs that bitwise tests compare against: they are deterministic, only read
    afterwards (their folders stay for the session), and several tests compare against the
    same one; running each once saves minutes of the suite. A run that fails is not kept."""
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run()
    return _REFERENCE_RUNS[key]


def new_shm_dir() -> str:
    path = TEST_SHM_PREFIX + uuid.uuid4().hex[:8]
    os.makedirs(path)
    return path


def free_shm_dir(path: str) -> None:
    for job in jobs.list_jobs(path):
        jobs.clean(path, job)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir():
    """A private shared-memory directory for one test; whatever the test left is freed."""
    path = new_shm_dir()
    yield path
    free_shm_dir(path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftmem.cli", *args], capture_output=True, text=True, timeout=120)


def job_id() -> str:
    return "t-" + uuid.uuid4().hex[:8]


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


@pytest.fixture
def ftmem_log():
    logger = logging.getLogger("ftmem")
    capture = LogLines()
    logger.addHandler(capture)
    yield capture
    logger.removeHandler(capture)


ANY = "\x00"  # in a contract line given to logged(): any text


def logged(line: str, text: str) -> bool:
    """Whether ``text`` (a rank's log) holds ``line``, a contract line as ftmem.logs formats it
    (``restored_from_memory(...)``, ``restored_from_disk(...)``), where ANY stands for any text."""
    return re.search(".*?".join(map(re.escape, line.split(ANY))) + "$", text, re.MULTILINE) is not None
