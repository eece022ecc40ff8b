"""ftmem under a real Slurm (tests/harness/slurm.py: slurmctld and three slurmd, each node its
own network, host name and /dev/shm), with the sbatch script users copy
(examples/slurm/ftmem.sbatch) running DeepSpeed ZeRO-1 through srun and torchrun on three
nodes, saving every step: a node lost and the job requeued resumes from memory, the lost node
rebuilt from parity; a rank crashed and the job requeued resumes from every node's own memory;
a preemption (scancel --signal=TERM) flushes the newest version, and the requeued job on
machines whose memory is gone resumes from it. And megatron-core's driver, TP 2 on two nodes, a
node lost. Each bitwise against the framework's default checkpoints. ``make test-slurm``
installs Slurm and runs this tier."""
import json
import os
import signal
import sys

import pytest

from ftmem import restored_from_disk, restored_from_memory
from harness import megatron_jobs
from harness.common import logged, read_json
from harness.ds_jobs import CONFIGS, ITERS, STOP, TIMEOUT, reference
from harness.ranks import REPO, wait_until
from harness.slurm import NODES, SlurmCluster
from harness.toy import assert_same_training

SCRIPT = os.path.join(REPO, "examples", "slurm", "ftmem.sbatch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SlurmCluster(str(tmp_path_factory.mktemp("slurm"))) as made:
        yield made


def _sbatch(cluster, root, options: list, trainer: list) -> tuple[str, str]:
    """The script submitted as a user would (``sbatch [options] SCRIPT trainer...``); the job id
    and its output file."""
    output = str(root / "slurm.out")
    env = dict(cluster.env, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(os.path.abspath(sys.executable)) + os.pathsep + os.environ["PATH"])
    proc = cluster.on("ctl", ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={output}", *options, SCRIPT,
                              *trainer], env=env, stdout=-1, stderr=-1, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.strip().split(";")[0], output


def _submit(cluster, root, *extra) -> tuple[str, str]:
    """DeepSpeed ZeRO-1 with ftmem on the three nodes, its persistent tier under ``root``."""
    with open(os.path.join(CONFIGS, "zero1.json")) as f:
        config = json.load(f)
    config["ftmem"].update(shm_dir="/dev/shm", persist={"dir": str(root / "persist"), "interval": 1000})
    (root / "ds_config.json").write_text(json.dumps(config))
    (root / "out").mkdir(exist_ok=True)
    return _sbatch(cluster, root, [], ["-m", "examples.deepspeed.train_gpt", "--deepspeed-config",
                                       str(root / "ds_config.json"), "--save-dir", str(root / "ckpt"), "--load",
                                       "--iters", str(ITERS), "--out", str(root / "out"), *extra])


def _output(path: str) -> str:
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def test_a_node_lost_and_the_job_requeued_resumes_from_memory_rebuilt_from_parity(cluster, tmp_path):
    ref = reference("zero1.json", NODES, str(tmp_path / "reference"))
    job, output = _submit(cluster, tmp_path, "--stop-after", str(STOP))
    wait_until(lambda: _output(output).count("stopped after") == NODES or
               cluster.job_state(job) not in ("PENDING", "RUNNING"), TIMEOUT, f"step {STOP} on every node")
    assert cluster.job_state(job) == "RUNNING", _output(output)[-5000:]
    cluster.lose_node(1)
    cluster.command("scontrol", "requeue", job)
    assert cluster.wait_for_state(job, {"COMPLETED", "FAILED"}, TIMEOUT) == "COMPLETED", _output(output)[-5000:]
    for rank in range(NODES):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}", rebuilt=rank == 1),
                      _output(output)), _output(output)[-5000:]
    assert_same_training(str(tmp_path / "out"), ref, NODES, ITERS)


def test_a_rank_crashed_and_the_job_requeued_resumes_from_every_node_s_own_memory(cluster, tmp_path):
    """A rank SIGKILLed: the others end (the failure detector's line), the job fails, and requeued
    on the same nodes it resumes from memory, nothing rebuilt: each node's SMP and /dev/shm outlived
    the job's processes."""
    ref = reference("zero1.json", NODES, str(tmp_path / "reference"))
    job, output = _submit(cluster, tmp_path, "--stop-after", str(STOP))
    wait_until(lambda: _output(output).count("stopped after") == NODES or
               cluster.job_state(job) not in ("PENDING", "RUNNING"), TIMEOUT, f"step {STOP} on every node")
    rank, = [pid for pid in cluster.processes(1, "examples.deepspeed.train_gpt") if pid not in
             cluster.processes(1, "torchrun")]
    os.kill(rank, signal.SIGKILL)
    wait_until(lambda: cluster.job_state(job) not in ("RUNNING", "COMPLETING"), TIMEOUT, "the job to end")
    cluster.command("scontrol", "requeue", job)
    assert cluster.wait_for_state(job, {"COMPLETED", "FAILED"}, TIMEOUT) == "COMPLETED", _output(output)[-5000:]
    for rank in range(NODES):
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}"), _output(output)), \
            _output(output)[-5000:]
    assert_same_training(str(tmp_path / "out"), ref, NODES, ITERS)


def test_a_preemption_flushes_the_newest_version_and_the_requeued_job_resumes_from_it(cluster, tmp_path):
    ref = reference("zero1.json", NODES, str(tmp_path / "reference"))
    job, output = _submit(cluster, tmp_path, "--stop-after", str(STOP))
    wait_until(lambda: _output(output).count("stopped after") == NODES or
               cluster.job_state(job) not in ("PENDING", "RUNNING"), TIMEOUT, f"step {STOP} on every node")
    cluster.command("scancel", "--signal=TERM", job)
    wait_until(lambda: cluster.job_state(job) not in ("RUNNING", "COMPLETING"), TIMEOUT, "the job to end")
    flushed = f"flushed version {STOP + 1} to {tmp_path / 'persist'} at SIGTERM: a relaunch resumes from it"
    assert flushed in _output(output), _output(output)[-5000:]
    for n in range(NODES):  # the preempted machines are gone, and their memory with them
        cluster.lose_node(n)
    cluster.command("scontrol", "requeue", job)
    assert cluster.wait_for_state(job, {"COMPLETED", "FAILED"}, TIMEOUT) == "COMPLETED", _output(output)[-5000:]
    for rank in range(NODES):
        restored = restored_from_disk(STOP + 1, str(tmp_path / "persist" / f"global_step{STOP + 1}"), rank,
                                      "memory holds no version of this job")
        assert logged(restored, _output(output)), _output(output)[-5000:]
    assert_same_training(str(tmp_path / "out"), ref, NODES, ITERS)


def test_megatron_with_a_node_lost_and_the_job_requeued_resumes_from_memory_rebuilt_from_parity(cluster, tmp_path):
    """The same script with megatron-core's driver (TP 2 on two of the nodes, k=1, m=1)."""
    parallel = ["--tensor-model-parallel-size", "2"]
    ref = megatron_jobs.reference(2, parallel, str(tmp_path / "reference"))
    save, out = str(tmp_path / "ckpt"), str(tmp_path / "out.json")
    flags = [*megatron_jobs.TINY_GPT, *parallel, "--save", save, "--load", save, "--save-interval", "1000",
             "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1", "--ftmem-shm-dir",
             "/dev/shm", "--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "1", "--out", out,
             "--stop-after", str(megatron_jobs.STOP)]
    job, output = _sbatch(cluster, tmp_path, ["--nodes=2"], ["-m", "examples.megatron.pretrain_gpt", *flags])
    wait_until(lambda: _output(output).count("stopped after") == 2 or
               cluster.job_state(job) not in ("PENDING", "RUNNING"), TIMEOUT, "iteration 3 on both nodes")
    assert cluster.job_state(job) == "RUNNING", _output(output)[-5000:]
    cluster.lose_node(1)
    cluster.command("scontrol", "requeue", job)
    assert cluster.wait_for_state(job, {"COMPLETED", "FAILED"}, TIMEOUT) == "COMPLETED", _output(output)[-5000:]
    for rank in range(2):
        assert logged(restored_from_memory(megatron_jobs.STOP, rank, rebuilt=rank == 1), _output(output)), \
            _output(output)[-5000:]
    resumed = read_json(out)
    assert resumed["losses"] == {str(i): ref["losses"][str(i)]
                                 for i in range(megatron_jobs.STOP + 1, megatron_jobs.ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
