"""No silent wrong restore (issue 14): every version restored or rebuilt is checked
against the checksum its writer took before the version counted as committed; a rebuild
under another EC geometry is refused on every rank, naming both; a missing, empty or
short file is a lost shard that parity rebuilds. Real SMPs, shared memory and processes."""
import dataclasses
import os
import signal

import numpy as np
import pytest
import torch

from harness.common import flip_byte, job_id, make_engine, run_cli
from harness.ranks import wait_until
from ftmem import NotRecoverableFromMemory
from ftmem._common import testhooks
from ftmem._state.checksum import DATA_CHUNK, checksum, data_checksum, data_checksum_and_cpu
from ftmem._shm.procs import pid_alive
from ftmem._shm.slots import PARITY, RankStore
from ftmem._shm.smp_client import running_smp
from harness.toy import TIMEOUT, TrainJob, reference_run

WORLD = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), WORLD)


def kill_the_smp(node_dir):
    pid = running_smp(node_dir)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, f"SMP {pid} to die")


def the_writers_checksum_is_in_the_marker(store, version):
    """``version``'s commit record, after checking that it holds the checksum of exactly
    the bytes in its slot."""
    record = store.read_commit(version)
    with store.map_slot(record.slot, writable=False) as mm, memoryview(mm) as whole:
        written = data_checksum(whole[: record.plan.nbytes])
    assert record.checksum == written, f"the marker holds {record.checksum}, the slot's bytes are {written}"
    return record


def right_after_its_commit(monkeypatch, engine, version, change):
    """Run ``change(engine.store, slot)`` in the window finding 4 was about: ``version``'s
    commit marker has just been written, and nothing else has happened yet (no parity, no
    job-wide agreement, the handle not committed), with the node's SMP killed first.
    Older ftmem had the SMP checksum ("seal", a ``*.seal`` file) a version after its commit,
    so bytes changed in this window were sealed as they were, or never if the SMP was down;
    now the writer's checksum is in the marker before it exists (the ``after_commit`` test
    hook of ftmem._engine.commit), and nothing takes one later. Returns a list that holds the
    version's commit record, as found in the window, once the window was reached."""
    seen = []
    real = testhooks.at

    def at(point, rank, v):
        real(point, rank, v)
        if point == "after_commit" and v == version:
            kill_the_smp(engine.identity.node_dir)
            record = the_writers_checksum_is_in_the_marker(engine.store, version)
            change(engine.store, record.slot)
            seen.append(record)

    monkeypatch.setattr(testhooks, "at", at)
    return seen


def smp_down_with_nothing_but_the_writers_checksum(store, version):
    """A version committed and protected, then the node's SMP killed: nothing but the
    checksum the writer put in the marker before it existed stands for the version's bytes
    (there is no later seal to lose, as there was in older ftmem)."""
    kill_the_smp(store.node_dir)
    the_writers_checksum_is_in_the_marker(store, version)
    assert version in store.parity_held()


def damage(path, how):
    if how == "missing":
        os.unlink(path)
    elif how == "empty":
        os.truncate(path, 0)
    else:  # short
        os.truncate(path, os.path.getsize(path) // 2)


# -- finding 4: bytes changed after the writer's checksum are never blessed ---------------
def test_the_data_checksum_sees_a_flip_in_any_chunk_whatever_buffer_holds_the_bytes():
    """Chunks are hashed by several threads: the digest must still cover every byte,
    chunk edges included, and not depend on the buffer type or the order threads end."""
    data = np.random.default_rng(0).integers(0, 256, 2 * DATA_CHUNK + 5, dtype=np.uint8)
    whole = data_checksum(data)
    assert data_checksum(bytes(data)) == whole == data_checksum(memoryview(data))
    for at in (0, DATA_CHUNK - 1, DATA_CHUNK, 2 * DATA_CHUNK + 4):
        data[at] ^= 1
        assert data_checksum(data) != whole, at
        data[at] ^= 1
    assert data_checksum(data) == whole
    assert data_checksum(data[:DATA_CHUNK]) != data_checksum(data[: DATA_CHUNK + 1])
    # The CPU its threads spent is counted (none where the caller took the one chunk itself).
    digest, cpu = data_checksum_and_cpu(data)
    assert digest == whole and cpu > 0
    assert data_checksum_and_cpu(data[:DATA_CHUNK]) == (data_checksum(data[:DATA_CHUNK]), 0.0)


def test_a_save_counts_the_cpu_its_copy_and_checksum_took_on_every_thread(shm_dir):
    """A save of three checksum chunks into a slot used before: its CPU time counts the copy
    thread's (at least what a copy of the same bytes into touched memory takes) and the
    checksum threads' (seen failing with the latter left out)."""
    import time

    engine = make_engine(shm_dir)
    w = torch.ones(3 * DATA_CHUNK // 4)
    handles = [engine.save({"w": w}, version) for version in range(1, 5)]  # version 4 reuses version 1's slot
    assert handles[0].cpu_s is None  # until committed
    engine.wait_protected()
    copy, into = [], torch.ones_like(w)
    for _ in range(3):
        began = time.thread_time()
        into.copy_(w)
        copy.append(time.thread_time() - began)
    checksum_alone = min(data_checksum_and_cpu(w.numpy())[1] for _ in range(3))
    assert handles[-1].cpu_s > min(copy) + checksum_alone / 2, (handles[-1].cpu_s, min(copy), checksum_alone)
    engine.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="after the commit, before parity", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1, the damaged version 2 dropped as lost, never "
                          "restored")
def test_a_byte_flipped_right_after_its_commit_with_the_smp_down_is_never_restored(shm_dir, ftmem_log,
                                                                                  monkeypatch):
    engine = make_engine(shm_dir, job_id())
    engine.save({"w": torch.zeros(4096)}, 1).wait_protected()
    window = right_after_its_commit(monkeypatch, engine, 2, lambda store, slot: flip_byte(store.slot_path(slot), 1000))
    engine.save({"w": torch.ones(4096)}, 2).wait_protected()
    assert window, "the save of version 2 never reached the after_commit point"
    restored = engine.restore()
    assert restored.version == 1 and torch.equal(restored.state["w"], torch.zeros(4096))
    assert "rank 0 version 2: data in" in ftmem_log.text() and "does not match its checksum" in ftmem_log.text()
    assert engine.versions() == [1]  # dropped as lost
    engine.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="after the commit, before parity", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1, the changed marker caught by its own checksum")
def test_a_commit_marker_changed_right_after_its_commit_with_the_smp_down_is_never_restored(shm_dir, ftmem_log,
                                                                                          monkeypatch):
    """A change that still decodes (a key renamed in the skeleton) is caught by the
    marker's own checksum."""
    def rename_the_key(store, slot):
        with open(store.commit_path(2, slot), "r+b") as f:
            raw = f.read()
            f.seek(raw.index(b"weights"))
            f.write(b"W")

    engine = make_engine(shm_dir, job_id())
    engine.save({"weights": torch.zeros(16)}, 1).wait_protected()
    window = right_after_its_commit(monkeypatch, engine, 2, rename_the_key)
    engine.save({"weights": torch.ones(16)}, 2).wait_protected()
    assert window, "the save of version 2 never reached the after_commit point"
    restored = engine.restore()
    assert restored.version == 1 and list(restored.state) == ["weights"]
    assert "does not match its own checksum" in ftmem_log.text()
    engine.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, rank 0's damaged data rebuilt from parity")
def test_a_byte_flipped_with_the_smp_down_is_rebuilt_from_parity(shm_dir, tmp_path, reference):
    job = TrainJob(shm_dir, tmp_path, world=WORLD, ec=(2, 1))
    job.run_until_stopped(after=5)
    store = RankStore(job.node_dir(0), 0)
    smp_down_with_nothing_but_the_writers_checksum(store, 5)
    flip_byte(store.slot_path(store.committed()[5]), 200)
    job.restart_and_check(reference, expect_version=5, rebuilt_ranks={0})
    assert "rank 0 version 5: data in" in job.log(0) and "does not match its checksum" in job.log(0)


# -- finding 7: a missing, empty or short file is a lost shard -------------------------
@pytest.mark.parametrize("how", ["missing", "empty", "short"])
@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1, the damaged version 2 treated as lost")
def test_a_missing_empty_or_short_slot_file_is_a_lost_shard(shm_dir, ftmem_log, how):
    job = job_id()
    engine = make_engine(shm_dir, job)
    for v in (1, 2):
        engine.save({"w": torch.full((4096,), float(v))}, v).wait_protected()
    engine.close()
    damage(engine.store.slot_path(engine.store.committed()[2]), how)
    status = run_cli("status", "--json", "--shm-dir", shm_dir)
    assert status.returncode == 0, status.stderr

    again = make_engine(shm_dir, job)  # the restart
    restored = again.restore()
    assert restored.version == 1 and torch.equal(restored.state["w"], torch.full((4096,), 1.0))
    assert "rank 0 version 2:" in ftmem_log.text() and "Treating it as lost" in ftmem_log.text()
    again.save({"w": torch.full((4096,), 3.0)}, 3).wait_protected()  # into the damaged slot, allocated again
    assert torch.equal(again.restore().state["w"], torch.full((4096,), 3.0))
    again.close(job_finished=True)


@pytest.mark.parametrize("what", ["data", "markers"])
@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="refuses with a reason: NotRecoverableFromMemory naming the damaged versions, never a fresh "
                          "start")
def test_a_job_whose_every_version_is_damaged_is_not_taken_for_a_fresh_job(shm_dir, ftmem_log, what):
    """With every held version dropped as damaged, nothing is left, as for a job that never
    saved: the restart would have started from scratch with no word of the versions lost.
    It is refused as not recoverable, naming them, so the adapter falls back to the disk
    (or says why it starts from scratch)."""
    job = job_id()
    engine = make_engine(shm_dir, job)
    for v in (1, 2):
        engine.save({"w": torch.full((4096,), float(v))}, v).wait_protected()
    engine.close()
    for v, slot in engine.store.committed().items():
        path = engine.store.slot_path(slot) if what == "data" else engine.store.commit_path(v, slot)
        flip_byte(path, 100)

    again = make_engine(shm_dir, job)  # the restart
    with pytest.raises(NotRecoverableFromMemory, match=r"memory held version\(s\) \[1, 2\] of this job, but no rank "
                                                       r"has intact data of any of them"):
        again.restore()
    assert ftmem_log.text().count("Treating it as lost") == 2
    assert again.restore() is None  # the damaged versions are gone: now it is a fresh start
    again.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 5, rank 0 rebuilt from the other nodes' parity")
def test_a_rank_whose_slot_file_is_gone_and_parity_file_empty_is_rebuilt(shm_dir, tmp_path, reference):
    job = TrainJob(shm_dir, tmp_path, world=WORLD, ec=(2, 1))
    job.run_until_stopped(after=5)
    store = RankStore(job.node_dir(0), 0)
    damage(store.slot_path(store.committed()[5]), "missing")
    damage(store.slot_path(store.parity_held()[5], PARITY), "empty")
    status = run_cli("status", "--json", "--shm-dir", shm_dir, "--job", job.job)
    assert status.returncode == 0, status.stderr
    job.restart_and_check(reference, expect_version=5, rebuilt_ranks={0})
    assert "cannot be read" in job.log(0) and "Treating it as lost" in job.log(0)


# -- finding 3: a rebuild checks the parity's geometry; rebuilt data its checksum -------
@pytest.mark.fault("restart under another EC geometry", phase="startup", framework="engine (toy trainer)",
                   expect="refuses with a reason: every rank exits 3 naming the geometry the parity was written for "
                          "and the new one")
def test_a_rebuild_under_another_ec_geometry_is_refused_on_every_rank(shm_dir, tmp_path):
    job = TrainJob(shm_dir, tmp_path, world=WORLD, ec=(2, 1))
    job.run_until_stopped(after=5)
    job.lose_node(1)
    codes = job.run("--ec-k", "1", "--ec-m", "2")  # the same job restarted with another "ec"
    logs = [job.log(rank) for rank in range(WORLD)]
    assert codes == [3] * WORLD, logs  # EcGeometryMismatch on every rank: no garbage, no hang
    for log in logs:
        assert "no version is recoverable from memory" in log
        assert "was written for k=2, m=1 over nodes [0, 1, 2]" in log
        assert "the job now runs k=1, m=2 over nodes [0, 1, 2]" in log
        assert "restored iteration" not in log


@pytest.mark.fault("restart on fewer or more nodes", phase="startup", framework="engine (toy trainer)",
                   expect="refuses with a reason: every rank, the new one too, exits 3 naming both geometries")
def test_a_restart_with_one_more_rank_is_refused_on_every_rank(shm_dir, tmp_path):
    """Issue 15, finding 4: the same job id restarted on 4 ranks (k=3) where 3 saved (k=2).
    The new rank has nothing, and used to fail with an IndexError while the others hung."""
    job = TrainJob(shm_dir, tmp_path, world=WORLD, ec=(2, 1))
    job.run_until_stopped(after=3)
    job.world = WORLD + 1
    codes = job.run("--ec-k", "3", "--ec-m", "1")
    logs = [job.log(rank) for rank in range(WORLD + 1)]
    assert codes == [3] * (WORLD + 1), logs
    for log in logs:
        assert "was written for k=2, m=1 over nodes [0, 1, 2]" in log
        assert "the job now runs k=3, m=1 over nodes [0, 1, 2, 3]" in log


@pytest.mark.fault("shared memory damaged", phase="during a rebuild", framework="engine (toy trainer)",
                   expect="refuses with a reason: every rank exits 3, the rebuilt data missing its writer's checksum")
def test_rebuilt_data_that_misses_its_writers_checksum_is_refused_on_every_rank(shm_dir, tmp_path):
    """Node 0's parity piece for node 1's first piece is changed and checksummed again:
    it passes its own check, but what it rebuilds is not what node 1 wrote."""
    job = TrainJob(shm_dir, tmp_path, world=WORLD, ec=(2, 1))
    job.run_until_stopped(after=5)
    store = RankStore(job.node_dir(0), 0)
    record = store.read_parity(5)
    path = store.slot_path(record.slot, PARITY)
    flip_byte(path, 0)
    with open(path, "rb") as f:
        pieces = f.read(record.piece_size * len(record.checksums))
    size = record.piece_size
    store.write_parity(dataclasses.replace(
        record, checksums=tuple(checksum(pieces[i * size:(i + 1) * size]) for i in range(len(record.checksums)))))
    job.lose_node(1)
    codes = job.run()
    logs = [job.log(rank) for rank in range(WORLD)]
    assert codes == [3] * WORLD, logs
    for log in logs:
        assert "version 5 cannot be rebuilt from memory: rank 1's data rebuilt from parity does not match the " \
               "checksum its writer took" in log
        assert "restored iteration" not in log


@pytest.mark.fault("shared memory damaged", phase="during protection", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 4, node 1 rebuilt, the damaged parity of version 5 "
                          "found")
def test_a_parity_copy_damaged_before_its_marker_is_found_and_the_version_before_resumes(shm_dir, tmp_path):
    """2 nodes mirrored (k=1, m=1): node 0 keeps node 1's data as its parity. A byte of it
    changes after it arrived and before its marker is written. The marker carries node 1's
    own checksum of those bytes, so the check finds the damage: with node 1 lost, version 5
    cannot be rebuilt, and the job resumes from version 4, bitwise. (When the holder
    checksummed what it had received, that blessed the damage: the job chose version 5 and
    then refused its rebuild.)"""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    job = TrainJob(shm_dir, tmp_path / "run", world=2, ec=(1, 1), protect_each=True)
    hold = {0: {"FTMEM_TEST_HOOK": "mid_exchange:hold:rank=0:version=5", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    with job.start("--stop-after", "5", rank_env=hold) as run:
        run.wait_for((hooks / "paused.rank0.v5").exists, TIMEOUT, "rank 0 to hold mid-exchange of version 5")
        store = RankStore(job.node_dir(0), 0)
        # Version 5's parity goes to the parity slot that does not hold the protected version 4's.
        flip_byte(store.slot_path(store.free_slot(PARITY, keep=(store.parity_held()[4],)), PARITY), 200)
        (hooks / "resume.rank0.v5").touch()
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(2)), TIMEOUT, "step 5")
    assert store.read_parity(5).copy_of == (1,)
    job.lose_node(1)
    job.restart_and_check(reference_run(tmp_path / "reference", 2), expect_version=4, rebuilt_ranks={1})
    assert "rank 0 version 5: parity piece 0 in" in job.log(0) and "does not match its checksum" in job.log(0)
