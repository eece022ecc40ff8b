"""The channel to the SMP over its life, against real processes and real shared memory:
an SMP that stops answering (SIGSTOP), ``ftmem clean`` under a running job, an SMP whose
key file vanished. Each ends in an FtmemError that names the cause, or in a transparent
recovery, within a bounded time: never a hang, a segfault or a bare OSError."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from harness.common import job_id, make_engine, run_cli
from harness.ranks import wait_until
from ftmem import FtmemError, SmpError
from ftmem._common import identity
from ftmem._shm.procs import pid_alive
from ftmem._shm.smp_client import running_smp

BOUND_S = 2  # FTMEM_SMP_TIMEOUT_S in these tests
HANG_S = 60  # a wait this long, where BOUND_S was promised, is a hang



def bounded(call, timeout=HANG_S):
    """``call()`` on a thread: its result, or its exception raised here; a hang fails the test."""
    box = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"still waiting after {timeout} s: a hang")
    if "error" in box:
        raise box["error"]
    return box.get("result")


@contextlib.contextmanager
def stopped(pid):
    """The process SIGSTOPped for the block; SIGKILLed after it, whatever happened."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.fixture
def short_bound(monkeypatch):
    monkeypatch.setenv("FTMEM_SMP_TIMEOUT_S", str(BOUND_S))


def assert_names_the_smp(error, node_dir, pid):
    message = str(error)
    assert "did not answer" in message and node_dir in message and f"pid {pid}" in message, message


# -- an SMP that stops answering --------------------------------------------------------------
@pytest.mark.fault("SMP stopped (SIGSTOP)", phase="during the copy", framework="engine (toy trainer)",
                   expect="goes on: the save that needs it raises SmpError naming it within FTMEM_SMP_TIMEOUT_S, then "
                          "a new SMP takes over")
def test_a_stopped_smp_fails_the_save_that_needs_it_by_name_and_a_new_one_takes_over(shm_dir, short_bound):
    engine = make_engine(shm_dir)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.zeros(1000)}, 1).wait_protected()
    pid = running_smp(node_dir)
    with stopped(pid):
        start = time.monotonic()
        with pytest.raises(SmpError) as err:  # a grown state needs the SMP to grow the slots
            bounded(lambda: engine.save({"w": torch.zeros(100_000)}, 2).wait_protected())
        assert time.monotonic() - start < HANG_S
        assert_names_the_smp(err.value, node_dir, pid)
    # Once that SMP is gone, the next request starts a new one, as before.
    engine.save({"w": torch.ones(100_000)}, 3).wait_protected()
    assert running_smp(node_dir) not in (None, pid)
    assert torch.equal(engine.restore().state["w"], torch.ones(100_000))
    engine.close(job_finished=True)


@pytest.mark.fault("SMP stopped (SIGSTOP)", phase="startup", framework="engine (toy trainer)",
                   expect="refuses with a reason: the restarted rank exits 1 with SmpUnresponsive naming the SMP")
def test_a_rank_started_against_a_stopped_smp_exits_with_the_reason(shm_dir, short_bound):
    job = job_id()
    engine = make_engine(shm_dir, job)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.zeros(10)}, 1).wait_protected()
    engine.close()  # the SMP stays, holding version 1 for a restart
    pid = running_smp(node_dir)
    restart = [sys.executable, "-c", f"""
from ftmem import SnapshotEngine
e = SnapshotEngine({{"shm_dir": {shm_dir!r}, "job_id": {job!r}, "ranks_per_node": 1}}, rank=0, world_size=1)
print("restored", e.restore().version)
"""]
    with stopped(pid):
        try:
            proc = subprocess.run(restart, capture_output=True, text=True, timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the restarted rank hung on its stopped SMP for {HANG_S} s")
    assert proc.returncode == 1 and "SmpUnresponsive" in proc.stderr, proc.stderr
    assert_names_the_smp(proc.stderr, node_dir, pid)


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time, traceback
    import torch, torch.distributed as dist
    from ftmem import SnapshotEngine
    from ftmem._common import testhooks

    rank, shm_dir, job, flags, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]

    def flag(name):
        open(os.path.join(flags, name), "w").close()

    def wait_for(name):
        while not os.path.exists(os.path.join(flags, name)):
            time.sleep(0.01)

    if mode.startswith("clean:"):
        def at(point, r, version):  # version 2 waits at the point named until `ftmem clean` ran
            if point == mode[len("clean:"):] and version == 2:
                flag(f"ready.{r}")
                wait_for("go")
        testhooks.at = at
    def run():
        dist.init_process_group("gloo", init_method="file://" + os.path.join(flags, "rendezvous"), rank=rank,
                                world_size=2)
        engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1, "ec": {"k": 1, "m": 1}},
                                rank=rank, world_size=2)
        engine.save({"w": torch.zeros(1 << 16)}, 1).wait_protected()
        if mode == "stop":
            flag(f"ready.{rank}")
            wait_for("go")
        # When rank 0's state grows, rank 1 grows its parity slot on its copy thread.
        size = (1 << 16) * (4 if mode == "stop" and rank == 0 else 1)
        engine.save({"w": torch.ones(size)}, 2).wait_protected()
        print("saved version 2", flush=True)

    # The rank fails on purpose, with its gloo groups alive and perhaps moves in flight: it
    # reports the error and leaves without finalizing, where gloo's threads can abort a
    # process (examples/process_end.py), so that its exit code is the error's.
    try:
        run()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
""")


class TwoNodeJob:
    """Two ranks on two virtual nodes with k=1, m=1, running RANK_SCRIPT as processes."""

    def __init__(self, shm_dir, tmp_path, mode, env=None):
        self.shm_dir, self.job, self.flags = shm_dir, job_id(), str(tmp_path)
        script = os.path.join(self.flags, "rank.py")
        with open(script, "w") as f:
            f.write(RANK_SCRIPT)
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
        self.procs = [subprocess.Popen([sys.executable, script, str(rank), shm_dir, self.job, self.flags, mode],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                      for rank in range(2)]

    def wait_ready(self):
        """Until both ranks reached their ``ready`` flag; fails at once if one exits."""
        deadline = time.monotonic() + HANG_S
        while not all(os.path.exists(os.path.join(self.flags, f"ready.{r}")) for r in range(2)):
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            assert not dead, f"rank(s) {dead} exited early: {self.procs[dead[0]].communicate()}"
            assert time.monotonic() < deadline, "the ranks never got ready"
            time.sleep(0.02)

    def go(self):
        open(os.path.join(self.flags, "go"), "w").close()

    def node_dir(self, node):
        return identity.node_dir(self.shm_dir, self.job, node)

    def finish(self, rank):
        """(exit code, stderr) of ``rank``; a hang fails the test."""
        try:
            _, err = self.procs[rank].communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} hung for {HANG_S} s")
        return self.procs[rank].returncode, err

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.mark.fault("SMP stopped (SIGSTOP)", phase="during the copy", framework="engine (toy trainer)",
                   expect="refuses with a reason: the rank's save fails with SmpUnresponsive naming the SMP, no hang")
def test_a_stopped_smp_met_on_the_copy_thread_fails_the_save_handle(shm_dir, tmp_path):
    job = TwoNodeJob(shm_dir, tmp_path, "stop", env={"FTMEM_SMP_TIMEOUT_S": str(BOUND_S)})
    try:
        job.wait_ready()
        pid = running_smp(job.node_dir(1))
        with stopped(pid):
            job.go()
            code, err = job.finish(1)
        assert code == 1 and "SmpUnresponsive" in err, err
        assert_names_the_smp(err, job.node_dir(1), pid)
    finally:
        job.kill()  # rank 0 waits for rank 1's parity, in vain


# -- `ftmem clean` under a running job ---------------------------------------------------------
@pytest.mark.fault("ftmem clean under a running job", phase="between saves", framework="engine (toy trainer)",
                   expect="refuses with a reason: the next save raises naming the removed memory, and nothing starts "
                          "again")
def test_ftmem_clean_of_a_running_job_fails_its_next_save_and_starts_nothing_again(shm_dir):
    job = job_id()
    engine = make_engine(shm_dir, job)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.zeros(1000)}, 1).wait_protected()
    assert run_cli("clean", "--job", job, "--shm-dir", shm_dir).returncode == 0
    with pytest.raises(FtmemError, match=r"shared memory in .*node0 was removed \(ftmem clean\?\).*[Rr]estart the job"):
        engine.save({"w": torch.ones(1000)}, 2).wait_protected()
    assert not os.path.exists(node_dir) and running_smp(node_dir) is None  # clean stays clean
    engine.close(job_finished=True)  # nothing is left to free: no error


@pytest.mark.parametrize("point", [
    pytest.param("mid_copy", id="mid_copy", marks=pytest.mark.fault(
        "ftmem clean under a running job", phase="during the copy", framework="engine (toy trainer)",
        expect="refuses with a reason: every rank exits 1 with SharedMemoryRemoved, no segfault nor bare OSError")),
    pytest.param("after_commit", id="after_commit", marks=pytest.mark.fault(
        "ftmem clean under a running job", phase="after the commit, before parity", framework="engine (toy trainer)",
        expect="refuses with a reason: every rank exits 1 with SharedMemoryRemoved, no segfault nor bare OSError")),
])
def test_ftmem_clean_under_a_save_in_flight_fails_the_job_clearly_without_a_segfault(shm_dir, tmp_path, point):
    """Both ranks are halfway through copying version 2, or have committed it and are about
    to encode its parity, when ``ftmem clean`` stops their SMPs and deletes their node
    directories (before the fix: SIGSEGV after the commit, FileNotFoundError mid-copy)."""
    job = TwoNodeJob(shm_dir, tmp_path, f"clean:{point}")
    try:
        job.wait_ready()
        out = run_cli("clean", "--job", job.job, "--shm-dir", shm_dir)
        assert out.returncode == 0, out.stderr
        job.go()
        for rank in range(2):
            code, err = job.finish(rank)
            assert code == 1 and "was removed (ftmem clean?)" in err, (code, err)
            assert "SharedMemoryRemoved" in err and "OSError" not in err and "FileNotFoundError" not in err, err
            assert not os.path.exists(job.node_dir(rank))
    finally:
        job.kill()


# -- a node directory that lost its SMP's key file -----------------------------------------------
@pytest.mark.fault("shared memory damaged", phase="between saves", framework="engine (toy trainer)",
                   expect="resumes bitwise from memory: version 1, the SMP restarted with a fresh key")
def test_a_vanished_key_file_gets_the_smp_restarted_with_a_fresh_key(shm_dir, ftmem_log):
    job = job_id()
    engine = make_engine(shm_dir, job)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.full((100,), 7.0)}, 1).wait_protected()
    engine.close()
    old = running_smp(node_dir)
    for name in ("smp.key", "node.json"):
        os.unlink(os.path.join(node_dir, name))
    again = make_engine(shm_dir, job)  # a restart: its SMP still runs, with a key nobody can read
    restored = again.restore()
    assert restored.version == 1 and torch.equal(restored.state["w"], torch.full((100,), 7.0))
    assert running_smp(node_dir) not in (None, old) and not pid_alive(old)
    assert all(os.path.exists(os.path.join(node_dir, name)) for name in ("smp.key", "node.json"))
    assert f"restarting it (pid {old})" in ftmem_log.text()
    again.close(job_finished=True)


# -- the protocol: a long request is not a stopped SMP ---------------------------------------------
def test_keepalives_carry_a_request_past_the_bound_and_silence_does_not(shm_dir, monkeypatch):
    import socket
    from multiprocessing.connection import Connection

    from ftmem._shm import smp, smp_client

    monkeypatch.setattr(smp, "KEEPALIVE_S", 0.05)
    manager = smp.SnapshotManager(shm_dir, [0])
    monkeypatch.setattr(manager, "_handle", lambda msg: time.sleep(1.0) or ("ok", "slow"))
    monkeypatch.setattr(smp, "SLOW_REQUESTS", ("alloc",))
    client_end, server_end = socket.socketpair()
    smp_client.bound_waits(client_end, 0.3)
    client, server = Connection(client_end.detach()), Connection(server_end.detach())
    threading.Thread(target=manager._serve_requests, args=(server,), daemon=True).start()
    assert smp_client.exchange(client, ("alloc", 0, 1, 0, 3, 0)) == ("ok", "slow")  # 1 s > the 0.3 s bound
    start = time.monotonic()
    with pytest.raises(BlockingIOError):  # quick requests get no keepalives: this one is silent too long
        smp_client.exchange(client, ("ping",))
    assert time.monotonic() - start < 0.9
    client.close()


# -- the end: every local rank says "finished" ----------------------------------------------------
def test_ranks_of_a_node_that_finish_at_once_all_get_their_answer(shm_dir, tmp_path, monkeypatch):
    """Two ranks of a node say "finished" at once, each on its own connection (a thread of
    the SMP each). Both threads could see both markers and answer "last": the first freed
    the node and exited before the other's answer went out, and that rank's clean end
    failed with SharedMemoryRemoved (seen under load in
    test_node_loss.py::test_two_ranks_per_node_lose_a_node). Here rank 0's thread is held
    between its marker and its count while rank 1 finishes: one answer says "last"."""
    from ftmem._shm.smp_client import SmpClient

    monkeypatch.setenv("FTMEM_TEST_HOOK", "smp_finished:hold:rank=0:version=-1")  # the SMP inherits it
    monkeypatch.setenv("FTMEM_TEST_HOOK_DIR", str(tmp_path))
    node_dir = identity.node_dir(shm_dir, job_id(), 0)
    clients = [SmpClient(node_dir, [0, 1]) for _ in range(2)]
    failures = []

    def finish(rank: int) -> None:
        try:
            clients[rank].finish(rank)
        except Exception as e:  # noqa: BLE001  (any failure of a clean end is the defect)
            failures.append(f"rank {rank}: {e!r}")

    for rank, client in enumerate(clients):
        client.request("hello", rank, os.getpid())
    first = threading.Thread(target=finish, args=(0,))
    first.start()
    wait_until(lambda: (tmp_path / "paused.rank0.v-1").exists(), 30, "rank 0's finish to be held in the SMP")
    second = threading.Thread(target=finish, args=(1,))
    second.start()
    second.join(1.0)  # rank 1 is answered now, or waits for rank 0's count: either way rank 0 goes on
    (tmp_path / "resume.rank0.v-1").touch()
    for t in (first, second):
        t.join(60)
    for client in clients:
        client.close()
    assert failures == []
    assert not os.path.exists(node_dir)  # the node's memory freed once both finished


def test_the_smp_serves_a_job_without_importing_torch(shm_dir):
    """The SMP imports the slots' files and its protocol, not the engine: a restart onto a new
    node waits for its start, which torch's import made 2 s and more on a loaded host."""
    engine = make_engine(shm_dir)
    state = {"w": torch.arange(1000.0)}
    engine.save(state, 1).wait_protected()
    engine.save(state, 2).wait_protected()  # a slot allocated, the versions held listed
    smp = running_smp(engine.identity.node_dir)
    with open(f"/proc/{smp}/maps") as f:
        libraries = {line.split()[-1] for line in f if ".so" in line}
    assert not [lib for lib in libraries if "torch" in os.path.basename(lib)], sorted(libraries)
    engine.close(job_finished=True)
