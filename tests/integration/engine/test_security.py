"""Nothing runs from shared memory, nothing there is open to other users (issue 15,
findings 1, 2 and 7). Things are planted as another user where that matters: a directory
another user owns and a 0777 directory with another user's files in it need root, to
plant them as ``nobody`` (a forked child that drops to its uid), and skip without it.
So does another user's reach for the SMP's socket. The rest run as any user: a crafted
marker, a crafted SMP request, a symlinked node.json, connections that never prove the
key. In every case no planted code runs, nothing outside the root is written, and
the error says what is wrong. Then: the modes a save leaves under umask 002, and SMPs
that exit once their job is gone."""
import dataclasses
import json
import os
import pickle
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import pytest
import torch

from harness.common import job_id, make_engine, run_cli
from ftmem import ConfigError, SnapshotEngine, UnadmittedType, UnsafeSharedMemory
from ftmem._shm import jobs
from ftmem._state.checksum import with_checksum
from ftmem._common.identity import root_dir
from ftmem._shm.procs import pid_alive
from ftmem._shm.slots import CommitRecord, decode_record, encode_record
from ftmem._shm.smp import HANDSHAKE_S, MAX_HANDSHAKES, socket_path
from ftmem._shm.smp_client import bound_waits, running_smp

NOBODY = pwd.getpwnam("nobody")
BOUND_S = 30  # any wait here longer than this is a hang

AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="plants files owned by another user: needs root")


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY.pw_gid)
    os.setuid(NOBODY.pw_uid)


def _wait_child(pid: int, timeout: float = BOUND_S) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the child {pid} acting as nobody hung")


def _in_a_child(action, drop) -> None:
    """Run ``action()`` in a forked child, after ``drop()``; fail if it raised."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        try:
            drop()
            action()
            os._exit(0)
        except BaseException as e:
            os.write(2, f"as nobody: {e!r}\n".encode())
            os._exit(1)
    assert _wait_child(pid) == 0


def as_nobody(action) -> None:
    """Run ``action()`` in a forked child as ``nobody`` (needs root); fail if it raised."""
    _in_a_child(action, _drop_to_nobody)



def shared_like_dev_shm(shm_dir) -> None:
    """Make the test's shared-memory directory what /dev/shm is: anyone may create in it."""
    os.chmod(shm_dir, 0o1777)


class Plant:
    """A pickle whose loading creates ``path``: it must never be loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def live_payload(path, scratch) -> bytes:
    """The crafted pickle, shown to be live: plain pickle.loads of it does create a file."""
    probe = os.path.join(scratch, "probe")
    pickle.loads(pickle.dumps(Plant(probe))).close()
    assert os.path.exists(probe)
    return pickle.dumps(Plant(path))


# -- directories another user planted ------------------------------------------------------------------
@needs_root
def test_a_root_planted_by_another_user_is_refused_with_owner_and_remedy(shm_dir):
    shared_like_dev_shm(shm_dir)
    root = root_dir(shm_dir)
    as_nobody(lambda: os.mkdir(root, 0o700))  # the path is predictable: nobody got there first
    try:
        with pytest.raises(UnsafeSharedMemory) as e:
            make_engine(shm_dir)
        message = str(e.value)
        assert root in message and f"uid {NOBODY.pw_uid} (nobody)" in message and "rm -r" in message, message
        out = run_cli("status", "--shm-dir", shm_dir)  # the commands refuse it alike, in one line
        assert out.returncode != 0 and "Traceback" not in out.stderr and root in out.stderr, out.stderr
        assert os.listdir(root) == []  # nothing of ours went into it
    finally:
        shutil.rmtree(root)


@needs_root
def test_a_world_writable_directory_is_refused_and_nothing_planted_in_it_runs(shm_dir, tmp_path):
    shared_like_dev_shm(shm_dir)
    job = job_id()
    root = root_dir(shm_dir)
    os.mkdir(root)
    os.chmod(root, 0o777)  # ours, but anyone may write in it
    evidence = tmp_path / "ran"
    payload = with_checksum(live_payload(str(evidence), str(tmp_path)))

    def plant():
        node = os.path.join(root, job, "node0")
        os.makedirs(node)
        with open(os.path.join(node, "rank00000.v000000000001.s0.commit"), "wb") as f:
            f.write(payload)
        with open(os.path.join(node, "smp.key"), "wb") as f:
            f.write(b"k" * 32)  # a key nobody knows

    as_nobody(plant)
    with pytest.raises(UnsafeSharedMemory) as e:
        make_engine(shm_dir, job)
    assert f"{root} has mode 0777: other users may write in it" in str(e.value), str(e.value)
    assert not evidence.exists()
    os.chmod(root, 0o700)  # its owner fixed the root; the job directory inside is nobody's
    with pytest.raises(UnsafeSharedMemory, match=f"{os.path.join(root, job)} belongs to uid {NOBODY.pw_uid}"):
        make_engine(shm_dir, job)
    assert not evidence.exists()
    shutil.rmtree(os.path.join(root, job))


# -- markers: JSON, never a pickle -----------------------------------------------------------------
def test_a_crafted_pickled_marker_runs_nothing_and_reads_as_a_damaged_version(shm_dir, tmp_path, ftmem_log):
    evidence = tmp_path / "ran"
    engine = make_engine(shm_dir)
    engine.save({"w": torch.zeros(16)}, 1).wait_protected()
    engine.save({"w": torch.ones(16)}, 2).wait_protected()
    marker = engine.store.commit_path(2, engine.store.committed()[2])
    with open(marker, "rb") as f:  # what ftmem writes: a checksum, then JSON of the record
        assert decode_record(CommitRecord, f.read()[16:]).version == 2
    with open(marker, "wb") as f:  # intact framing, a pickle inside: only the checksum matches
        f.write(with_checksum(live_payload(str(evidence), str(tmp_path))))
    restored = engine.restore()
    assert restored.version == 1 and torch.equal(restored.state["w"], torch.zeros(16))
    assert not evidence.exists()
    assert f"rank 0 version 2: commit marker {marker} is unreadable (not an ftmem record" in ftmem_log.text()
    engine.close(job_finished=True)


def test_a_crafted_skeleton_in_a_valid_marker_is_refused_by_name(shm_dir, tmp_path):
    evidence = tmp_path / "ran"
    engine = make_engine(shm_dir)
    engine.save({"w": torch.zeros(16)}, 1).wait_protected()
    store = engine.store
    record = store.read_commit(1)
    forged = dataclasses.replace(record, skeleton=live_payload(str(evidence), str(tmp_path)))
    with open(store.commit_path(1, record.slot), "wb") as f:
        f.write(with_checksum(encode_record(forged)))
    with pytest.raises(UnadmittedType) as e:
        engine.restore()
    assert "names io.open, which ftmem does not load" in str(e.value) and "add_safe_globals" in str(e.value)
    assert not evidence.exists()
    engine.close(job_finished=True)


@dataclasses.dataclass
class Note:
    text: str


def test_a_save_learns_of_an_unadmitted_type_at_once_and_add_safe_globals_admits_it(shm_dir):
    engine = make_engine(shm_dir)
    with pytest.raises(UnadmittedType, match="names test_security.Note, which ftmem does not load"):
        engine.save({"w": torch.zeros(4), "note": Note("x")}, 1)
    assert engine.versions() == []
    with torch.serialization.safe_globals([Note]):
        engine.save({"w": torch.zeros(4), "note": Note("x")}, 1).wait_protected()
        assert engine.restore().state["note"] == Note("x")
    # A save checks each skeleton whose globals, or the admitted ones, differ from the last it checked.
    with pytest.raises(UnadmittedType, match="names test_security.Note"):
        engine.save({"w": torch.zeros(4), "note": Note("x")}, 2)
    engine.save({"w": torch.zeros(4), "dtype": torch.float32}, 2).wait_protected()
    for named in (print, Note):  # a function, a class: new globals beside ones checked before
        with pytest.raises(UnadmittedType, match=f"names {named.__module__}.{named.__qualname__}"):
            engine.save({"w": torch.zeros(4), "dtype": torch.float32, "named": named}, 3)
    engine.close(job_finished=True)


def test_export_admits_a_type_of_the_job_s_own_when_named_with_admit(shm_dir, tmp_path, monkeypatch):
    """The job admitted its type in its own processes; ``ftmem export`` runs in another,
    which refuses the type by name until ``--admit`` names it there too."""
    (tmp_path / "mytypes.py").write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass Note:\n    text: str\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mytypes
    job = job_id()
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1,
                            format="deepspeed")
    model_states = {"module": {"w": torch.arange(4.0)}, "note": mytypes.Note("x")}
    with torch.serialization.safe_globals([mytypes.Note]):
        engine.save({"files": {"global_step1/mp_rank_00_model_states.pt": model_states}, "tag": "global_step1",
                     "rng": {}}, 1).wait_protected()
    engine.close()  # not finished: the version stays in memory
    out = tmp_path / "out"
    export = [sys.executable, "-m", "ftmem.cli", "export", "--job", job, "--shm-dir", shm_dir, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + os.environ.get("PYTHONPATH", "").split(
        os.pathsep)).rstrip(os.pathsep))

    def run(*admit):
        return subprocess.run(export + list(admit), capture_output=True, text=True, timeout=120, env=env)

    refused = run()
    assert refused.returncode == 2 and "names mytypes.Note" in refused.stderr, refused.stderr
    assert "ftmem export --admit mytypes.Note" in refused.stderr and not (out / "global_step1").exists()
    unknown = run("--admit", "mytypes.Nope")
    assert unknown.returncode == 2 and "cannot import 'mytypes.Nope'" in unknown.stderr, unknown.stderr
    done = run("--admit", "mytypes.Note")
    assert done.returncode == 0, done.stderr
    loaded = torch.load(out / "global_step1" / "mp_rank_00_model_states.pt", weights_only=False)
    assert loaded["note"] == mytypes.Note("x") and torch.equal(loaded["module"]["w"], torch.arange(4.0))
    jobs.clean(shm_dir, job)


# -- the SMP's channel -----------------------------------------------------------------------------
def _raw_connection(node_dir: str) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound_waits(sock, 10)
    with socket_path(node_dir) as path:
        sock.connect(path)
    return Connection(sock.detach())


def test_a_crafted_smp_request_runs_nothing_in_the_smp(shm_dir, tmp_path):
    evidence = tmp_path / "ran"
    engine = make_engine(shm_dir)
    node_dir = engine.identity.node_dir
    with open(os.path.join(node_dir, "smp.key"), "rb") as f:
        key = f.read()
    payload = live_payload(str(evidence), str(tmp_path))

    def unauthenticated_pickle():  # a client without the key: refused at the handshake
        conn = _raw_connection(node_dir)
        conn.send_bytes(payload)
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass

    unauthenticated_pickle()
    # Even a client holding the key gets no pickle loaded: the SMP reads JSON only.
    conn = _raw_connection(node_dir)
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send_bytes(payload)
    reply = json.loads(conn.recv_bytes())
    assert reply[0] == "err" and "refused a message that is not JSON" in reply[2], reply
    conn.close()
    conn = _raw_connection(node_dir)  # a well-formed request out of range is refused too
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send_bytes(json.dumps(["alloc", 7, 1 << 40, 0, 3, 0]).encode())
    reply = json.loads(conn.recv_bytes())
    assert reply[0] == "err" and "rank 7 is not one of this node's ranks [0]" in reply[2], reply
    conn.close()
    assert not evidence.exists()
    assert running_smp(node_dir) is not None  # still serving the job
    engine.save({"w": torch.zeros(4)}, 1).wait_protected()
    engine.close(job_finished=True)


def test_a_symlinked_node_json_is_replaced_not_followed(shm_dir, tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    job = job_id()
    engine = make_engine(shm_dir, job)
    node_dir = engine.identity.node_dir
    engine.save({"w": torch.zeros(4)}, 1).wait_protected()
    engine.close()
    os.kill(running_smp(node_dir), signal.SIGKILL)  # the restart starts a new SMP and writes node.json
    node_json = os.path.join(node_dir, "node.json")
    os.unlink(node_json)
    os.symlink(target, node_json)
    again = make_engine(shm_dir, job)
    assert target.read_text() == "keep me"
    assert not os.path.islink(node_json) and json.loads(open(node_json).read()) == {"ranks": [0]}
    assert again.restore().version == 1
    again.close(job_finished=True)


def abstract_names_of(pid: int) -> list[str]:
    """The abstract-namespace names of the Unix sockets process ``pid`` holds (readable by every user)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [row[7] for row in rows if len(row) >= 8 and row[6] in inodes and row[7].startswith("@")]


@needs_root
def test_another_user_can_neither_reach_nor_take_the_smp_s_address_and_a_restart_recovers(shm_dir):
    """The SMP listened on an abstract socket name, which every user reads in /proc/net/unix:
    as nobody, 300 connections without the key grew root's SMP by 300 threads, and once the
    SMP had exited, nobody bound the name and root's restart failed. The socket is now a
    file in the 0700 node directory: as nobody, connecting is refused by the permissions,
    binding there too, and ftmem lists no abstract name to squat; the restart recovers."""
    job = job_id()
    engine = make_engine(shm_dir, job)
    engine.save({"w": torch.arange(4.0)}, 1).wait_protected()
    node_dir = engine.identity.node_dir
    smp = running_smp(node_dir)
    assert not abstract_names_of(smp)
    threads = len(os.listdir(f"/proc/{smp}/task"))

    def reach_and_squat():
        path = os.path.join(node_dir, "smp.sock")
        for _ in range(300):
            with pytest.raises(PermissionError):
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
        with pytest.raises(PermissionError):
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(os.path.join(node_dir, "other.sock"))

    as_nobody(reach_and_squat)
    assert len(os.listdir(f"/proc/{smp}/task")) <= threads
    engine.close()
    os.kill(smp, signal.SIGKILL)  # the restart starts a new SMP on the socket file the killed one left
    again = make_engine(shm_dir, job)
    assert torch.equal(again.restore().state["w"], torch.arange(4.0))
    again.close(job_finished=True)


def test_connections_that_do_not_prove_the_key_are_dropped_and_capped(shm_dir):
    """Connections (of the job's own user: no other can connect) that never answer the
    key's challenge are dropped after HANDSHAKE_S, and no more than MAX_HANDSHAKES are
    served at once: the SMP's threads stay bounded, and the job's ranks are still served."""
    engine = make_engine(shm_dir)
    node_dir = engine.identity.node_dir
    smp = running_smp(node_dir)
    silent = []
    for _ in range(MAX_HANDSHAKES + 100):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket_path(node_dir) as path:
            sock.connect(path)
        silent.append(sock)
    time.sleep(1)
    assert len(os.listdir(f"/proc/{smp}/task")) < MAX_HANDSHAKES + 20
    engine.save({"w": torch.zeros(4)}, 1).wait_protected()  # the rank's own connection is served
    for sock in silent[:5]:
        sock.settimeout(HANDSHAKE_S + BOUND_S)
        sock.recv(1 << 16)  # the SMP's challenge (dropped ones get nothing) ...
        assert sock.recv(1) == b""  # ... then the end of the connection, once HANDSHAKE_S passed
    for sock in silent:
        sock.close()
    engine.close(job_finished=True)


# -- modes -----------------------------------------------------------------------------------------
def test_a_save_under_umask_002_leaves_only_0700_directories_and_0600_files(shm_dir):
    old = os.umask(0o002)
    try:
        engine = make_engine(shm_dir)  # its SMP inherits the umask
        engine.save({"w": torch.zeros(1000)}, 1).wait_protected()
        engine.save({"w": torch.ones(1000)}, 2).wait_protected()
        engine.close()
    finally:
        os.umask(old)
    root = root_dir(shm_dir)
    modes = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            st = os.lstat(path)
            modes[os.path.relpath(path, root)] = (stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode))
    modes["."] = (True, stat.S_IMODE(os.lstat(root).st_mode))
    wrong = {p: oct(m) for p, (is_dir, m) in modes.items() if m != (0o700 if is_dir else 0o600)}
    assert not wrong, wrong
    assert any(p.endswith(".commit") for p in modes) and any(p.endswith("smp.log") for p in modes), sorted(modes)


# -- an SMP outlives only a job that may come back -------------------------------------------------------
RANK = textwrap.dedent("""
    import os, sys, torch
    from ftmem import SnapshotEngine
    engine = SnapshotEngine({"shm_dir": sys.argv[1], "job_id": sys.argv[2], "ranks_per_node": 1}, rank=0, world_size=1)
    if sys.argv[3] == "save":
        engine.save({"w": torch.ones(100)}, 1).wait_protected()
    os._exit(0)  # gone without a word, as a crash or a failed start leaves it
""")


def run_rank(shm_dir, job, what, grace):
    env = dict(os.environ, FTMEM_SMP_GRACE_S=str(grace))
    done = subprocess.run([sys.executable, "-c", RANK, shm_dir, job, what], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def wait_smp_gone(node_dir, pid, within):
    deadline = time.monotonic() + within
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), f"the SMP {pid} of {node_dir} still runs {within} s after its rank died"


@pytest.mark.parametrize("what", [
    pytest.param("save", id="save", marks=pytest.mark.fault(
        "rank exits abruptly (os._exit)", phase="between saves", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 1, kept once the orphaned SMP exits after its grace")),
    pytest.param("start only", id="start only", marks=pytest.mark.fault(
        "rank exits abruptly (os._exit)", phase="startup", framework="engine (toy trainer)",
        expect="goes on: the orphaned SMP exits after its grace, and a start that held nothing leaves no memory")),
])
def test_an_smp_whose_rank_is_gone_exits_after_the_grace_keeping_versions(shm_dir, what):
    job, grace = job_id(), 2
    run_rank(shm_dir, job, what, grace)
    [(_, node_dir)] = jobs.node_dirs(shm_dir, job)
    pid = running_smp(node_dir)
    assert pid is not None
    time.sleep(grace / 2)
    assert pid_alive(pid)  # within the grace a restart would find it
    wait_smp_gone(node_dir, pid, grace + 10)
    report = json.loads(run_cli("status", "--json", "--shm-dir", shm_dir).stdout)
    if what == "save":  # the version stays for a restart, which starts a new SMP
        [node] = report["jobs"][0]["nodes"]
        assert node["smp_pid"] is None and node["versions"] == [1], report
        assert "no SMP running" in run_cli("status", "--shm-dir", shm_dir).stdout
        again = make_engine(shm_dir, job)
        assert again.restore().version == 1
        again.close(job_finished=True)
    else:  # a start that failed holds nothing: its memory is freed too
        assert not os.path.exists(node_dir) and report["jobs"] == [], report


def test_a_bad_grace_is_refused_by_the_rank(shm_dir, monkeypatch):
    monkeypatch.setenv("FTMEM_SMP_GRACE_S", "soon")
    with pytest.raises(ConfigError, match="FTMEM_SMP_GRACE_S='soon': give the time an SMP waits"):
        make_engine(shm_dir)
