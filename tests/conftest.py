"""Fixtures and hooks of the whole suite; the helpers live in ``harness``."""
import glob
import logging
import os
import shutil

import pytest

from harness import campaign
from harness.campaign import fault_clock  # noqa: F401 (a fixture of every test)
from harness.common import LogLines, TEST_SHM_PREFIX, free_shm_dir, leftover_smps, new_shm_dir
from harness.ranks import kill_ranks_left_running, stop_fork_servers

# Every job of the suite runs with a failure detector six times as quick as its default, so
# that a false alarm (a busy rank counted as lost: a slow step, a long flush, a loaded
# machine) fails the suite, where the default 60 s would hide it. A test's own timeout wins.
os.environ.setdefault("FTMEM_FAILURE_TIMEOUT_S", "10")


def pytest_addoption(parser):
    parser.addoption("--full-faults", action="store_true",
                     help="run the random-kill loops at full length (make test-faults)")
    parser.addoption("--fault-report", default=None, metavar="PATH",
                     help="write the fault campaign's lines to PATH as JSON (tests/harness/campaign.py)")


def pytest_configure(config):
    campaign.register(config)


def pytest_collection_finish(session):
    campaign.collected(session)


def pytest_terminal_summary(terminalreporter, config):
    campaign.summary(terminalreporter, config)


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
    campaign.record(item, report)
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and tmp is not None:
        for log in sorted(glob.glob(os.path.join(str(tmp), "**", "rank*.log"), recursive=True))[:16]:
            with open(log, errors="replace") as f:
                report.sections.append((f"log {os.path.relpath(log, str(tmp))}", f.read()[-2000:]))


def pytest_collection_modifyitems(items):
    """Each test is marked with its tier, the folder it lives in (``-m unit``, ``-m faults``...)."""
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        tier = os.path.relpath(str(item.fspath), root).split(os.sep)[0]
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite():
    """The whole suite must leave no SMP process and no shared memory behind."""
    yield
    stop_fork_servers()
    smps, dirs = leftover_smps(), glob.glob(TEST_SHM_PREFIX + "*")
    for pid in smps:
        os.kill(pid, 9)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert not smps and not dirs, f"the suite leaked SMPs {smps} and shared memory {dirs}"


@pytest.fixture
def shm_dir():
    """A private shared-memory directory for one test; whatever the test left is freed."""
    path = new_shm_dir()
    yield path
    free_shm_dir(path)


@pytest.fixture
def ftmem_log():
    logger = logging.getLogger("ftmem")
    capture = LogLines()
    logger.addHandler(capture)
    yield capture
    logger.removeHandler(capture)
