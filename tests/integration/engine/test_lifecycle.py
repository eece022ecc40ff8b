"""Memory is freed only when the job says it is done (issue 14, findings 5 and 8).

Two ranks on two virtual nodes (k=1, m=1) run tests/harness/lifecycle_job.py, a job on the
adapter runtime, and end in different ways: real processes, real SMPs, real exits.
"""
import errno
import glob
import json
import os
import re
import shutil
import subprocess
import typing

import pytest
import torch

from harness.common import flip_byte, held_versions, job_id, logged
from harness.ranks import LocalJob, wait_until
from ftmem import LayoutMismatch, restored_from_memory
from ftmem._shm import jobs
from ftmem._engine.elastic import _Head, line_of_jobs
from ftmem._shm.slots import VersionRef
from ftmem._common.identity import job_root
from ftmem._disk.persist import MANIFEST, STAGING_MARK, flushed, save_atomically
from ftmem._shm.slots import RankStore, write_atomically
from ftmem._shm.smp_client import running_smp, stop_smp

TIMEOUT = 120


def run(shm_dir, out, *args, job=None, env=None, rank_env=None) -> LocalJob:
    return LocalJob("tests.harness.lifecycle_job", ["--out", str(out), *args], 2, job, str(out),
                    env={"SHM_DIR": shm_dir, **(env or {})}, rank_env=rank_env)


def leaves_no_ftmem_thread(job: LocalJob) -> bool:
    """Every rank had no more threads after ftmem's end than before ftmem started (fewer
    where the script ended its own groups too): ftmem's gloo groups' threads ended while
    the interpreter was alive, not during its shutdown, where they now and then aborted a
    rank at a clean exit."""
    counts = [re.search(r"(\d+) threads before ftmem, (\d+) after its end", job.log(r)) for r in range(2)]
    return all(c is not None and int(c.group(2)) <= int(c.group(1)) for c in counts)



def test_a_runtime_the_script_closed_does_not_end_again_at_exit(shm_dir, tmp_path):
    """A script may close the runtime itself (Megatron: ftmem_megatron.checkpointing.close).
    Its end then ran again at exit, on the closed engine with no group left: each rank
    voted alone, and flushed the newest version to the tier alone."""
    job, persist = job_id(), tmp_path / "persist"
    closed = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), "--persist-interval", "100",
                 "--end", "close", job=job)
    assert closed.wait(TIMEOUT) == [0, 0] and leaves_no_ftmem_thread(closed), closed.log(0) + closed.log(1)
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}  # closed without job_finished: kept for a restart
    assert not os.path.exists(persist / "newest") and not glob.glob(str(persist / "v*")), os.listdir(persist)


@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 3, kept through sys.exit(1) on every rank")
def test_sys_exit_keeps_the_newest_version_for_the_restart(shm_dir, tmp_path):
    """Finding 5: sys.exit(1) on every rank used to count as a clean end and free everything."""
    job = job_id()
    ended = run(shm_dir, tmp_path, "--steps", "3", "--end", "exit1", job=job)
    assert ended.wait(TIMEOUT) == [1, 1] and leaves_no_ftmem_thread(ended), ended.log(1)
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}
    back = run(shm_dir, tmp_path, "--steps", "4", job=job)
    assert back.wait(TIMEOUT) == [0, 0], back.log(0)
    assert logged(restored_from_memory(3, 0), back.log(0)) and logged(restored_from_memory(3, 1), back.log(1))


@pytest.mark.parametrize("into", ["rank-0", "every-rank"])
def test_a_dp_sharded_tensor_is_restored_into_the_tensors_the_ranks_name(into, shm_dir, tmp_path):
    """The replicated tensor (half of it on each rank) is gathered straight into a tensor
    a rank names for it, and into new memory where it names none. Each piece the replicas
    broadcast is a collective: where only rank 0 names one, the ranks still cut the stream
    alike (a different cut would hang or mix up bytes), and rank 0 copies its tensor out."""
    job = job_id()
    first = run(shm_dir, tmp_path, "--steps", "3", job=job)
    assert first.wait(TIMEOUT) == [0, 0], first.log(0)
    back = run(shm_dir, tmp_path, "--steps", "3", "--restore-into", into, job=job)
    assert back.wait(TIMEOUT) == [0, 0], back.log(0) + back.log(1)
    for rank in range(2):
        where = "its own tensor" if into == "every-rank" or rank == 0 else "new memory"
        assert f"rank {rank}: restored w = [3.0] x 1000 into {where}" in back.log(rank), back.log(rank)


@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="resumes bitwise from memory: every node keeps version 2 for the restart")
def test_an_uncaught_exception_keeps_the_newest_version(shm_dir, tmp_path):
    job = job_id()
    ended = run(shm_dir, tmp_path, "--steps", "2", "--end", "raise", job=job)
    assert ended.wait(TIMEOUT) == [1, 1] and leaves_no_ftmem_thread(ended), ended.log(1)
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}


def test_a_finish_without_a_persistent_tier_keeps_memory_and_says_how_to_free_it(shm_dir, tmp_path):
    job = job_id()
    done = run(shm_dir, tmp_path, "--steps", "2", job=job)
    assert done.wait(TIMEOUT) == [0, 0] and leaves_no_ftmem_thread(done), done.log(1)
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}
    assert (f"job {job} keeps its newest version (2) in shared memory (no persistent tier is configured, so it is "
            f"not on disk): a restart of the same job resumes from it. To free it: ftmem clean --job {job} "
            f"--shm-dir {shm_dir}") in done.log(0)


def test_a_relaunch_that_resumes_at_its_last_step_keeps_what_it_resumed_from(shm_dir, tmp_path):
    """A job that ended without a tier relaunched as it was: it restores version 2, has
    no step left to train (so it saves nothing) and ends; its only copy of 2 must stay."""
    job = job_id()
    assert run(shm_dir, tmp_path, "--steps", "2", job=job).wait(TIMEOUT) == [0, 0]
    again = run(shm_dir, tmp_path, "--steps", "2", job=job)
    assert again.wait(TIMEOUT) == [0, 0], again.log(0)
    assert logged(restored_from_memory(2, 0), again.log(0))
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}
    assert f"job {job} keeps its newest version (2) in shared memory" in again.log(0)


@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 3, written to the tier before the memory goes")
def test_a_relaunch_that_resumes_at_its_last_step_writes_it_to_the_tier_before_freeing(shm_dir, tmp_path):
    job, persist = job_id(), tmp_path / "persist"
    assert run(shm_dir, tmp_path / "out", "--steps", "3", "--end", "exit1", job=job).wait(TIMEOUT) == [1, 1]
    again = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), job=job)
    assert again.wait(TIMEOUT) == [0, 0], again.log(0)
    assert logged(restored_from_memory(3, 0), again.log(0))
    assert (persist / "newest").read_text() == "v3" and jobs.list_jobs(shm_dir) == []


@pytest.mark.fault("persistent tier's directory replaced by a file", phase="at the job's end",
                   framework="adapter runtime",
                   expect="goes on: the job ends, its memory kept, naming the failed flush and how to free the memory")
def test_a_last_flush_that_fails_keeps_memory_and_still_says_how_to_free_it(shm_dir, tmp_path):
    """The flush of the newest version at the end failed (its directory was replaced by a
    file while the ranks were at the end). The memory stays, but the close that follows
    raised that failure again, and the line saying how to free the memory was lost."""
    job, persist, hooks = job_id(), tmp_path / "persist", tmp_path / "hooks"
    hooks.mkdir()
    rank_env = {r: {"FTMEM_TEST_HOOK": f"finish:hold:rank={r}:version=3", "FTMEM_TEST_HOOK_DIR": str(hooks)}
                for r in range(2)}
    ended = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), "--persist-interval", "100",
                job=job, rank_env=rank_env)
    with ended:
        ended.wait_for(lambda: all((hooks / f"paused.rank{r}.v3").exists() for r in range(2)), TIMEOUT,
                       "both ranks at the end")
        shutil.rmtree(persist)
        persist.write_text("not a directory")
        for r in range(2):
            (hooks / f"resume.rank{r}.v3").touch()
        assert ended.wait(TIMEOUT) == [0, 0], ended.log(0)
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}
    line = re.search(rf"job {job} keeps its newest version \(3\) in shared memory \((.+)\): a restart of the same "
                     rf"job resumes from it. To free it: ftmem clean --job {job} --shm-dir {re.escape(shm_dir)}",
                     ended.log(0))
    assert line and "the persistent tier could not write version 3" in line.group(1), ended.log(0)[-3000:]


@pytest.fixture
def tiny_disk(tmp_path):
    """A directory on a file system of 256 KiB (a tmpfs mounted for the test): a full disk."""
    path = tmp_path / "tiny"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.fault("persistent tier's disk full", phase="during a flush", framework="adapter runtime",
                   expect="refuses with a reason: the failed flush names ENOSPC, the bytes needed and free; v1 stays "
                          "whole, memory keeps version 2")
def test_a_full_disk_under_the_persistent_tier_is_named_and_leaves_nothing_half_written(shm_dir, tmp_path,
                                                                                        tiny_disk):
    """The persistent tier on a disk that fills up: 2 ranks flush 80 KiB each per version,
    and the disk holds about 256 KiB. Version 1 fits; version 2 does not. torch reported it
    as "[enforce fail at inline_container.cc:672] . unexpected pos 3264 vs 3156", and the
    version's staging directory stayed for ever. Now the failure names ENOSPC, the directory,
    the bytes needed and the bytes free; the staging directory goes; version 1 stays whole;
    and staging directories that killed flushes left (marked as ftmem's) go at the next
    flush, while a directory that is not ftmem's stays."""
    job = job_id()
    leftover, users = tiny_disk / ".v9.tmp", tiny_disk / ".notes.tmp"
    leftover.mkdir()
    (leftover / STAGING_MARK).write_text("")
    users.mkdir()
    ended = run(shm_dir, tmp_path / "out", "--steps", "2", "--elements", "20000", "--persist", str(tiny_disk),
                "--persist-interval", "1", job=job)
    assert ended.wait(TIMEOUT) == [1, 1], ended.log(0)[-3000:]  # the job's wait_flushed raised the failure
    log = ended.log(0) + ended.log(1)
    assert "unexpected pos" not in log
    said = re.search(r"version 2 was not flushed \(rank \d: No space left on device \(ENOSPC\) writing "
                     rf"{re.escape(str(tiny_disk))}/\.v2\.tmp/rank\d\.pt\.tmp: this rank's files need about 0\.1 MiB, and "
                     r"[\d.]+ MiB is free there\); v1 stays the newest on disk", log)
    assert said, log[-4000:]
    assert sorted(os.listdir(tiny_disk)) == [".notes.tmp", MANIFEST, "newest", "v1"]
    assert [torch.load(tiny_disk / "v1" / f"rank{r}.pt").unique().tolist() for r in range(2)] == [[1.0], [1.0]]
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}  # memory keeps what the disk could not take



@pytest.mark.fault("persistent tier's disk full", phase="during a flush", framework="adapter runtime",
                   expect="refuses with a reason: ENOSPC naming the temporary file, which goes")
def test_a_write_that_fills_the_disk_names_its_file_and_leaves_no_temporary_file(tiny_disk):
    """A full disk shows either in a write during torch.save or in the close of the file,
    where Python's buffered file writes its tail and raises an OSError without a file name.
    CI met the close's case: the flush failure named the staging directory instead of the
    file. Whatever the size, the error names the temporary file, and the file goes."""
    (tiny_disk / "fill").write_bytes(b"x" * 240 * 1024)  # 16 KiB of the 256 KiB stay free
    failed = 0
    for nbytes in range(12 * 1024, 18 * 1024, 16):  # around the free space, either side of each buffer's end
        path = tiny_disk / "t.pt"
        try:
            save_atomically(torch.zeros(nbytes // 4), str(path))
        except OSError as e:
            failed += 1
            assert (e.errno, e.filename) == (errno.ENOSPC, f"{path}.tmp"), (nbytes, e)
        path.unlink(missing_ok=True)
        assert os.listdir(tiny_disk) == ["fill"], nbytes
    assert failed > 0
    with pytest.raises(OSError) as raised:
        write_atomically(str(tiny_disk / "manifest"), b"x" * 20 * 1024)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename.startswith(f"{tiny_disk}/manifest.tmp.")
    assert os.listdir(tiny_disk) == ["fill"]

def test_a_load_while_a_save_is_protected_waits_for_the_save_thread(shm_dir, tmp_path):
    """A load right after a save (DeepSpeed's rollback mid-run) ran its first collective on
    ftmem's job group while the save thread could still be in its own (the agreement that
    every rank committed): rank 0's save thread held after its commit, rank 1's already in
    the agreement, the ranks reached that group in different orders, and rank 0's gather met
    rank 1's all_reduce (CI hung there). A load now waits for the save thread first."""
    job, hooks = job_id(), tmp_path / "hooks"
    hooks.mkdir()
    hold = {0: {"FTMEM_TEST_HOOK": "after_commit:hold:rank=0:version=2", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    with run(shm_dir, tmp_path, "--steps", "2", "--ranks-per-node", "2", "--load-while-saving", job=job,
             rank_env=hold) as loading:
        loading.wait_for(lambda: (hooks / "paused.rank0.v2").exists() and "loading while saving" in loading.log(1),
                         TIMEOUT, "rank 0's save thread held, rank 1 loading")
        (hooks / "resume.rank0.v2").touch()
        assert loading.wait(TIMEOUT) == [0, 0], loading.tails()
    for rank in range(2):
        assert f"rank {rank}: loaded version 2: w = [2.0] x 1000" in loading.log(rank), loading.log(rank)[-3000:]


def test_a_collective_on_the_dp_group_after_a_save_does_not_meet_the_flush_s_gather(shm_dir, tmp_path):
    """The protection thread gathers a DP-sharded version back from the replicas for its
    flush. It did so on the DP group that adapters use on the training thread (Megatron's
    adapter all-reduces on it at every save), so the two collectives met in another order on
    each rank: a Megatron job hung in CI. Here rank 0 all-reduces on the DP group right after
    each save, while rank 1 first waits for that save's flush to be on disk."""
    persist = tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), "--dp-collective-each-save")
    assert done.wait(TIMEOUT) == [0, 0], done.tails()
    for rank in range(2):
        for step in range(1, 4):
            assert f"rank {rank}: step {step}'s all-reduce on the DP group: {step * 20 + 1}" in done.log(rank)
    assert [c["version"] for c in flushed(str(persist))] == [1, 2, 3]


def test_a_finish_with_its_newest_version_on_disk_frees_memory(shm_dir, tmp_path):
    job, persist = job_id(), tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), job=job)
    assert done.wait(TIMEOUT) == [0, 0] and leaves_no_ftmem_thread(done), done.log(1)  # the tier's group too
    assert jobs.list_jobs(shm_dir) == []
    assert (persist / "newest").read_text() == "v3" and sorted(os.listdir(persist / "v3")) == ["rank0.pt", "rank1.pt"]


def test_a_script_that_ends_torch_distributed_itself_still_frees_memory_once_on_disk(shm_dir, tmp_path):
    """PyTorch asks scripts to call destroy_process_group() before they exit. That ends
    ftmem's groups too, so the ranks could no longer agree at exit that the job finished,
    and the memory was kept with a warning: the end's flush of the newest version (here the
    only one the tier writes) failed on a destroyed group. ftmem's end now runs first."""
    job, persist = job_id(), tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), "--persist-interval", "100",
               "--destroys-group", job=job)
    assert done.wait(TIMEOUT) == [0, 0] and leaves_no_ftmem_thread(done), done.log(1)
    assert "could not agree" not in done.log(0) + done.log(1)
    assert jobs.list_jobs(shm_dir) == [] and (persist / "newest").read_text() == "v3"


@pytest.mark.fault("rank exits with an error", phase="at the job's end", framework="adapter runtime",
                   expect="resumes bitwise from memory: every node keeps version 2, the exception in flight named")
def test_a_failure_that_ends_torch_distributed_in_a_finally_keeps_the_newest_version(shm_dir, tmp_path):
    """The same call made while an exception is in flight (``finally:``) is a crash."""
    job = job_id()
    ended = run(shm_dir, tmp_path, "--steps", "2", "--end", "raise", "--destroys-group", job=job)
    assert ended.wait(TIMEOUT) == [1, 1] and leaves_no_ftmem_thread(ended), ended.log(1)
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}
    assert "it ended with an exception in flight (RuntimeError)" in ended.log(0) + ended.log(1)


@pytest.mark.fault("rank SIGKILLed", phase="at the job's end", framework="adapter runtime",
                   expect="ends every rank within FTMEM_FINISH_TIMEOUT_S, no finish agreed: every node keeps its "
                          "memory")
def test_a_rank_killed_in_the_teardown_keeps_every_node_s_memory(shm_dir, tmp_path):
    """Finding 5: freeing was decided per node, so nodes freed while rank 0, killed in its
    teardown, still held its versions. Now the ranks agree first; rank 1 waits for rank 0
    (bounded by FTMEM_FINISH_TIMEOUT_S), which is killed, and keeps its memory."""
    job, persist = job_id(), tmp_path / "persist"
    hook = {"FTMEM_TEST_HOOK": "finish:pause:rank=0:version=2", "FTMEM_TEST_HOOK_DIR": str(tmp_path)}
    with run(shm_dir, tmp_path / "out", "--steps", "2", "--persist", str(persist), job=job,
             env={"FTMEM_FINISH_TIMEOUT_S": "5"}, rank_env={0: hook}) as ending:
        wait_until(lambda: os.path.exists(tmp_path / "paused.rank0.v2"), TIMEOUT, "rank 0 in its teardown")
        ending.kill(0)
        assert ending.procs[1].wait(TIMEOUT) == 0
    assert ending.log(1).count("could not agree with the other ranks that the job finished") == 1  # (it said it twice)
    assert held_versions(shm_dir, job) == {0: [1, 2], 1: [1, 2]}


def test_an_unwritable_persist_dir_is_refused_at_the_start(shm_dir, tmp_path):
    """Finding 8: every flush used to fail, logged only, and the job exited 0 with nothing on disk."""
    (tmp_path / "a-file").write_text("")
    job = job_id()
    refused = run(shm_dir, tmp_path / "out", "--persist", str(tmp_path / "a-file" / "ckpt"), job=job)
    assert refused.wait(TIMEOUT) == [1, 1]
    assert "ConfigError: the persistent tier's directory" in refused.log(0) and "cannot hold checkpoints" \
        in refused.log(0)


@pytest.mark.fault("a node sees a stale persistent tier", phase="startup", framework="adapter runtime",
                   expect="refuses with a reason: every rank names the checkpoints each sees, none trains on apart")
def test_ranks_that_see_different_newest_disk_checkpoints_are_refused_not_resumed_apart(shm_dir, tmp_path):
    """Memory cannot serve (the job ended and freed it), so the restart resumes from disk;
    but rank 1 reads the tier through a view a flush behind (a node whose file system cache
    is stale). Each rank took the disk checkpoint it saw: rank 0 version 3, rank 1 version
    2, and trained on from different steps, silently. Now every rank stops with the reason."""
    job, persist = job_id(), tmp_path / "persist"
    done = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), job=job)
    assert done.wait(TIMEOUT) == [0, 0], done.log(0)
    assert jobs.list_jobs(shm_dir) == [] and (persist / "newest").read_text() == "v3"
    stale = tmp_path / "stale-view"
    shutil.copytree(persist, stale)
    manifest = json.loads((stale / MANIFEST).read_text())
    (stale / MANIFEST).write_text(json.dumps([entry for entry in manifest if entry["version"] < 3]))
    again = run(shm_dir, tmp_path / "out", "--steps", "4", "--persist", str(persist), job=job,
                rank_env={1: {"DISK_VIEW": str(stale)}})
    assert again.wait(TIMEOUT) == [1, 1], again.log(0)
    for rank in range(2):
        assert ("the ranks see different newest checkpoints on disk (rank 0: 3, rank 1: 2), and memory cannot "
                "serve") in again.log(rank), again.log(rank)[-3000:]
        assert again.log(rank).count("resumes at step") == 1  # the first run's (rank logs append)
    # The same relaunch with one view resumes from the disk's newest on every rank.
    same = run(shm_dir, tmp_path / "out", "--steps", "4", "--persist", str(persist), job=job)
    assert same.wait(TIMEOUT) == [0, 0], same.log(0)
    assert all(f"rank {rank}: resumes at step 4 (disk)" in same.log(rank) for rank in range(2))


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 3, after one node lost and then the other")
def test_a_rebuilt_node_is_protected_again_before_the_next_save(shm_dir, tmp_path):
    """Node 1 lost and rebuilt from node 0's parity at the restart; the job resumes at its
    last step, saves nothing and ends, keeping version 3. The rebuild gave node 1 its data
    but not the parity of node 0's data it held, so losing node 0 next lost version 3.
    Now the rebuild encodes that parity again, and the second loss is rebuilt too."""
    job = job_id()
    assert run(shm_dir, tmp_path, "--steps", "3", job=job).wait(TIMEOUT) == [0, 0]
    jobs.lose_node(shm_dir, job, 1)
    again = run(shm_dir, tmp_path, "--steps", "3", job=job)
    assert again.wait(TIMEOUT) == [0, 0], again.log(1)
    assert logged(restored_from_memory(3, 1, rebuilt=True), again.log(1))
    assert {n["node"]: n["protected"] for n in jobs.status(shm_dir, job)["jobs"][0]["nodes"]} == {0: 3, 1: 3}
    jobs.lose_node(shm_dir, job, 0)
    third = run(shm_dir, tmp_path, "--steps", "3", job=job)
    assert third.wait(TIMEOUT) == [0, 0], third.log(0)
    assert logged(restored_from_memory(3, 0, rebuilt=True), third.log(0)), third.log(0)[-3000:]
    assert logged(restored_from_memory(3, 1), third.log(1))


def test_a_job_that_loaded_an_older_version_by_name_keeps_the_newer_ones_at_its_end(shm_dir, tmp_path):
    """A relaunch loads version 2 by name (DeepSpeed's load_checkpoint(dir, tag), Megatron's
    --ckpt-step) while memory holds 3, saves nothing (an evaluation) and ends. Its end took
    2 for the job's newest: it flushed 2 to the tier and freed memory, 3 with it, though 3
    was never on disk. Memory now stays until a save drops the newer versions."""
    job, persist = job_id(), tmp_path / "persist"
    assert run(shm_dir, tmp_path / "out", "--steps", "3", "--end", "exit1", job=job).wait(TIMEOUT) == [1, 1]
    named = run(shm_dir, tmp_path / "out", "--steps", "2", "--persist", str(persist), "--load-version", "2", job=job)
    assert named.wait(TIMEOUT) == [0, 0], named.log(0)
    assert logged(restored_from_memory(2, 0), named.log(0))
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}
    assert f"job {job} keeps its newest version (3) in shared memory (it also holds version(s) [3], newer than " \
           f"the version it loaded by name)" in named.log(0)
    again = run(shm_dir, tmp_path / "out", "--steps", "3", "--persist", str(persist), job=job)
    assert again.wait(TIMEOUT) == [0, 0], again.log(0)
    assert logged(restored_from_memory(3, 0), again.log(0))


@pytest.mark.parametrize("smps", ["alive", "stopped"])
@pytest.mark.fault("restart on fewer or more nodes", phase="startup", framework="adapter runtime",
                   expect="refuses with a reason: LayoutMismatch naming the change and ftmem clean; memory kept")
def test_a_relaunch_with_another_number_of_ranks_per_node_is_refused_naming_the_change(smps, shm_dir, tmp_path):
    """Two ranks on two nodes save and exit; the job comes back with both ranks on one
    node. Rank 1's versions are in node 1's directory, and node 0's SMP serves rank 0 only:
    every rank stops before it starts an SMP, naming the change and what to do (not an SMP's
    refusal of rank 1, nor a parity problem), and memory is kept as it was."""
    job = job_id()
    ended = run(shm_dir, tmp_path, "--steps", "3", "--end", "exit1", job=job)
    assert ended.wait(TIMEOUT) == [1, 1], ended.log(0)
    if smps == "stopped":
        for _, path in jobs.node_dirs(shm_dir, job):
            stop_smp(running_smp(path))
    back = run(shm_dir, tmp_path / "back", "--steps", "4", "--ranks-per-node", "2", job=job)
    assert back.wait(TIMEOUT) == [1, 1], back.log(0)
    node0 = os.path.join(job_root(shm_dir, job), "node0")
    for rank in range(2):
        assert (f"LayoutMismatch: job {job}: node 0 ({node0}) holds memory of ranks [0], where this launch places "
                f"ranks [0, 1] (ranks per node now 2, world size 2): the node layout changed") in back.log(rank), \
            back.log(rank)[-3000:]
        assert f"free the job's memory first: ftmem clean --job {job} --shm-dir {shm_dir}" in back.log(rank)
    assert held_versions(shm_dir, job) == {0: [1, 2, 3], 1: [1, 2, 3]}


@pytest.mark.fault("restart on fewer or more nodes", phase="startup", framework="adapter runtime",
                   expect="refuses with a reason: naming the first layout's job, its versions and ftmem clean; memory "
                          "kept")
def test_a_relaunch_under_a_derived_id_of_another_layout_names_the_versions_the_first_layout_holds(shm_dir, tmp_path):
    """Without FTMEM_JOB_ID the job id derives from the save dir and the world layout. A
    relaunch with another layout is another job, which holds nothing: it used to start from
    scratch (or an older disk checkpoint) and leave the first job's versions behind. It is
    refused on every rank, naming those versions and how to go on; memory is kept."""
    derived = {"FTMEM_JOB_ID": ""}
    ended = run(shm_dir, tmp_path, "--steps", "3", "--end", "exit1", env=derived)
    assert ended.wait(TIMEOUT) == [1, 1], ended.log(0)
    [first] = jobs.list_jobs(shm_dir)
    before = [len(ended.log(rank)) for rank in range(2)]
    back = run(shm_dir, tmp_path, "--steps", "4", "--ranks-per-node", "2", env=derived)  # the same save dir
    assert back.wait(TIMEOUT) == [1, 1], back.log(0)
    for rank in range(2):
        log = back.log(rank)[before[rank]:]
        assert (f", on 2 ranks (1 node of 2)) holds no version in memory, but other jobs saved from its origin (save "
                f"dir {os.path.realpath(tmp_path)}) hold some (job {first} on 2 ranks (2 nodes of 1): versions "
                f"[1, 2, 3])") in log, log[-3000:]
        assert f"free them first: ftmem clean --job {first} --shm-dir {shm_dir}." in log
        assert "resumes at step" not in log
    assert held_versions(shm_dir, first) == {0: [1, 2, 3], 1: [1, 2, 3]}  # the relaunch's own job holds nothing


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="during an elastic adoption",
                   framework="adapter runtime",
                   expect="resumes bitwise from memory: version 2 adopted on 2 ranks, rank 0 rebuilt, never the "
                          "damaged version 3")
def test_a_relaunch_on_fewer_nodes_adopts_the_newest_version_the_old_world_can_give_back_never_a_damaged_copy(
        shm_dir, tmp_path):
    """3 ranks on 3 nodes (one EC group, m=1) save steps 1-3 and fail (memory kept). Node 0
    is lost, and a byte of rank 2's data of version 3 flipped: version 3 then misses two
    members of its group, so the relaunch on 2 ranks (another world: another job) adopts
    version 2, rank 0 rebuilt from parity, and says why not 3. It trains on, and once it
    holds a protected version of its own, the old job's memory is freed."""
    derived = {"SHM_DIR": shm_dir, "FTMEM_JOB_ID": ""}
    first = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "3", "--end", "exit1"], 3, None,
                     str(tmp_path / "first"), env=derived)
    assert first.wait(TIMEOUT) == [1, 1, 1], first.log(0)
    [old] = jobs.list_jobs(shm_dir)
    assert held_versions(shm_dir, old) == {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3]}
    jobs.lose_node(shm_dir, old, 0)
    store = RankStore(os.path.join(job_root(shm_dir, old), "node2"), 2)
    flip_byte(store.slot_path(store.committed()[3]), 100)
    back = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "4", "--other-worlds"], 2, None,
                    str(tmp_path / "back"), env=derived)
    assert back.wait(TIMEOUT) == [0, 0], back.log(0)[-3000:]
    for rank in range(2):
        log = back.log(rank)
        assert logged(restored_from_memory(2, rank, f"saved by job {old} on 3 ranks (3 nodes of 1), its rank(s) [0] "
                                                    f"rebuilt from parity"), log), log[-3000:]
        assert f"rank {rank}: adopted version 2 of 3 old ranks: w = [2.0]" in log
        assert f"rank {rank}: resumes at step 3 (memory)" in log
    assert "rank 2 version 3: data in" in back.log(0)
    assert "does not match its checksum. Treating it as lost." in back.log(0)
    [new] = jobs.list_jobs(shm_dir)  # the old job's memory is freed
    assert new != old and held_versions(shm_dir, new) == {0: [3, 4], 1: [3, 4]}


@pytest.mark.fault("shared memory damaged", phase="during an elastic adoption", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 3 adopted on 2 ranks, its data intact on every old "
                          "rank")
def test_a_relaunch_adopts_a_version_whose_data_is_whole_though_a_parity_record_is_damaged(shm_dir, tmp_path):
    """3 ranks on 3 nodes (one EC group, m=1) save steps 1-3 and fail; a byte of node 1's
    parity marker of version 3 is flipped (that parity counts as lost), no node lost. The
    relaunch on 2 ranks adopts version 3, whose data every old rank holds intact. Each old
    node is read by new rank 0, which sees them all, and sent to new rank 1: the old rank
    without parity moves its data all the same."""
    derived = {"SHM_DIR": shm_dir, "FTMEM_JOB_ID": ""}
    first = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "3", "--end", "exit1"], 3, None,
                     str(tmp_path / "first"), env=derived)
    assert first.wait(TIMEOUT) == [1, 1, 1], first.log(0)
    [old] = jobs.list_jobs(shm_dir)
    store = RankStore(os.path.join(job_root(shm_dir, old), "node1"), 1)
    flip_byte(store.parity_marker_path(3, store.parity_held()[3]), 5)
    back = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "4", "--other-worlds"], 2, None,
                    str(tmp_path / "back"), env=derived)
    assert back.wait(TIMEOUT) == [0, 0], back.log(0)[-3000:] + back.log(1)[-3000:]
    for rank in range(2):
        log = back.log(rank)
        assert logged(restored_from_memory(3, rank, f"saved by job {old} on 3 ranks (3 nodes of 1)"), log), log[-3000:]
        assert f"rank {rank}: adopted version 3 of 3 old ranks: w = [3.0]" in log


@pytest.mark.parametrize("second", [
    pytest.param("whole", id="whole", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="during an elastic adoption", framework="adapter runtime",
        expect="resumes bitwise from memory: a third relaunch adopts the killed relaunch's version 4 and frees "
               "both old jobs once it protects its own")),
    pytest.param("lost beyond repair", id="lost beyond repair", marks=pytest.mark.fault(
        "more nodes lost than parity", phase="during an elastic adoption", framework="adapter runtime",
        expect="resumes bitwise from memory: the first job's version 3, rank 0 rebuilt, where the killed "
               "relaunch lost a node and its other copy is damaged")),
    pytest.param("restarted in its own world", id="restarted in its own world", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="during an elastic adoption", framework="adapter runtime",
        expect="resumes bitwise from memory: the killed relaunch its own version 4, freeing the job it adopted "
               "from only once it protects a version of its own")),
])
def test_a_relaunch_after_a_relaunch_that_died_before_freeing_adopts_the_newest_version_either_job_gives_back(
        second, shm_dir, tmp_path):
    """Job A (3 ranks on 3 nodes) saves steps 1-3 and fails; its node 0 is lost. The relaunch
    B on 2 ranks adopts A's version 3, saves and protects step 4, and is SIGKILLed before
    its next save would have freed A. A third relaunch C, on 4 ranks, finds both jobs of the
    origin in memory. It adopts B's version 4, the newest; A, holding nothing newer, goes
    with B once C protects a version of its own. Where B's version 4 cannot be rebuilt (its
    node 0 lost and a byte of its node 1's copy flipped), C adopts A's version 3 (its rank 0
    rebuilt from parity), and keeps B, whose version 4 is newer than anything C holds. Where
    B is restarted in its own world instead, it resumes its own version 4 and frees A, which
    its line descends from, once it protected a version of its own: not when it ends right
    after the resume."""
    derived = {"SHM_DIR": shm_dir, "FTMEM_JOB_ID": ""}
    first = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "3", "--end", "exit1"], 3, None,
                     str(tmp_path / "a"), env=derived)
    assert first.wait(TIMEOUT) == [1, 1, 1], first.log(0)
    [a] = jobs.list_jobs(shm_dir)
    jobs.lose_node(shm_dir, a, 0)
    with LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "4", "--other-worlds", "--end", "hang"],
                  2, None, str(tmp_path / "b"), env=derived) as b_run:
        b_run.wait_for(lambda: all(f"rank {r}: trained to step 4" in b_run.log(r) for r in range(2)), TIMEOUT,
                       "step 4 of the second relaunch")
        b_run.kill_all()
    [b] = [job for job in jobs.list_jobs(shm_dir) if job != a]
    assert held_versions(shm_dir, a) == {1: [1, 2, 3], 2: [1, 2, 3]} and held_versions(shm_dir, b) == {0: [4], 1: [4]}
    if second == "restarted in its own world":
        for steps in (4, 6):  # nothing left to train and no save, then two saves
            again = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", str(steps),
                                                             "--other-worlds"], 2, None, str(tmp_path / f"b to {steps}"),
                             env=derived)
            assert again.wait(TIMEOUT) == [0, 0], again.log(0)[-3000:]
            for rank in range(2):
                assert logged(restored_from_memory(4, rank), again.log(rank)), again.log(rank)[-3000:]
            if steps == 4:
                assert held_versions(shm_dir, a) == {1: [1, 2, 3], 2: [1, 2, 3]} and "freed job" not in again.log(0)
        assert jobs.list_jobs(shm_dir) == [b] and held_versions(shm_dir, b) == {0: [4, 5, 6], 1: [4, 5, 6]}
        assert (f"freed job {a}'s memory on nodes ['node1', 'node2']: this job's line descends from its version 3, "
                f"this job resumed its own version 4 and now holds a protected version of its own") in again.log(0)
        return
    if second == "lost beyond repair":
        jobs.lose_node(shm_dir, b, 0)
        store = RankStore(os.path.join(job_root(shm_dir, b), "node1"), 1)
        flip_byte(store.slot_path(store.committed()[4]), 100)
    c_run = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "6", "--other-worlds"], 4, None,
                     str(tmp_path / "c"), env=derived)
    assert c_run.wait(TIMEOUT) == [0] * 4, c_run.log(0)[-3000:]
    adopted, version, rebuilt = (b, 4, "") if second == "whole" else (a, 3, ", its rank(s) [0] rebuilt from parity")
    world = "2 ranks (2 nodes of 1)" if second == "whole" else "3 ranks (3 nodes of 1)"
    for rank in range(4):
        log = c_run.log(rank)
        assert logged(restored_from_memory(version, rank, f"saved by job {adopted} on {world}{rebuilt}"), log), \
            log[-3000:]
        assert f"rank {rank}: adopted version {version} of" in log and f"w = [{float(version)}]" in log
        assert f"rank {rank}: resumes at step {version + 1} (memory)" in log
    [c] = [job for job in jobs.list_jobs(shm_dir) if job not in (a, b)]
    assert held_versions(shm_dir, c) == {node: list(range(version + 1, 7)) for node in range(4)}  # its own saves
    if second == "whole":
        assert jobs.list_jobs(shm_dir) == [c]
        assert (f"freed job {a}'s memory on nodes ['node1', 'node2']: it holds nothing newer than version 4, which "
                f"this job adopted from job {b}") in c_run.log(0)
    else:
        assert sorted(jobs.list_jobs(shm_dir)) == sorted([b, c]) and held_versions(shm_dir, b) == {1: [4]}
        assert "rank 1 version 4: data in" in c_run.log(0) and "does not match its checksum" in c_run.log(0)
        assert (f"not adopting from job {b}: job {b}'s memory holds no intact version. Trying the job it descends "
                f"from, if any.") in c_run.log(0), c_run.log(0)[-3000:]


def test_old_jobs_that_are_not_one_line_of_relaunches_are_refused_not_ranked_by_their_version_numbers():
    """Which old jobs a relaunch adopts from, in which order, from each job's newest version
    and the lineage it records (the very save its line was adopted from)."""
    def head(job: str, version: int, parent: typing.Optional[tuple[str, int]] = None, run: str = "r1") -> _Head:
        lineage = parent and VersionRef(parent[0], parent[1], f"{parent[0]}{run}.{parent[1]}", run)
        return _Head(version, lineage, f"{job}{run}.{version}", run)

    assert line_of_jobs({"A": head("A", 4)}) == ["A"]
    # B adopted A's version 3 (A's newest), C adopted B's 5: C first, then B, then A.
    assert line_of_jobs({"A": head("A", 3), "B": head("B", 5, ("A", 3)), "C": head("C", 7, ("B", 5))}) == ["C", "B", "A"]
    # The job a lineage names may be gone: the line ends with the oldest held.
    assert line_of_jobs({"B": head("B", 5, ("A", 3)), "C": head("C", 6, ("B", 5))}) == ["C", "B"]
    # B fell back to an older disk checkpoint and started a line of its own: A's higher
    # version number does not make A the one this relaunch continues, nor the other way.
    with pytest.raises(LayoutMismatch, match=r"several jobs is held \(A \(newest version 10\), B \(newest version 7\)\), "
                                             r"and they are not one line of relaunches"):
        line_of_jobs({"A": head("A", 10), "B": head("B", 7)})
    # Two relaunches that both adopted from A.
    with pytest.raises(LayoutMismatch, match=r"B \(newest version 5, adopted from job A\)"):
        line_of_jobs({"A": head("A", 3), "B": head("B", 5, ("A", 3)), "D": head("D", 4, ("A", 3))})
    # B adopted an earlier run's save of A's version 3; A now holds another run's version 3
    # (or went on to version 4 after B adopted): B does not descend from what A holds.
    for a in (head("A", 3, run="r2"), head("A", 4)):
        with pytest.raises(LayoutMismatch, match="not one line of relaunches"):
            line_of_jobs({"A": a, "B": head("B", 5, ("A", 3))})


@pytest.mark.fault("more nodes lost than parity", phase="during an elastic adoption", framework="adapter runtime",
                   expect="refuses with a reason: every rank names the nodes the group lacks, never a fresh start; "
                          "memory kept")
def test_a_relaunch_that_cannot_rebuild_the_old_world_is_refused_and_frees_nothing(shm_dir, tmp_path):
    """As above, with two of the old group's three nodes lost: no version can be rebuilt.
    The relaunch stops on every rank with the reason, never a fresh start, and the old
    job's memory stays as it was."""
    derived = {"SHM_DIR": shm_dir, "FTMEM_JOB_ID": ""}
    first = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "3", "--end", "exit1"], 3, None,
                     str(tmp_path / "first"), env=derived)
    assert first.wait(TIMEOUT) == [1, 1, 1], first.log(0)
    [old] = jobs.list_jobs(shm_dir)
    jobs.lose_node(shm_dir, old, 0)
    jobs.lose_node(shm_dir, old, 1)
    back = LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "4", "--other-worlds"], 2, None,
                    str(tmp_path / "back"), env=derived)
    assert back.wait(TIMEOUT) == [1, 1], back.log(0)[-3000:]
    for rank in range(2):
        log = back.log(rank)
        assert "memory could not serve (" in log, log[-3000:]
        assert "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 1]" in log
        assert "ftmem does not start from scratch in place of what this job saved" in log
        assert "resumes at step" not in log
    assert held_versions(shm_dir, old) == {2: [1, 2, 3]}


def test_several_runtimes_of_a_process_end_in_the_order_they_were_made_on_every_rank(shm_dir, tmp_path):
    """Three jobs side by side in each process (a script with several DeepSpeed engines),
    ended by the script's destroy_process_group. Each end is a collective vote of its
    job: the ranks must end their runtimes in one order, or each vote waits for ranks
    voting in another job's until the finish timeout, and the job keeps its memory as one
    that did not end cleanly. Here every job ends cleanly (keeping its newest version, as
    it has no persistent tier) on every rank."""
    ended = run(shm_dir, tmp_path, "--steps", "2", "--runtimes", "3", "--destroys-group",
                env={"FTMEM_JOB_ID": "", "FTMEM_FINISH_TIMEOUT_S": "20"})
    assert ended.wait(TIMEOUT) == [0, 0], ended.log(0)[-3000:]
    assert len(jobs.list_jobs(shm_dir)) == 3
    for job in jobs.list_jobs(shm_dir):
        assert (f"job {job} keeps its newest version (2) in shared memory (no persistent tier is configured, so it "
                f"is not on disk)") in ended.log(0), ended.log(0)[-3000:]
    assert "did not end cleanly" not in ended.log(0) + ended.log(1)
