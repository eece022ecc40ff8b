"""The pytest plugin of a `make test-peer` run (``-p ftmem_peer_plugin``).

* With ``FTMEM_PEER_COLLECT_TO``, the node ids collected are written there, one a line
  (DeepSpeed's conftest makes every run verbose, whatever ``-q`` asks).
* After each test (and DeepSpeed's own teardown, which ends its ranks), the ftmem jobs the
  test left in ``FTMEM_PEER_SHM_DIR`` are freed, SMPs and memory, as a job's operator would
  with `ftmem clean`: each test's jobs are its own (their ids derive from the test's save
  dir), and kept memory would otherwise add up over hundreds of tests.
"""
import os

import pytest


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
