"""Single-rank engine behaviour against a real SMP process and real shared memory."""
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from harness.common import flip_byte, job_id, make_engine, run_cli
from ftmem import (ConfigError, CorruptShard, LayoutMismatch, NoRecoverableVersion, ParallelLayout, ShmBudgetError,
                   SnapshotEngine, UnsupportedTensor)
from ftmem.adapter import FrameworkFormat, TensorPlace, flushed
from ftmem._shm import integrity
from ftmem._disk.persist import Flusher
from ftmem._state.plan import SnapshotPlan
from ftmem._shm.procs import pid_alive
from ftmem._shm import smp_client
from ftmem._shm.smp_client import running_smp



@dataclasses.dataclass
class Extra:
    name: str
    weights: torch.Tensor


# A user's own class in the state loads only once admitted, the way torch.load(weights_only=True) admits it.
torch.serialization.add_safe_globals([Extra])


def rich_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "fp32": w,
        "same_object_again": w,
        "transposed": torch.randn(16, 8, generator=g).t(),  # non-contiguous source
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, 3, generator=g).half(),
        "int64": torch.randint(-2**40, 2**40, (5,), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "uint8": torch.randint(0, 255, (11,), dtype=torch.uint8, generator=g),
        "complex": torch.randn(4, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "ordered": collections.OrderedDict(b=1, a=[torch.arange(6).view(2, 3), "text", (None, 2.5)]),
        "object": Extra("x", torch.ones(2)),
        "iteration": seed,
    }


def assert_same_state(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert got.requires_grad == want.requires_grad
        assert torch.equal(got.detach().view(-1).view(torch.uint8), want.detach().contiguous().view(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_state(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_state(a, b)
    elif dataclasses.is_dataclass(want):
        assert_same_state(dataclasses.asdict(got), dataclasses.asdict(want))
    else:
        assert got == want


def test_restore_is_bitwise_with_structure_dtypes_and_parameters_kept(shm_dir):
    engine = make_engine(shm_dir)
    state = rich_state(1)
    engine.save(state, 1).wait_protected()
    restored = engine.restore()
    assert restored.version == 1
    assert_same_state(restored.state, state)
    assert restored.state["same_object_again"] is restored.state["fp32"]
    assert not any(t.data_ptr() == s.data_ptr() for t, s in [(restored.state["fp32"], state["fp32"])])
    engine.close(job_finished=True)


def test_a_restore_writes_into_the_tensors_the_framework_names_where_they_fit(shm_dir):
    """``restore(into=...)``: the saved tensors land in the framework's own tensors where
    those fit (dtype, shape, kind, contiguous, overlapping no other), and are handed back as
    those objects; the rest are restored into fresh memory, and a misfit is left untouched."""
    engine = make_engine(shm_dir)
    state = rich_state(2)
    engine.save(state, 1).wait_protected()
    fits, frozen = torch.zeros(64, 32), torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    flat = torch.zeros(12, dtype=torch.int64)  # two windows of one buffer, overlapping
    misfits = {"bf16": torch.zeros(33), "transposed": torch.zeros(16, 8).t(), "param": torch.zeros(3),
               "fp16": torch.zeros(3, 7, dtype=torch.float16)}
    shown = []

    def into(saved):
        shown.append(saved)
        return {"fp32": fits, "frozen": frozen, "ordered": {"a": [flat[:6].view(2, 3), None, None]},
                "int64": flat[4:9], "absent": torch.zeros(1), **misfits}

    restored = engine.restore(into=into)
    assert_same_state(restored.state, state)
    assert isinstance(shown[0]["fp32"], TensorPlace) and shown[0]["iteration"] == 2
    got = restored.state
    assert got["fp32"] is fits and got["same_object_again"] is fits and got["frozen"] is frozen
    # The window met first in the state is used; the one overlapping it is not.
    assert got["int64"].data_ptr() == flat[4:9].data_ptr() and torch.equal(flat[4:9], state["int64"])
    assert got["ordered"]["a"][0].data_ptr() != flat.data_ptr()
    assert not flat[:4].any() and not flat[9:].any()
    for key, misfit in misfits.items():
        assert got[key] is not misfit and not misfit.any(), key
    engine.close(job_finished=True)


def test_slots_keep_three_versions_and_reuse_the_buffers(shm_dir):
    engine = make_engine(shm_dir)
    state = rich_state(0)
    for version in (1, 2, 3):
        engine.save(state, version).wait_protected()
    slots = [engine.store.slot_path(s) for s in (0, 1, 2)]
    first = [(os.stat(p).st_ino, os.stat(p).st_size) for p in slots]
    mapped = [engine.memory._maps[("slot", s)][0] for s in (0, 1, 2)]
    for version in range(4, 8):
        state["fp32"].add_(1)
        engine.save(state, version).wait_protected()
    assert engine.versions() == [5, 6, 7]
    assert [(os.stat(p).st_ino, os.stat(p).st_size) for p in slots] == first  # no new allocation
    assert [engine.memory._maps[("slot", s)][0] for s in (0, 1, 2)] == mapped  # the same mappings, reused
    assert torch.equal(engine.restore().state["fp32"], state["fp32"])
    engine.close(job_finished=True)


def test_source_may_change_once_reusable_without_touching_the_snapshot(shm_dir):
    engine = make_engine(shm_dir)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    expected = state["w"].clone()
    handle = engine.save(state, 1)
    handle.wait_reusable()
    state["w"].mul_(-1)  # what the optimizer step does next
    handle.wait_protected()
    assert torch.equal(engine.restore().state["w"], expected)
    engine.close(job_finished=True)


def test_a_plan_is_reused_only_while_every_tensor_keeps_its_dtype_shape_and_kind(shm_dir, monkeypatch):
    """The engine reuses a save's plan (and the copy's slot windows) for the next save of the
    same shapes; any change of a tensor's dtype, shape (in place too), kind or requires_grad, or a
    state that outgrows its slot (a new mapping), is planned anew: each save restores bitwise."""
    engine = make_engine(shm_dir)
    w = torch.arange(24, dtype=torch.float32)
    p = torch.nn.Parameter(torch.ones(4))
    changes = [
        lambda: {"w": w, "p": p},
        lambda: {"w": w * 2, "p": p},  # new tensors, same plan
        lambda: {"w": w.view(4, 6), "p": p},  # same bytes, another shape
        lambda: {"w": w.view(torch.int32), "p": p},  # same bytes, another dtype
        lambda: {"w": w, "p": p.detach()},  # a Parameter becomes a plain tensor
        lambda: {"w": w.requires_grad_(True), "p": p},
        lambda: {"w": w.detach().resize_(6), "p": p},  # changed in place, by the same object
        lambda: {"w": torch.arange(1 << 20, dtype=torch.float32), "p": p},  # outgrows the slot: a new mapping
        lambda: {"w": torch.arange(1 << 20, dtype=torch.float32) + 1, "p": p},
    ]
    planned = []  # the versions whose save made a plan
    make_plan = SnapshotPlan.for_tensors.__func__
    monkeypatch.setattr(SnapshotPlan, "for_tensors",
                        classmethod(lambda cls, *a: planned.append(version) or make_plan(cls, *a)))
    for version, make in enumerate(changes, start=1):
        state = make()
        engine.save(state, version).wait_protected()
        assert_same_state(engine.restore(drop_newer=False).state, state)
    assert planned == [1, 3, 4, 5, 6, 7, 8]  # not for 2 and 9, where nothing changed
    engine.close(job_finished=True)


class _CountingMode(TorchFunctionMode):
    """A torch-function mode as a training may have on (a device context, a shim), counting
    the calls that pass through it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_the_training_has_on_sees_none_of_the_save_s_or_the_restore_s_tensor_work(shm_dir):
    """Under a mode, every tensor attribute a save call reads would be a Python call through
    it (five times the call at thousands of tensors), and a mode that places new tensors (a
    device context) would place the restore's: the save call and the restore's copy run with
    the handling off. The mode stays on for the training, and what was saved restores bitwise."""
    engine = make_engine(shm_dir)
    state = rich_state(3)
    forward_wrote = {id(state["int64"])}
    mode = _CountingMode()
    with mode:
        handle = engine.save(state, 1, written_in_forward=lambda t: id(t) in forward_wrote)
        assert mode.calls == 0
        torch.ones(2).add_(1)  # the training's own calls still go through its mode
        assert mode.calls == 2
        handle.wait_protected()
        chosen, into = engine.choose(), {"fp32": torch.zeros(64, 32)}
        before = mode.calls
        restored = engine.read(chosen, into=into)
        assert mode.calls == before
    assert_same_state(restored.state, state)
    engine.close(job_finished=True)


def test_the_garbage_collector_is_deferred_only_inside_the_call_and_its_objects_are_gone_before_it_is_back():
    import gc
    import weakref

    from ftmem.adapter import with_collection_deferred

    def failed_save():
        assert not gc.isenabled()
        raise RuntimeError("a failed save")

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with_collection_deferred(failed_save)
    assert gc.isenabled()

    # A save call's own objects die as it returns, before the collector is on again: else the
    # first allocation after would have a collection scan them all.
    class Built:
        pass

    died_with_collector_on = []

    def save_call() -> int:
        built = Built()
        weakref.finalize(built, lambda: died_with_collector_on.append(gc.isenabled()))
        return 7

    assert with_collection_deferred(save_call) == 7
    assert died_with_collector_on == [False]

    gc.disable()  # as under Megatron-LM's --manual-gc: the call leaves it off
    try:
        assert with_collection_deferred(lambda: gc.isenabled()) is False
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.fault("every rank SIGKILLed", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 11 in the restarted process")
def test_a_restarted_process_finds_its_versions(shm_dir):
    job = job_id()
    writer = subprocess.run(
        [sys.executable, "-c", f"""
import torch
from ftmem import SnapshotEngine
e = SnapshotEngine({{"shm_dir": {shm_dir!r}, "job_id": {job!r}, "ranks_per_node": 1}}, rank=0, world_size=1)
for v in (10, 11):
    e.save({{"w": torch.full((100,), float(v))}}, v).wait_protected()
import os, signal; os.kill(os.getpid(), signal.SIGKILL)
"""], timeout=120)
    assert writer.returncode == -signal.SIGKILL
    engine = make_engine(shm_dir, job)
    restored = engine.restore()
    assert restored.version == 11 and torch.equal(restored.state["w"], torch.full((100,), 11.0))
    engine.close(job_finished=True)


def test_nothing_held_restores_none(shm_dir):
    engine = make_engine(shm_dir)
    assert engine.restore() is None
    engine.close(job_finished=True)


def test_saving_an_older_version_drops_the_abandoned_newer_ones(shm_dir):
    engine = make_engine(shm_dir)
    for v in (5, 6):
        engine.save({"v": torch.tensor(v)}, v).wait_protected()
    engine.save({"v": torch.tensor(3)}, 3).wait_protected()  # e.g. resumed from an older disk checkpoint
    assert engine.versions() == [3]
    engine.close(job_finished=True)



@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1, the damaged version 2 dropped, never returned")
def test_a_flipped_byte_is_detected_and_never_returned(shm_dir, ftmem_log):
    engine = make_engine(shm_dir)
    engine.save({"w": torch.zeros(4096)}, 1).wait_protected()
    engine.save({"w": torch.ones(4096)}, 2).wait_protected()
    slot_of_2 = engine.store.committed()[2]
    flip_byte(engine.store.slot_path(slot_of_2), 1000)
    restored = engine.restore()
    assert restored.version == 1 and torch.equal(restored.state["w"], torch.zeros(4096))
    assert "version 2" in ftmem_log.text() and "does not match its checksum" in ftmem_log.text()
    assert engine.versions() == [1]  # the corrupted version is dropped as lost
    engine.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1; version 2, asked for by name, refused with the "
                          "reason")
def test_a_corrupted_commit_marker_is_detected(shm_dir):
    engine = make_engine(shm_dir)
    for v in (1, 2):
        engine.save({"w": torch.full((10,), float(v))}, v).wait_protected()
    flip_byte(engine.store.commit_path(2, engine.store.committed()[2]), 20)
    with pytest.raises(NoRecoverableVersion, match="version 2: .* lacks node"):
        engine.restore(version=2)
    assert engine.restore().version == 1
    engine.close(job_finished=True)


@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="refuses with a reason: verify raises CorruptShard, the checksum mismatch named")
def test_verify_raises_on_a_mismatch(shm_dir):
    engine = make_engine(shm_dir)
    engine.save({"w": torch.zeros(100)}, 7).wait_protected()
    flip_byte(engine.store.slot_path(engine.store.committed()[7]), 3)
    with pytest.raises(CorruptShard, match="does not match its checksum"):
        integrity.verify(engine.store, 7)
    engine.close(job_finished=True)


@pytest.fixture
def small_tmpfs():
    """A real 8 MiB tmpfs, like a container's small /dev/shm."""
    path = tempfile.mkdtemp(prefix="ftmem-small-shm-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        from ftmem._shm import jobs
        for job in jobs.list_jobs(path):
            jobs.clean(path, job)
        # An SMP that just exited can keep the mount busy for a moment: retry, bounded.
        for _ in range(50):
            if subprocess.run(["umount", path], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        os.rmdir(path)  # fails if the mount is still there


@pytest.mark.fault("/dev/shm too small", phase="startup", framework="engine (toy trainer)",
                   expect="refuses with a reason: the first save raises ShmBudgetError with the MiB needed and free; "
                          "the engine stays usable")
def test_too_small_shared_memory_fails_at_the_first_save_with_the_numbers(small_tmpfs):
    engine = make_engine(small_tmpfs)
    state = {"w": torch.zeros(4 << 20)}  # 16 MiB; three versions need 48 MiB (one node: no parity)
    with pytest.raises(ShmBudgetError) as err:
        engine.save(state, 1)
    message = str(err.value)
    assert "needs 48.0 MiB" in message and "8.0 MiB free" in message and "shm_dir" in message
    assert '"slots": 2' in message
    assert engine.versions() == [] and not any(".slot" in f for f in os.listdir(engine.identity.node_dir))
    small = {"w": torch.zeros(1 << 18)}  # 1 MiB fits: the engine is still usable
    engine.save(small, 1).wait_protected()
    assert engine.restore().version == 1
    engine.close(job_finished=True)


@pytest.mark.fault("SMP SIGKILLed", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: the next request starts a new SMP, and no version is lost")
@pytest.mark.parametrize("reaped_meanwhile", [False, True])
def test_a_killed_smp_is_restarted_transparently_and_loses_no_version(reaped_meanwhile, shm_dir, ftmem_log):
    """``reaped_meanwhile``: another thread of the rank is polling the dead SMP when the save
    finds it gone (CI met that race: the warning said the SMP was none of this process's)."""
    engine = make_engine(shm_dir)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.full((1000,), 1.0)}, 1).wait_protected()
    first = running_smp(node_dir)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    if reaped_meanwhile:  # the lock a poll holds while it waits for the status, held by another thread
        polling = next(p for p in smp_client._spawned if p.pid == first)._waitpid_lock
        polling.acquire()
        threading.Timer(0.5, polling.release).start()
    # A bigger state needs bigger slots: the request for them starts a new SMP.
    engine.save({"w": torch.full((100_000,), 2.0)}, 2).wait_protected()
    second = running_smp(node_dir)
    assert second is not None and second != first
    assert (f"the SMP of {node_dir} (pid {first}) is gone (killed by SIGKILL, as the kernel's OOM killer kills: see "
            f"`dmesg` and the node's memory limit) during 'alloc': starting another, which finds every snapshot in "
            f"shared memory") in ftmem_log.text(), ftmem_log.text()
    assert engine.versions() == [1, 2]
    assert engine.restore(version=1).state["w"][0] == 1.0
    engine.close(job_finished=True)


def test_close_after_a_finished_job_frees_memory_and_stops_the_smp(shm_dir):
    engine = make_engine(shm_dir)
    engine.save({"w": torch.zeros(10)}, 1).wait_protected()
    node_dir, pid = engine.identity.node_dir, running_smp(engine.identity.node_dir)
    engine.close(job_finished=True)
    deadline = time.monotonic() + 10
    while (pid_alive(pid) or os.path.exists(node_dir)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(pid) and not os.path.exists(node_dir)


def test_close_without_finishing_keeps_versions_for_a_restart(shm_dir):
    job = job_id()
    engine = make_engine(shm_dir, job)
    engine.save({"w": torch.zeros(10)}, 4).wait_protected()
    engine.close()
    again = make_engine(shm_dir, job)
    assert again.restore().version == 4
    again.close(job_finished=True)


def test_status_json_and_clean_from_the_shell(shm_dir):
    job = job_id()
    engine = make_engine(shm_dir, job)
    for v in (1, 2):
        engine.save({"w": torch.zeros(10)}, v).wait_protected()
    engine.close()
    out = run_cli("status", "--json", "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    (node,) = report["jobs"][0]["nodes"]
    assert report["jobs"][0]["job"] == job
    assert node["node"] == 0 and node["versions"] == [1, 2] and node["protected"] is None
    assert pid_alive(node["smp_pid"]) and os.path.isdir(node["path"])
    human = run_cli("status", "--shm-dir", shm_dir)
    assert f"job {job}" in human.stdout and "versions [1, 2]" in human.stdout

    out = run_cli("clean", "--job", job, "--shm-dir", shm_dir)
    assert out.returncode == 0, out.stderr
    assert not pid_alive(node["smp_pid"]) and not os.path.exists(node["path"])
    assert json.loads(run_cli("status", "--json", "--shm-dir", shm_dir).stdout) == {"jobs": []}


def test_clean_without_a_job_says_how_to_name_one(shm_dir):
    env_job = os.environ.pop("FTMEM_JOB_ID", None)
    try:
        out = run_cli("clean", "--shm-dir", shm_dir)
    finally:
        if env_job is not None:
            os.environ["FTMEM_JOB_ID"] = env_job
    assert out.returncode == 2 and "--job J" in out.stderr


def test_unsupported_tensors_are_refused_before_anything_is_written(shm_dir):
    engine = make_engine(shm_dir)
    with pytest.raises(UnsupportedTensor, match="dense strided"):
        engine.save({"s": torch.eye(3).to_sparse()}, 1)
    assert engine.versions() == []
    engine.close(job_finished=True)


def test_a_version_saved_under_another_layout_is_refused_with_the_mismatch(shm_dir):
    job = job_id()
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job}, rank=0, world_size=1,
                            layout=ParallelLayout(dp_groups=((0,),), zero_stage=1))
    engine.save({"w": torch.zeros(3)}, 1).wait_protected()
    engine.close()
    other = SnapshotEngine({"shm_dir": shm_dir, "job_id": job}, rank=0, world_size=1,
                           layout=ParallelLayout(dp_groups=((0,),), zero_stage=2))
    with pytest.raises(LayoutMismatch, match="zero_stage 1 -> 2"):
        other.restore()
    other.close(job_finished=True)


def test_a_layout_that_does_not_fit_the_world_is_refused(shm_dir):
    with pytest.raises(ConfigError, match="does not make the world size 1"):
        SnapshotEngine({"shm_dir": shm_dir, "job_id": job_id()}, rank=0, world_size=1,
                       layout=ParallelLayout(dp_groups=((0,),), tp_size=2))


def test_a_tensor_and_its_detached_alias_are_stored_once():
    """A state that carries the same tensors twice (a sharded form and state_dict()'s
    detached views) costs their bytes once; different views stay apart."""
    from ftmem._state.serialize import join_state, split_state

    weight = torch.nn.Parameter(torch.randn(4, 3))
    state = {"sharded": {"w": weight}, "state_dict": {"w": weight.detach()}, "row": weight[1], "empty": [
        torch.empty(0), torch.empty(0)]}
    skeleton, tensors = split_state(state)[:2]
    assert [t.shape for t in tensors] == [(4, 3), (3,), (0,), (0,)]
    back = join_state(skeleton, [t.detach().clone() for t in tensors])
    assert back["state_dict"]["w"] is back["sharded"]["w"] and back["row"] is not back["sharded"]["w"]
    assert torch.equal(back["row"], weight[1].detach()) and back["empty"][0] is not back["empty"][1]

    grid = torch.arange(32.0)  # two views from the same first element, of the same shape, strided apart
    rows, columns = grid.as_strided((4, 4), (8, 1)), grid.as_strided((4, 4), (1, 8))
    skeleton, tensors = split_state({"rows": rows, "columns": columns, "again": {"rows": rows.view(4, 4)}})[:2]
    assert len(tensors) == 2
    back = join_state(skeleton, [t.clone() for t in tensors])
    assert back["again"]["rows"] is back["rows"] and torch.equal(back["rows"], rows)
    assert torch.equal(back["columns"], columns)


class GatedFormat(FrameworkFormat):
    """A checkpoint format (one file per version) whose writes wait for the test to open
    a gate: a disk slower than the saves."""

    name = "gated-test-format"

    def __init__(self):
        self.gate = threading.Event()

    def checkpoint_name(self, version, state):
        return f"v{version}"

    def write_rank(self, state, directory, rank, first_replica, wrote):
        assert self.gate.wait(60)
        torch.save(state["w"], os.path.join(directory, "w.pt"))
        wrote(os.path.join(directory, "w.pt"))

    def publish(self, root, name):
        with open(os.path.join(root, "newest"), "w") as f:
            f.write(name)


@pytest.mark.fault("persistent tier's disk very slow", phase="during a flush", framework="engine (toy trainer)",
                   expect="goes on: a flush due while one runs is skipped and says so, none queued")
def test_flushes_are_skipped_not_queued_while_the_disk_is_slower_than_the_saves(shm_dir, tmp_path, ftmem_log):
    engine = make_engine(shm_dir)
    layout = GatedFormat()
    engine.persist_with(Flusher(str(tmp_path), 1, None, layout, rank=0, first_replica=True, world_size=1,
                                interface=None))
    state = {"w": torch.zeros(1000)}
    written = {}
    for version in range(1, 6):  # version 1's flush holds the gate; 5 committed means 4 was handed over
        state["w"].fill_(version)
        written[version] = state["w"].clone()
        engine.save(state, version).wait_protected()
    layout.gate.set()
    engine.wait_flushed()
    out = ftmem_log.text()
    for skipped in (2, 3, 4):
        assert (f"version {skipped} not flushed: the previous flush is still running (the disk is slower "
                f"than persist.interval saves)") in out
    done = flushed(str(tmp_path))
    assert done[0] == {"name": "v1", "version": 1} and {c["version"] for c in done} <= {1, 5}
    assert torch.equal(torch.load(tmp_path / "v1" / "w.pt"), written[1])
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    engine.close(job_finished=True)


def test_export_names_what_it_cannot_do(shm_dir, tmp_path):
    """`ftmem export` of an unknown job, of a version not held, and of a snapshot no
    adapter saved: each refused with the reason, nothing written."""
    job = job_id()
    engine = make_engine(shm_dir, job)
    engine.save({"w": torch.ones(10)}, 1).wait_protected()
    out = tmp_path / "out"
    refused = run_cli("export", "--job", "no-such-job", "--shm-dir", shm_dir, "--out", str(out))
    assert refused.returncode == 2 and f"no job 'no-such-job' in {shm_dir} (jobs there: {job})" in refused.stderr
    refused = run_cli("export", "--job", job, "--version", "7", "--shm-dir", shm_dir, "--out", str(out))
    assert refused.returncode == 2 and "does not hold version 7 on every rank (rank 0: [1])" in refused.stderr
    assert "versions held by all: [1]" in refused.stderr
    refused = run_cli("export", "--job", job, "--shm-dir", shm_dir, "--out", str(out))
    assert refused.returncode == 2 and "name no framework format to export to" in refused.stderr
    assert not out.exists()
    engine.close(job_finished=True)
