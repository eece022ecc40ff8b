"""The pytest plugin of a `make test-peer` run (``-p ftmem_peer_plugin``).

* With ``FTMEM_PEER_COLLECT_TO``, the node ids collected are written there, one a line
  (DeepSpeed's conftest makes every run verbose, whatever ``-q`` asks).
* After each test (and DeepSpeed's own teardown, which ends its ranks), the ftmem jobs the
  test left in ``FTMEM_PEER_SHM_DIR`` are freed, SMPs and memory, as a job's operator would
  with `ftmem clean`: each test's jobs are its own (their ids derive from the test's save
  dir), and kept memory would otherwise add up over hundreds of tests.
* With ``FTMEM_PEER_STACKS``, a test still running :data:`STACKS_BEFORE_S` before DeepSpeed's
  bound on its ranks (``DS_UNITTEST_TIMEOUT``) has every process of the run that can write its
  stacks (see ``sitecustomize``) write them, and they are gathered into
  ``<FTMEM_PEER_STACKS>/hang-<n>.txt``, headed by the test's id: where a hang waits, taken
  before DeepSpeed's harness gives up on the ranks, and what any rank that left the test
  raised.
"""
import glob
import os
import signal
import threading
import time

import pytest

STACKS_BEFORE_S = 15.0


def pytest_collection_finish(session):
    path = os.environ.get("FTMEM_PEER_COLLECT_TO")
    if path:
        with open(path, "w") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    shm_dir = os.environ.get("FTMEM_PEER_SHM_DIR")
    if os.environ.get("FTMEM_PEER_MODE") == "ftmem" and os.path.isdir(shm_dir):
        from ftmem._shm import jobs  # not in a stock run's processes

        for job in jobs.list_jobs(shm_dir):
            jobs.clean(shm_dir, job)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    folder = os.environ.get("FTMEM_PEER_STACKS")
    if not folder:
        yield
        return
    done = threading.Event()
    deadline_s = float(os.environ.get("DS_UNITTEST_TIMEOUT", "600")) - STACKS_BEFORE_S
    watch = threading.Thread(target=_stacks_if_still_running,
                             args=(item.nodeid, folder, time.time(), deadline_s, done), daemon=True)
    watch.start()
    try:
        yield
    finally:
        done.set()


def _stacks_if_still_running(node_id: str, folder: str, started: float, after_s: float,
                             done: threading.Event) -> None:
    if done.wait(after_s):
        return
    folder = os.path.realpath(folder)
    files = {int(os.path.basename(path)[:-4]): path for path in glob.glob(os.path.join(folder, "*.txt"))
             if os.path.basename(path)[:-4].isdigit()}
    # Only a process holding its file open answers SIGUSR1 (any other it would end): one of an
    # earlier test is gone, and its pid may be another process's now.
    files = {pid: path for pid, path in files.items() if _holds(pid, path)}
    before = {pid: os.path.getsize(path) for pid, path in files.items()}
    for pid in files:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # gone since
            pass
    time.sleep(2.0)  # faulthandler writes from the signal handler at once; a stuck rank too
    hangs = len(glob.glob(os.path.join(folder, "hang-*.txt")))
    with open(os.path.join(folder, f"hang-{hangs + 1}.txt"), "w") as out:
        out.write(f"{node_id}: still running {after_s:.0f} s into its call; every thread of each process\n")
        for pid, path in sorted(files.items()):
            with open(path) as f:
                f.seek(before[pid])
                stacks = f.read()
            if stacks:
                out.write(f"\n== pid {pid}: {_command(pid)}\n{stacks}")
        for path in sorted(glob.glob(os.path.join(folder, "raised-*.txt"))):
            if os.path.getmtime(path) >= started:  # a rank of this test that left it raising
                with open(path) as f:
                    out.write(f"\n== {os.path.basename(path)[:-4]}, a rank that left the test raising\n{f.read()}")


def _holds(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # gone
        return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"
