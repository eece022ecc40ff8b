"""The persistent tier's flushes survive a power loss, not only a crash of processes: what
the kernel is asked to do, read off a real run by ``strace`` (the calls as the kernel sees
them, each file and directory named by its descriptor), in the order a database writes.
Before, no flush called fsync at all, and the oldest checkpoint was deleted right after the
rename: a machine that lost power then could hold a renamed directory of empty files and no
older checkpoint."""
import os
import subprocess
import sys

import pytest

from harness.common import job_id
from harness.ranks import REPO, RANK_ENV, free_port
from harness.strace import Call, calls_in, strace
from harness.strace import first as first_call

TIMEOUT = 120


def traced_job(shm_dir, tmp_path, fsync: str) -> list[Call]:
    """One rank of tests/harness/lifecycle_job.py (3 steps, each flushed to a tier that keeps
    2) run under strace: every successful call of those it traces, in order."""
    trace, persist = tmp_path / "trace", tmp_path / "persist"
    env = dict(os.environ, **RANK_ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FTMEM_JOB_ID=job_id(), SHM_DIR=shm_dir)
    proc = subprocess.run([*strace(str(trace)), sys.executable,
                           "-m", "tests.harness.lifecycle_job", "--out", str(tmp_path / "out"), "--steps", "3",
                           "--persist", str(persist), "--persist-interval", "1", "--persist-keep", "2",
                           "--persist-fsync", fsync],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (persist / "newest").read_text() == "v3" and sorted(os.listdir(persist / "v3")) == ["rank0.pt"]
    return calls_in(str(trace))


def first(calls, kind: str, *paths: str, after: int = -1) -> int:
    return first_call(calls, kind, *paths, after=after, near="/persist")


@pytest.mark.fault("power lost after a flush", phase="during a flush", framework="adapter runtime",
                   expect="resumes bitwise from disk: each flush synced before it is published and before an older one "
                          "goes")
def test_a_flush_is_on_the_disk_before_it_is_published_and_before_an_older_one_is_deleted(shm_dir, tmp_path):
    calls = traced_job(shm_dir, tmp_path, "on")
    # Version 3's flush: its file, then the staging directory, synced before the rename publishes it.
    file_synced = first(calls, "fsync", r"/persist/\.v3\.tmp/rank0\.pt")
    staging_synced = first(calls, "fsync", r"/persist/\.v3\.tmp", after=file_synced)
    published = first(calls, "rename", r"/persist/\.v3\.tmp", "/persist/v3", after=staging_synced)
    root_synced = first(calls, "fsync", "/persist", after=published)
    # The framework's pointer and the manifest: each synced under its temporary name, renamed, its directory synced.
    pointer_synced = first(calls, "fsync", r"/persist/newest\.tmp\.\d+", after=root_synced)
    pointed = first(calls, "rename", r"/persist/newest\.tmp\.\d+", "/persist/newest", after=pointer_synced)
    manifest_synced = first(calls, "fsync", r"/persist/ftmem_flushed\.json\.tmp\.\d+",
                            after=first(calls, "fsync", "/persist", after=pointed))
    recorded = first(calls, "rename", r"/persist/ftmem_flushed\.json\.tmp\.\d+", r"/persist/ftmem_flushed\.json",
                     after=manifest_synced)
    recorded_synced = first(calls, "fsync", "/persist", after=recorded)
    # Only then the oldest of the three goes (the tier keeps 2).
    retired = first(calls, "unlink", "/persist/v1/rank0\\.pt")
    assert retired > recorded_synced, calls[recorded_synced:retired + 1]


def test_fsync_off_leaves_the_checkpoint_s_files_and_the_manifest_to_the_page_cache(shm_dir, tmp_path):
    """``"persist": {"fsync": false}``, for file systems where syncing is pointless: no fsync
    of a checkpoint's files, its directories or the manifest; the pointer to the newest
    checkpoint, a few bytes, is synced all the same."""
    calls = traced_job(shm_dir, tmp_path, "off")
    synced = [call.paths for call in calls if call.name.startswith(("fsync", "fdatasync"))]
    on_the_tier = [n for named in synced for n in named if "/persist" in n]
    assert not [n for n in on_the_tier if "/persist/." in n or "/persist/v" in n or "ftmem_flushed" in n], on_the_tier
    assert any("/persist/newest.tmp." in n for n in on_the_tier), on_the_tier
