"""Children of a training process that runs ftmem: a fork copies ftmem's SIGTERM handler, its
signal wakeup socket and its exit hooks into the child, but the child is not the training
process and must never act for it. A child that gets SIGTERM ends as it would without ftmem
(a pool's terminate, a DataLoader worker killed, a subprocess stopped), and a child that exits
leaves the job's shared memory alone; the training process goes on saving either way.

Each case runs a script of its own in a session of its own, so that a child left running
(one that swallowed its SIGTERM) is killed with the session, and its output goes to a file,
so that such a child holding the output open cannot stall the test.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from ftmem._shm import jobs
from harness.common import job_id
from harness.ranks import REPO

TIMEOUT_S = 120  # a whole script, started on a loaded machine; each wait inside it is bounded at 60 s

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, re, signal, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    shm_dir, case, with_ftmem = sys.argv[1], sys.argv[2], sys.argv[3] == "with ftmem"
    fork = multiprocessing.get_context("fork")
    running = fork.Queue()  # made before any fork: each child puts its pid here once it runs

    def busy(_=None):
        running.put(os.getpid())
        time.sleep(60)  # busy until a signal ends it (or the test kills the session)

    def running_children(n):
        return [running.get(timeout=60) for _ in range(n)]

    def left_running(pids):
        left = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                left.append(pid)
            except ProcessLookupError:
                pass
        return left

    def pool_terminated():
        pool = fork.Pool(2)
        pool.map_async(busy, range(2))
        pids = running_children(2)
        pool.terminate()  # SIGTERM to each worker, then joins them: no bound of its own
        return f"the pool's workers left running: {left_running(pids)}"

    def with_pool_left():
        with fork.Pool(2) as pool:
            pool.map_async(busy, range(2))
            pids = running_children(2)
        return f"the pool's workers left running: {left_running(pids)}"

    def process_terminated():
        child = fork.Process(target=busy)
        child.start()
        running_children(1)
        child.terminate()
        child.join(60)
        return f"the process's exit code: {child.exitcode}"

    class Items(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            return i, os.getpid()

    def dataloader_worker_killed():
        # Batches of plain ints, pickled whole through the worker's pipe: a tensor would be
        # passed as a shared-memory fd, whose transfer a kill can cut (ConnectionResetError),
        # now and then, instead of torch's word on the worker.
        loader = DataLoader(Items(), batch_size=1, num_workers=2, multiprocessing_context=fork,
                            collate_fn=lambda batch: batch)
        try:
            for i, batch in enumerate(loader):
                if i == 0:  # as an operator's kill or the OOM killer's would: from another process
                    worker = batch[0][1]
                    subprocess.run([sys.executable, "-c", f"import os; os.kill({worker}, {int(signal.SIGTERM)})"],
                                   timeout=60, check=True)
            return "the epoch ended"
        except RuntimeError as e:  # torch's own word on its worker, its pids left out
            return f"the loader raised: {re.sub(r'[0-9]+', 'N', str(e)).strip()}"

    def subprocess_terminated():
        child = subprocess.Popen(["sleep", "60"])
        child.terminate()
        return f"the subprocess's return code: {child.wait(60)}"

    CASES = {"pool terminated": pool_terminated, "with pool left": with_pool_left,
             "process terminated": process_terminated, "dataloader worker killed": dataloader_worker_killed,
             "subprocess terminated": subprocess_terminated}

    if __name__ == "__main__":
        if with_ftmem:
            from ftmem import SnapshotEngine
            engine = SnapshotEngine({"shm_dir": shm_dir})
            engine.save({"w": torch.ones(4)}, 1).wait_protected()
        print("child:", CASES[case](), flush=True)
        if with_ftmem:
            for version in range(2, 5):
                engine.save({"w": torch.full((4,), float(version))}, version).wait_protected()
            print(f"parent saved version {version}", flush=True)
            engine.close(job_finished=True)
""")


def run_script(script: str, args: list, tmp_path, name: str) -> tuple:
    """The script's exit code and output (its children's too). It runs in a session of its
    own, which is SIGKILLed afterwards: a child that swallowed its SIGTERM, orphaned when its
    parent died, would otherwise outlive the test."""
    log = str(tmp_path / f"{name}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, FTMEM_JOB_ID=job_id()))
    try:
        code = proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    with open(log, errors="replace") as f:
        return code, f.read()


def run_case(case: str, shm_dir: str, tmp_path, with_ftmem: bool = True) -> tuple:
    how = "with ftmem" if with_ftmem else "without ftmem"
    return run_script(SCRIPT, [shm_dir, case, how], tmp_path, f"{case} {how}".replace(" ", "-"))


def assert_went_on_saving(code, said: str) -> None:
    """The training process neither ended by the child's signal nor took it for its own."""
    assert code == 0, f"the training process ended with {code} (-15: by SIGTERM, None: it hung):\n{said}"
    assert "parent saved version 4" in said, said
    assert "ftmem: SIGTERM" not in said, f"ftmem acted on a child's SIGTERM in the training process:\n{said}"


@pytest.mark.parametrize("case", ["pool terminated", "with pool left"])
@pytest.mark.fault("forked child signalled", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: the pool's workers end by SIGTERM, and the training process goes on saving")
def test_a_pool_terminated_while_busy_leaves_the_training_process_saving(case, shm_dir, tmp_path):
    """Data pipelines terminate a busy fork pool, by ``pool.terminate()`` or by leaving
    ``with Pool() as p:`` while tasks run. Its workers, forks of the training process, get
    SIGTERM: they must end by it (terminate joins them, with no bound of its own), and the
    training process, which did not get one, must go on saving."""
    code, said = run_case(case, shm_dir, tmp_path)
    assert_went_on_saving(code, said)
    assert "child: the pool's workers left running: []" in said, said


@pytest.mark.fault("forked child signalled", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: the child ends by SIGTERM (-15) as without ftmem, and the training process goes on "
                          "saving")
def test_a_forked_process_ends_by_sigterm_as_without_ftmem_and_the_training_process_goes_on_saving(shm_dir, tmp_path):
    """A fork-started multiprocessing.Process that is terminated ends by SIGTERM (exit code
    -15), as it does without ftmem, and its signal is not the training process's."""
    code, said = run_case("process terminated", shm_dir, tmp_path)
    assert_went_on_saving(code, said)
    assert "child: the process's exit code: -15" in said, said


@pytest.mark.fault("DataLoader worker killed", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: the loader raises torch's own error as without ftmem, and the training process "
                          "goes on saving")
def test_a_dataloader_worker_killed_mid_epoch_fails_the_epoch_as_without_ftmem_and_training_goes_on_saving(
        shm_dir, tmp_path):
    """A fork worker of a DataLoader killed by SIGTERM mid-epoch: the training process sees
    torch's error on its dead worker as without ftmem (the same run without the engine is the
    reference), then goes on saving. torch words it one of two ways, by which of its checks sees
    the death first (its SIGCHLD handler, or the worker queue's status check), with ftmem as
    without it."""
    code, reference = run_case("dataloader worker killed", shm_dir, tmp_path, with_ftmem=False)
    assert code == 0 and re.search(WORKER_DIED, reference), reference
    code, said = run_case("dataloader worker killed", shm_dir, tmp_path)
    assert_went_on_saving(code, said)
    assert re.search(WORKER_DIED, said), f"without ftmem: {reference!r}; with it:\n{said}"


# torch's words (2.13) for a DataLoader worker that died, its pids left out
WORKER_DIED = (r"(?m)^child: the loader raised: DataLoader worker \(pid(\(s\))? N\) "
               r"(is killed by signal: Terminated\.|exited unexpectedly)$")


@pytest.mark.fault("forked child signalled", phase="between saves", framework="engine (toy trainer)",
                   expect="goes on: the subprocess ends by SIGTERM (-15), and the training process goes on saving")
def test_a_terminated_subprocess_ends_by_sigterm_and_the_training_process_goes_on_saving(shm_dir, tmp_path):
    """A subprocess (fork, then exec) that is terminated ends by SIGTERM (return code -15): it
    must take none of ftmem's handling with it, nor a signal mask that keeps SIGTERM out."""
    code, said = run_case("subprocess terminated", shm_dir, tmp_path)
    assert_went_on_saving(code, said)
    assert "child: the subprocess's return code: -15" in said, said


ADAPTER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from ftmem import FtmemConfig, ParallelLayout
    from ftmem._shm import jobs
    from ftmem.adapter import AdapterRuntime
    from tests.harness.lifecycle_job import TensorFiles

    shm_dir, save_dir, persist_dir = sys.argv[1:4]
    config = FtmemConfig.from_dict({"ranks_per_node": 1, "ec": {"k": 1, "m": 0}, "shm_dir": shm_dir})
    # With a persistent tier, the runtime's end at exit (its atexit finish) flushes the newest
    # version and frees the job's memory: the end of the job, which only the job may decide.
    runtime = AdapterRuntime(config, ParallelLayout.data_parallel(1), TensorFiles(), save_dir=save_dir,
                             persist_dir=persist_dir, persist_interval=1)

    def save(version):
        w = torch.full((8,), float(version))
        runtime.save({"w": w}, version, replicated=lambda t: t is w)
        runtime.wait_flushed()

    def held():
        status = jobs.status(shm_dir, os.environ["FTMEM_JOB_ID"])
        return sorted(v for job in status["jobs"] for node in job["nodes"] for v in node["versions"])

    save(1)
    print(f"held before the fork: {held()}", flush=True)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a child's ordinary end: it runs the exit hooks it inherited
    deadline = time.monotonic() + 60
    while True:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            print(f"the child's exit code: {os.waitstatus_to_exitcode(status)}", flush=True)
            break
        if time.monotonic() > deadline:
            print("the child hung in its exit", flush=True)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    print(f"held after the child's exit: {held()}", flush=True)
    for version in range(2, 5):
        save(version)
    print(f"parent saved version {version}", flush=True)
""")


@pytest.mark.fault("forked child exits", phase="between saves", framework="adapter runtime",
                   expect="goes on: the child's exit hooks leave the job's memory alone, and the training process goes "
                          "on saving")
def test_a_child_of_os_fork_that_exits_leaves_the_job_its_memory(shm_dir, tmp_path):
    """A child of plain ``os.fork()`` that ends by ``sys.exit(0)`` runs the atexit hooks it
    inherited, the adapter runtime's end of the job among them. That end is the training
    process's alone: the child must not flush or free the job's shared memory, which the
    training process keeps every version in and goes on saving to; the training process's
    own end still frees it."""
    code, said = run_script(ADAPTER_SCRIPT, [shm_dir, str(tmp_path / "save"), str(tmp_path / "persist")], tmp_path,
                            "os-fork")
    assert "held before the fork: [1]" in said and "the child's exit code: 0" in said, said
    assert "held after the child's exit: [1]" in said, f"the child freed the job's memory:\n{said}"
    assert_went_on_saving(code, said)
    assert not jobs.list_jobs(shm_dir), "the training process's own end did not free the job's memory"
