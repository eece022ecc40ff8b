"""The fault matrix (issue 14): kill points crossed with what dies and with how many
nodes of the EC group are lost, on the engine-only toy trainer
(examples/engine/toy_train.py) with real processes, gloo, SIGKILL and shared memory.

Here: 3 ranks on 3 virtual nodes, one EC group k=2, m=1, a version saved every
iteration. Every case ends in one of these, and none hangs (every wait is bounded by
TIMEOUT and ends early on an event: a pause marker, a held version, an exit):

* **resumes**: the restart logs ``restored iteration N from memory`` on every rank, with
  ``rebuilt from parity`` on a rank whose node was lost, and its losses and final
  weights are bitwise those of a run without ftmem (TrainJob.restart_and_check). N is
  the newest version every rank holds intact or can rebuild: never older than the
  newest protected one, and newer when every rank had committed a version whose parity
  was unfinished (killed after its commit or mid-exchange);
* **refuses with the reason**: more than m nodes lost, the toy trainer exits 3 naming
  the group and the nodes it lacks (where a persistent tier exists that is the disk
  fallback: tests/integration/deepspeed/test_deepspeed.py,
  tests/integration/megatron/test_megatron.py);
* the **survivors** of a rank's or a node's death stop by themselves with an error,
  within TIMEOUT (a launcher then restarts the job).

Cells run here (kill point x victim, lost nodes):

* between saves x one rank (the others torn down after it)
* mid-copy x all ranks; x all ranks and every SMP; x a whole node; x an SMP alone
  (the job goes on, finishes bitwise, frees its memory)
* after commit x all ranks
* mid-exchange x one rank; x all ranks with 0, 1 and 2 (= m+1) nodes lost
* mid-restore x all ranks; x one rank; mid-rebuild x the rank being rebuilt
* the engine's start (between its process groups) x one rank killed; x one rank hung
* mid-flush x all ranks (tests/harness/lifecycle_job.py: the toy trainer has no persistent tier);
  mid-publish (rank 0 killed writing the flush manifest or retiring an old checkpoint)

The other cells are run elsewhere (tests/integration/engine/test_crash_recovery.py,
tests/faults/test_node_loss.py, tests/integration/engine/test_integrity.py,
tests/integration/engine/test_engine.py, tests/integration/deepspeed/test_deepspeed.py, ...);
docs/design/fault-matrix.md has the whole table, each cell naming its test.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from harness.common import job_id, logged
from harness.ranks import LocalJob, wait_until
from ftmem import SnapshotEngine, restored_from_memory
from ftmem._shm import jobs
from ftmem._disk.persist import flushed
from ftmem._shm.procs import pid_alive
from ftmem._shm.smp_client import running_smp
from harness.toy import TIMEOUT, TrainJob, assert_same_training, reference_run

WORLD, EC = 3, (2, 1)
ALL = range(WORLD)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), WORLD)


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "hooks"
    path.mkdir()
    return str(path)


def new_job(shm_dir, tmp_path) -> TrainJob:
    """Every version protected in turn, so that a kill point names the version it stops."""
    return TrainJob(shm_dir, tmp_path / "run", WORLD, ec=EC, protect_each=True)


def hook(point, action, version, hook_dir, ranks=ALL) -> dict:
    """rank_env that sets FTMEM_TEST_HOOK (ftmem/_common/testhooks.py) on ``ranks``."""
    return {r: {"FTMEM_TEST_HOOK": f"{point}:{action}:rank={r}:version={version}", "FTMEM_TEST_HOOK_DIR": hook_dir}
            for r in ranks}


def paused(hook_dir, version, ranks=ALL):
    return lambda: all(os.path.exists(os.path.join(hook_dir, f"paused.rank{r}.v{version}")) for r in ranks)


def resume(hook_dir, rank, version) -> None:
    open(os.path.join(hook_dir, f"resume.rank{rank}.v{version}"), "w").close()


def kill_smp(job: TrainJob, node: int) -> int:
    pid = job.nodes()[node]["smp_pid"]
    assert pid is not None, job.nodes()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), TIMEOUT, f"SMP {pid} to die")
    return pid


def stop_by_themselves(run: LocalJob, ranks) -> None:
    """The survivors of a peer's death exit by themselves, with an error, within TIMEOUT:
    none waits forever for the dead peer."""
    deadline = time.monotonic() + TIMEOUT
    for rank in ranks:
        try:
            code = run.procs[rank].wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still runs {TIMEOUT} s after its peer died: a hang. Log:\n"
                        f"{run.log(rank)[-3000:]}")
        assert code != 0, run.log(rank)[-3000:]


def refuses(job: TrainJob, lacks: str) -> None:
    """A restart that memory cannot serve: every rank exits 3 with the reason, restores nothing."""
    codes = job.run()
    logs = [job.log(r) for r in ALL]
    assert codes == [3] * WORLD, logs
    for log in logs:
        assert "no version is recoverable from memory" in log and lacks in log, log[-3000:]
        assert "Fall back to a disk checkpoint" in log and "restored iteration" not in log


# -- between saves ------------------------------------------------------------------------------
@pytest.mark.fault("rank SIGKILLed", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, its node's SMP and memory outliving the rank")
def test_one_rank_killed_between_saves_costs_no_version(shm_dir, tmp_path, reference):
    """Rank 1 dies while every rank sits between saves (version 5 protected); its node's
    SMP and memory outlive it. The launcher then tears the job down and restarts it."""
    job = new_job(shm_dir, tmp_path)
    with job.start("--stop-after", "5") as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in ALL), TIMEOUT, "step 5")
        smps = {n: job.nodes()[n]["smp_pid"] for n in ALL}
        run.kill(1)
        assert {n: job.nodes()[n]["smp_pid"] for n in ALL} == smps and pid_alive(smps[1])
        assert [job.nodes()[n]["protected"] for n in ALL] == [5, 5, 5] and job.held(1) == [3, 4, 5]
    job.restart_and_check(reference, expect_version=5)


# -- mid-copy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("point, smps_too, expect", [
    # v6 torn on every rank: invisible, v5 whole
    pytest.param("mid_copy", False, 5, id="mid_copy", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="during the copy", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 5, the torn version 6 invisible")),
    # ... and every node's SMP dies with its ranks; memory stays
    pytest.param("mid_copy", True, 5, id="mid_copy-and-smps", marks=pytest.mark.fault(
        "SMP SIGKILLed", phase="during the copy", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 5 through new SMPs, every rank killed with its SMP")),
    # v6 committed everywhere, no parity yet: every rank holds it whole
    pytest.param("after_commit", False, 6, id="after_commit", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="after the commit, before parity", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 6, committed by every rank, no parity yet")),
])
def test_all_ranks_killed_at(point, smps_too, expect, shm_dir, tmp_path, hooks, reference):
    job = new_job(shm_dir, tmp_path)
    with job.start(rank_env=hook(point, "pause", 6, hooks)) as run:
        run.wait_for(paused(hooks, 6), TIMEOUT, f"every rank to pause at {point} of version 6")
        if smps_too:
            for node in ALL:
                kill_smp(job, node)
        run.kill_all()
    assert [job.held(n) for n in ALL] == [[4, 5] if point == "mid_copy" else [4, 5, 6]] * WORLD
    job.restart_and_check(reference, expect_version=expect)  # with new SMPs, where they were killed


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="during the copy", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, node 1 rebuilt from parity; the survivors stop by "
                          "themselves")
def test_a_node_lost_mid_copy(shm_dir, tmp_path, hooks, reference):
    """Node 1 is lost while its rank copies version 6 and the others, which committed 6,
    wait for its pieces: they stop by themselves; 6 has no parity, so the restart rebuilds
    rank 1's version 5."""
    job = new_job(shm_dir, tmp_path)
    with job.start(rank_env=hook("mid_copy", "pause", 6, hooks, ranks=[1])) as run:
        run.wait_for(paused(hooks, 6, ranks=[1]), TIMEOUT, "rank 1 to pause mid-copy of version 6")
        run.wait_for(lambda: 6 in job.held(0) and 6 in job.held(2), TIMEOUT, "ranks 0 and 2 to commit version 6")
        run.kill(1)
        job.lose_node(1)
        stop_by_themselves(run, [0, 2])
    assert job.held(0) == job.held(2) == [4, 5, 6]
    job.restart_and_check(reference, expect_version=5, rebuilt_ranks={1})


@pytest.mark.fault("SMP SIGKILLed", phase="during the copy", framework="engine (toy trainer)",
                   expect="goes on: the job ends bitwise, and its end frees the memory through a new SMP")
def test_an_smp_killed_mid_copy_changes_nothing(shm_dir, tmp_path, hooks, reference):
    """Node 1's SMP dies while its rank is halfway through copying version 6: the copy,
    the commit and the protection never need the SMP; the job finishes bitwise, and its
    end frees the memory through a new SMP."""
    job = new_job(shm_dir, tmp_path)
    with job.start(rank_env=hook("mid_copy", "hold", 6, hooks, ranks=[1])) as run:
        run.wait_for(paused(hooks, 6, ranks=[1]), TIMEOUT, "rank 1 to hold mid-copy of version 6")
        kill_smp(job, 1)
        resume(hooks, 1, 6)
        codes = run.wait(TIMEOUT)
    assert codes == [0] * WORLD, [job.log(r)[-3000:] for r in ALL]
    assert not any("restored iteration" in job.log(r) for r in ALL)
    assert_same_training(job.out, reference, WORLD)
    assert jobs.status(shm_dir)["jobs"] == []  # freed by the new SMP before the ranks exited


@pytest.mark.fault("SMP SIGKILLed", phase="at the job's end", framework="engine (toy trainer)",
                   expect="goes on: the job's end starts a new SMP, which frees the node's memory before close returns")
def test_an_smp_killed_before_the_end_of_the_job_still_frees_its_memory(shm_dir):
    """The end of a job whose SMP was killed (no request since): the rank's "finished"
    starts a new SMP, and close() returns only once that one has freed the node. It used
    to wait for the killed SMP only, and returned with the memory still there (about one
    close in two)."""
    for _ in range(5):
        engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job_id(), "ranks_per_node": 1}, rank=0, world_size=1)
        engine.save({"w": torch.zeros(1 << 16)}, 1).wait_protected()
        pid = running_smp(engine.identity.node_dir)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), TIMEOUT, f"SMP {pid} to die")
        engine.close(job_finished=True)
        assert not os.path.exists(engine.identity.node_dir) and jobs.list_jobs(shm_dir) == []


# -- mid-exchange -------------------------------------------------------------------------------
@pytest.mark.fault("rank SIGKILLed", phase="during protection", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 6, which every rank had committed; its column peers "
                          "stop by themselves")
def test_one_rank_killed_mid_exchange(shm_dir, tmp_path, hooks, reference):
    """Rank 1 dies right after the first all_to_all of version 6's pieces: its column
    peers stop by themselves. Every rank had committed 6 before the exchange, so the
    restart resumes from 6."""
    job = new_job(shm_dir, tmp_path)
    with job.start(rank_env=hook("mid_exchange", "kill", 6, hooks, ranks=[1])) as run:
        wait_until(lambda: run.procs[1].poll() is not None, TIMEOUT, "rank 1 to die mid-exchange of version 6")
        assert run.procs[1].returncode == -signal.SIGKILL
        stop_by_themselves(run, [0, 2])
    assert [job.held(n) for n in ALL] == [[4, 5, 6]] * WORLD
    job.restart_and_check(reference, expect_version=6)


@pytest.mark.parametrize("lost", [
    pytest.param(0, id="0-lost", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="during protection", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 6, committed by every rank before its exchange")),
    pytest.param(1, id="1-lost", marks=pytest.mark.fault(
        "node lost (its ranks, SMP and memory)", phase="during protection", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 5, rebuilt on the lost node (version 6 has no parity)")),
    pytest.param(2, id="m+1-lost", marks=pytest.mark.fault(
        "more nodes lost than parity", phase="during protection", framework="engine (toy trainer)",
        expect="refuses with a reason: every rank exits 3 naming the group and the nodes it lacks; nothing "
               "deleted")),
])
def test_all_ranks_killed_mid_exchange_then_nodes_lost(lost, shm_dir, tmp_path, hooks, reference):
    """Every rank dies mid-exchange of version 6 (committed, no parity); then ``lost``
    nodes are lost. 0: 6 resumes as every rank holds it; 1: 6 cannot be rebuilt (no
    parity), 5 is, onto the lost node; 2 = m+1: nothing is recoverable, said so."""
    job = new_job(shm_dir, tmp_path)
    with job.start(rank_env=hook("mid_exchange", "pause", 6, hooks)) as run:
        run.wait_for(paused(hooks, 6), TIMEOUT, "every rank to pause mid-exchange of version 6")
        run.kill_all()
    assert [job.held(n) for n in ALL] == [[4, 5, 6]] * WORLD
    assert [job.nodes()[n]["protected"] for n in ALL] == [5] * WORLD
    for node in range(lost):
        job.lose_node(node)
    if lost == 0:
        job.restart_and_check(reference, expect_version=6)
    elif lost == 1:
        job.restart_and_check(reference, expect_version=5, rebuilt_ranks={0})
    else:
        refuses(job, "EC group of nodes [0, 1, 2] (k=2, m=1) lacks node(s) [0, 1]")
        assert job.held(2) == [4, 5, 6]  # a refusal deletes nothing


# -- mid-restore --------------------------------------------------------------------------------
@pytest.mark.fault("every rank SIGKILLed", phase="during a restore", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5 at the next restart")
def test_all_ranks_killed_mid_restore(shm_dir, tmp_path, hooks, reference):
    job = new_job(shm_dir, tmp_path)
    job.run_until_stopped(after=5)
    with job.start(rank_env=hook("mid_restore", "pause", 5, hooks)) as run:
        run.wait_for(paused(hooks, 5), TIMEOUT, "every rank to pause restoring version 5")
        run.kill_all()
    assert [job.held(n) for n in ALL] == [[3, 4, 5]] * WORLD
    job.restart_and_check(reference, expect_version=5)


@pytest.mark.fault("rank SIGKILLed", phase="during a restore", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5; the others stop by themselves mid-gather")
def test_one_rank_killed_mid_restore(shm_dir, tmp_path, hooks, reference):
    """Rank 1 dies once the job agreed on version 5; the others, gathering the DP-sharded
    state, stop by themselves; the next restart restores 5."""
    job = new_job(shm_dir, tmp_path)
    job.run_until_stopped(after=5)
    with job.start(rank_env=hook("mid_restore", "kill", 5, hooks, ranks=[1])) as run:
        wait_until(lambda: run.procs[1].poll() is not None, TIMEOUT, "rank 1 to die restoring version 5")
        assert run.procs[1].returncode == -signal.SIGKILL
        stop_by_themselves(run, [0, 2])
    assert [job.held(n) for n in ALL] == [[3, 4, 5]] * WORLD
    job.restart_and_check(reference, expect_version=5)


@pytest.mark.parametrize("action", [
    pytest.param("kill", id="kill", marks=pytest.mark.fault(
        "rank SIGKILLed", phase="startup", framework="engine (toy trainer)",
        expect="ends every rank within FTMEM_COLLECTIVE_TIMEOUT_S, naming the rank that did not come; the restart "
               "resumes version 5 bitwise")),
    pytest.param("pause", id="pause", marks=pytest.mark.fault(
        "rank stopped (SIGSTOP)", phase="startup", framework="engine (toy trainer)",
        expect="ends every rank within FTMEM_COLLECTIVE_TIMEOUT_S, naming the hung rank that did not come; the "
               "restart resumes version 5 bitwise")),
])
def test_a_rank_lost_while_ftmem_makes_its_groups_stops_the_others_in_bounded_time(action, shm_dir, tmp_path, hooks,
                                                                                   reference):
    """A relaunch whose rank 1 dies (or hangs) once the engine has made its first process
    group: the others sat in torch's store barrier of the next group for gloo's 30 minutes.
    Now each stops within FTMEM_COLLECTIVE_TIMEOUT_S (here 5 s) and says which rank did not
    come; memory is untouched and the next restart resumes version 5 bitwise."""
    job = new_job(shm_dir, tmp_path)
    job.run_until_stopped(after=5)
    rank_env = {r: {"FTMEM_COLLECTIVE_TIMEOUT_S": "5", **hook("new_group", action, 1, hooks, ranks=[1]).get(r, {})}
                for r in ALL}
    with job.start(rank_env=rank_env) as run:
        stop_by_themselves(run, [0, 2])
        for rank in (0, 2):
            assert "ftmem's process groups could not be made: ranks [1] did not come within 5 s" in run.log(rank), \
                run.log(rank)[-3000:]
        if action == "pause":
            assert run.procs[1].poll() is None  # it hangs, as a stopped process does, until the launcher kills it
    assert [job.held(n) for n in ALL] == [[3, 4, 5]] * WORLD
    job.restart_and_check(reference, expect_version=5)


@pytest.mark.fault("rank SIGKILLed", phase="during a rebuild", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, rank 1 rebuilt again; the survivors stop, their "
                          "parity intact")
def test_the_rank_being_rebuilt_killed_mid_rebuild(shm_dir, tmp_path, hooks, reference):
    """Node 1 lost; the restart decodes rank 1's version 5 from parity, and rank 1 dies
    before writing it. The survivors stop by themselves, their parity intact, and the next
    restart rebuilds rank 1 again."""
    job = new_job(shm_dir, tmp_path)
    job.run_until_stopped(after=5)
    job.lose_node(1)
    with job.start(rank_env=hook("mid_rebuild", "kill", 5, hooks, ranks=[1])) as run:
        wait_until(lambda: run.procs[1].poll() is not None, TIMEOUT, "rank 1 to die rebuilding version 5")
        assert run.procs[1].returncode == -signal.SIGKILL
        stop_by_themselves(run, [0, 2])
    assert job.held(1) == [] and job.held(0) == job.held(2) == [3, 4, 5]
    job.restart_and_check(reference, expect_version=5, rebuilt_ranks={1})


@pytest.mark.fault("shared memory damaged", phase="during a rebuild", framework="engine (toy trainer)",
                   expect="ends every rank within the test's bound, each naming rank 1's rebuilt data it could not "
                          "store; the next restart rebuilds version 5")
def test_a_rebuilt_rank_that_cannot_store_its_data_stops_every_rank_with_the_reason(shm_dir, tmp_path, hooks,
                                                                                     reference):
    """Node 1 lost; the restart decodes rank 1's version 5, and node 1's memory goes again
    before rank 1 stores it. Rank 1's error was its own: the others stopped on gloo's
    error at its exit, with no reason (had rank 1 caught it, they would have waited). Now
    every rank stops with the reason, and the next restart rebuilds."""
    job = new_job(shm_dir, tmp_path)
    job.run_until_stopped(after=5)
    job.lose_node(1)
    with job.start(rank_env=hook("mid_rebuild", "hold", 5, hooks, ranks=[1])) as run:
        run.wait_for(paused(hooks, 5, ranks=[1]), TIMEOUT, "rank 1 about to store its rebuilt version 5")
        shutil.rmtree(job.node_dir(1))
        resume(hooks, 1, 5)
        stop_by_themselves(run, range(WORLD))
    for rank in range(WORLD):
        assert "version 5 cannot be rebuilt from memory: rank 1 could not store its rebuilt data" in job.log(rank)
    assert job.held(0) == job.held(2) == [3, 4, 5]
    job.restart_and_check(reference, expect_version=5, rebuilt_ranks={1})


# -- mid-flush ----------------------------------------------------------------------------------
@pytest.mark.fault("every rank SIGKILLed", phase="during a flush", framework="adapter runtime",
                   expect="resumes bitwise from memory: version 2, the disk still naming version 1")
def test_all_ranks_killed_mid_flush(shm_dir, tmp_path, hooks):
    """tests/harness/lifecycle_job.py (2 ranks, k=1, m=1, every version flushed): every rank dies
    once one file of version 2's flush is written. The disk still names version 1; memory
    holds 2, protected, and the restart resumes from it."""
    persist, out, job = tmp_path / "persist", tmp_path / "out", job_id()

    def start(steps, rank_env=None):
        return LocalJob("tests.harness.lifecycle_job", ["--out", str(out), "--steps", str(steps), "--persist", str(persist)],
                        2, job, str(out), env={"SHM_DIR": shm_dir}, rank_env=rank_env)

    with start(3, rank_env=hook("mid_flush", "pause", 2, hooks, ranks=[0, 1])) as run:
        run.wait_for(paused(hooks, 2, ranks=[0, 1]), TIMEOUT, "both ranks to pause mid-flush of version 2")
        run.kill_all()
    assert (persist / "newest").read_text() == "v1" and not (persist / "v2").exists()
    assert {n["node"]: n["protected"] for n in jobs.status(shm_dir, job)["jobs"][0]["nodes"]} == {0: 2, 1: 2}
    again = start(3)
    assert again.wait(TIMEOUT) == [0, 0], again.log(0)[-3000:]
    for rank in range(2):
        assert logged(restored_from_memory(2, rank), again.log(rank))
    assert (persist / "newest").read_text() == "v3" and jobs.list_jobs(shm_dir) == []


@pytest.mark.parametrize("at", ["manifest", "retire"])
@pytest.mark.fault("rank SIGKILLed", phase="during a flush", framework="adapter runtime",
                   expect="resumes bitwise from disk: the manifest's newest entry is on disk, never a retired "
                          "checkpoint")
def test_a_kill_while_publishing_leaves_the_newest_recorded_checkpoint_on_disk(at, tmp_path):
    """keep=1: rank 0 publishes version 4 and retires version 2, and is SIGKILLed at the
    manifest's write or at the retirement. A restart that memory cannot serve loads the
    manifest's newest entry, which must exist (a manifest still naming a retired,
    deleted checkpoint made every such restart fail: FileNotFoundError, a crash loop)."""
    root = str(tmp_path)
    child = textwrap.dedent(f"""
        import os, shutil, signal
        from ftmem._disk import persist
        def point_at(root, name):
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(name)
        def killed(real, hit):
            def call(path, *args, **kwargs):
                if hit(path):
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(path, *args, **kwargs)
            return call
        for version in (2, 4):
            persist.make_staging(os.path.join({root!r}, f".global_step{{version}}.tmp"))
            if version == 4 and {at!r} == "manifest":
                persist.write_atomically = killed(persist.write_atomically, lambda p: p.endswith(persist.MANIFEST))
            if version == 4 and {at!r} == "retire":
                persist.shutil.rmtree = killed(shutil.rmtree, lambda p: p.endswith("global_step2"))
            persist.publish({root!r}, f".global_step{{version}}.tmp", f"global_step{{version}}", version, point_at,
                            keep=1)
    """)
    assert subprocess.run([sys.executable, "-c", child], timeout=TIMEOUT).returncode == -signal.SIGKILL
    newest = flushed(root)[-1]
    assert os.path.isdir(os.path.join(root, newest["name"])), (newest, os.listdir(root))
    assert newest["version"] == {"manifest": 2, "retire": 4}[at]
