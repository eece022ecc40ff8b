"""Megatron-LM 0.19.2's own training loop (``megatron.training.pretrain``, its argument
parser, its checkpointing.py) with ftmem's in-memory checkpoints, on CPU over gloo:
examples/megatron_lm/pretrain_gpt.py, a user's launch script, in the trees that
``make megatron-lm`` builds (tests/harness/megatron_lm/build_env.py): ``ftmem_megatron.install()``
on the unpatched tree, and the tree with patches/megatron-lm-0.19.2-ftmem.patch.

Ranks are SIGKILLed and whole virtual nodes lost (ranks, SMP and shared memory). Every
resume is checked against an uninterrupted run of the same script without ftmem flags:
the final weights, optimizer state, scheduler and RNG state (Megatron's own checkpoint of
the last iteration) bitwise, and the losses Megatron-LM logs.

The second iteration after any resume logs another loss than the uninterrupted run, with
the same weights, gradient norm and next loss: Megatron-LM's own resume from its own
checkpoint logs exactly the same (seen with this script: a stock run stopped by
``--exit-interval 4`` and resumed from disk logged 5.280519 where the uninterrupted run
logged 5.328074 at iteration 6, and equal values elsewhere). Its log averages the losses
accumulated since the last log line, and a resumed loop starts that sum differently. So
the losses are compared with the uninterrupted run everywhere but there, and for TP 2 x DP 2
all of them with Megatron-LM's own resume at the same iteration.
"""
import os
import pickle
import re
import shutil
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from harness.common import ANY, REPO, job_id, logged, run_once
from harness.megatron_jobs import TREES
from harness.ranks import LocalJob
from ftmem import restored_from_disk, restored_from_memory
from ftmem._shm import jobs

ITERS, PAUSED, TIMEOUT = 8, 5, 240
# Megatron-LM's flags for its CPU-capable paths (ftmem_megatron.cpu.megatron_lm), and a tiny GPT.
CPU = ["--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
       "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
       "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--rerun-mode", "disabled"]
GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
       "--eval-iters", "0", "--eval-interval", "1000", "--ckpt-format", "torch"]
LAYOUTS = {"tp2-dp2": ["--tensor-model-parallel-size", "2"],
           "pp2-dp2": ["--pipeline-model-parallel-size", "2"],
           "tp2-dp2-distributed-optimizer": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]}
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")


class MegatronLMJob:
    """examples/megatron_lm/pretrain_gpt.py on 4 ranks, one per virtual node, in ``root``;
    with ``ftmem`` flags, in-memory saves every iteration (k=3, m=1 over the 4 nodes)."""

    world = 4

    def __init__(self, root: str, layout: str, tree: str, shm_dir=None, extra=()):
        self.root, self.shm_dir, self.job, self.logs = root, shm_dir, job_id(), os.path.join(root, "logs")
        self.ckpt = os.path.join(root, "ckpt")
        self.env = {"PYTHONPATH": os.pathsep.join([tree, REPO]), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        ftmem = [] if shm_dir is None else [
            "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
            "--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "3", "--ftmem-ec-m", "1", "--ftmem-shm-dir", shm_dir]
        self.args = [*CPU, *GPT, *LAYOUTS[layout], "--train-iters", str(ITERS), "--save", self.ckpt, "--load",
                     self.ckpt, "--save-interval", "100", *ftmem, *extra]

    def start(self, *extra, rank_env=None) -> LocalJob:
        return LocalJob("examples.megatron_lm.pretrain_gpt", self.args + list(extra), self.world, self.job,
                        self.logs, env=self.env, rank_env=rank_env)

    def run(self, *extra) -> None:
        codes = self.start(*extra).wait(TIMEOUT)
        assert codes == [0] * self.world, "\n".join(self.log(r)[-3000:] for r in range(self.world))

    def run_until_paused(self, hook_dir: str, then: Optional[tuple[Callable[[], bool], str]] = None) -> None:
        """Train until rank 0 has committed version PAUSED and stops there (its copy thread
        held by the test hook, so that PAUSED is never protected), and until ``then`` (a
        condition and what it waits for) holds where given; then SIGKILL every rank."""
        paused = os.path.join(hook_dir, f"paused.rank0.v{PAUSED}")
        hook = {0: {"FTMEM_TEST_HOOK": f"after_commit:pause:rank=0:version={PAUSED}",
                    "FTMEM_TEST_HOOK_DIR": hook_dir}}
        with self.start(rank_env=hook) as run:
            run.wait_for(lambda: os.path.exists(paused), TIMEOUT, f"rank 0 to commit version {PAUSED}")
            if then is not None:
                condition, what = then
                run.wait_for(condition, TIMEOUT, what)

    def log(self, rank: int) -> str:
        return LocalJob.read_log(self.logs, rank)

    def losses(self) -> dict[int, str]:
        """The losses Megatron-LM logged (on the last rank), the last run's for each iteration."""
        return {int(it): loss for it, loss in LOSS.findall(self.log(self.world - 1))}


def reference(layout: str, root: str) -> MegatronLMJob:
    """The uninterrupted run of the same script without ftmem flags (stock tree)."""
    def run() -> MegatronLMJob:
        job = MegatronLMJob(root, layout, TREES["installer"])
        job.run()
        assert sorted(job.losses()) == list(range(1, ITERS + 1)), job.log(job.world - 1)[-3000:]
        assert not any("ftmem:" in job.log(r) for r in range(job.world)), job.log(0)[-3000:]
        return job
    return run_once(("megatron-lm", layout), run)


def resumed_reference(layout: str, root: str) -> dict[int, str]:
    """The losses that Megatron-LM's own checkpointing logs after a resume at iteration 4: the
    run without ftmem stopped there (``--exit-interval 4``, its own save of iteration 4) and
    resumed from disk."""
    def run() -> dict[int, str]:
        job = MegatronLMJob(root, layout, TREES["installer"], extra=["--exit-interval", str(PAUSED - 1)])
        job.args[job.args.index("--save-interval") + 1] = str(PAUSED - 1)
        job.run()
        job.args = job.args[:job.args.index("--exit-interval")]
        job.run()
        assert f"loading checkpoint from {job.ckpt} at iteration {PAUSED - 1}" in job.log(0), job.log(0)[-3000:]
        return {it: loss for it, loss in job.losses().items() if it >= PAUSED}
    return run_once(("megatron-lm-resumed", layout), run)


def assert_same_final_state(got: str, want: str) -> None:
    """Megatron's checkpoint of the last iteration in ``got`` equals ``want``'s bitwise, every
    file of every rank: model, optimizer (distrib_optim.pt too), scheduler, iteration, RNG
    (the CUDA generator's state aside: on the CPU there is none, written as None or empty)."""
    folder = f"iter_{ITERS:07d}"
    files = sorted(os.path.relpath(os.path.join(d, f), want) for d, _, names in os.walk(os.path.join(want, folder))
                   for f in names)
    assert files and files == sorted(os.path.relpath(os.path.join(d, f), got)
                                     for d, _, names in os.walk(os.path.join(got, folder)) for f in names)
    for name in files:
        mine, theirs = (torch.load(os.path.join(d, name), weights_only=False, pickle_module=_WithoutMegatronTypes)
                        for d in (got, want))
        for state in (mine, theirs):
            state.pop("args", None)
            for rng in state.get("rng_state", []):
                rng.pop("cuda_rng_state")
        _assert_equal(mine, theirs, name)


class _WithoutMegatronTypes:
    """A pickle module for torch.load that reads Megatron-LM 0.19.2's types (in the args, which
    are not compared) as placeholders: this process has megatron-core 0.16.1 imported."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            return _Placeholder if module.startswith("megatron.") else super().find_class(module, name)

    load = pickle.load


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _assert_equal(a, b, where: str) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, np.ndarray):  # numpy's RNG state
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(b, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for key in b:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def assert_same_losses(got: dict, want: dict, resumed_at: int) -> None:
    """Every logged loss equal, but the second iteration after the resume (module doc);
    ``got`` holds every iteration after the resume at least."""
    assert set(range(resumed_at + 1, ITERS + 1)) <= set(got), got
    differ = {it: (got[it], want[it]) for it in got if got[it] != want[it] and it != resumed_at + 2}
    assert not differ, differ


def _train_paused_and_lose(job: MegatronLMJob, tmp_path, lost: list[int], then=None) -> None:
    job.run_until_paused(str(tmp_path / "hook"), then)
    nodes = jobs.status(job.shm_dir, job.job)["jobs"][0]["nodes"]
    assert all(n["protected"] == PAUSED - 1 for n in nodes), nodes
    for node in lost:
        jobs.lose_node(job.shm_dir, job.job, node)


def _read(path: str) -> Optional[str]:
    """The file's text, stripped; None where there is none yet."""
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("route, layout", [("installer", "tp2-dp2"), ("patch", "tp2-dp2"),
                                           ("installer", "pp2-dp2"),
                                           ("installer", "tp2-dp2-distributed-optimizer")])
@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="after the commit, before parity",
                   framework="Megatron-LM's own loop",
                   expect="resumes bitwise from memory: iteration 4, the newest protected, node 2 rebuilt from parity")
def test_a_node_lost_mid_run_resumes_from_memory_bitwise(route, layout, shm_dir, tmp_path):
    """TP 2 x DP 2 (and PP 2 x DP 2, and with the distributed optimizer) on 4 virtual nodes,
    k=3 m=1, an in-memory save every iteration: the job stops with version 5 committed on
    rank 0 but never protected, every rank is SIGKILLed and node 2 lost. The relaunch (the
    same command) restores the newest protected iteration, 4, node 2's rank rebuilt from
    parity, and ends as the uninterrupted run without ftmem does."""
    (tmp_path / "hook").mkdir()
    ref = reference(layout, str(tmp_path / "reference"))
    job = MegatronLMJob(str(tmp_path / "run"), layout, TREES[route], shm_dir)
    _train_paused_and_lose(job, tmp_path, lost=[2])
    job.run()
    for rank in range(job.world):
        assert logged(restored_from_memory(PAUSED - 1, rank, rebuilt=rank == 2), job.log(rank)), job.log(rank)[-3000:]
    if route == "patch":
        assert "FTMEM_NATIVE" in open(os.path.join(TREES["patch"], "megatron", "training", "checkpointing.py")).read()
    assert_same_losses(job.losses(), ref.losses(), PAUSED - 1)
    if layout == "tp2-dp2":  # every logged loss, the one above too, as Megatron-LM's own resume logs it
        resumed = resumed_reference(layout, str(tmp_path / "resumed"))
        assert {it: job.losses()[it] for it in resumed} == resumed
    assert_same_final_state(job.ckpt, ref.ckpt)


@pytest.mark.fault("more nodes lost than parity", phase="after the commit, before parity",
                   framework="Megatron-LM's own loop",
                   expect="resumes bitwise from disk: iteration 4, the checkpoint ftmem wrote from memory")
def test_more_than_m_lost_nodes_fall_back_to_the_checkpoint_written_from_memory(shm_dir, tmp_path):
    """With --save-interval 4, ftmem writes Megatron's persistent checkpoint of iteration 4
    from memory. Two of the four nodes lost (m=1): memory cannot serve, the relaunch logs the
    "from disk" line and resumes from that checkpoint bitwise. A stock Megatron-LM job (no
    ftmem flag) resumes from a copy of the same checkpoint bitwise too."""
    (tmp_path / "hook").mkdir()
    ref = reference("tp2-dp2", str(tmp_path / "reference"))
    job = MegatronLMJob(str(tmp_path / "run"), "tp2-dp2", TREES["installer"], shm_dir)
    job.args[job.args.index("--save-interval") + 1] = "4"
    tracker = os.path.join(job.ckpt, "latest_checkpointed_iteration.txt")
    # The flush of iteration 4 runs in the background once it is protected: on a loaded
    # machine, after rank 0 has committed version 5.
    _train_paused_and_lose(job, tmp_path, lost=[1, 2], then=(lambda: _read(tracker) == "4", "the flush of iteration 4"))
    stock = MegatronLMJob(str(tmp_path / "stock"), "tp2-dp2", TREES["installer"])
    shutil.copytree(job.ckpt, stock.ckpt)
    job.run()
    for rank in range(job.world):
        assert logged(restored_from_disk(4, job.ckpt, rank, "no version is recoverable from memory" + ANY),
                      job.log(rank)), job.log(rank)[-3000:]
    assert_same_losses(job.losses(), ref.losses(), 4)
    assert_same_final_state(job.ckpt, ref.ckpt)
    stock.run()
    assert not any("ftmem:" in stock.log(r) for r in range(stock.world))
    assert_same_losses(stock.losses(), ref.losses(), 4)
    assert_same_final_state(stock.ckpt, ref.ckpt)


@pytest.mark.fault("more nodes lost than parity", phase="after the commit, before parity",
                   framework="Megatron-LM's own loop",
                   expect="refuses with a reason: naming --pretrained-checkpoint, never a start over; nothing dropped")
def test_a_start_over_from_the_pretrained_checkpoint_is_refused_where_memory_held_the_job(shm_dir, tmp_path):
    """A finetuning job (--pretrained-checkpoint) saving in memory; two nodes lost, nothing in
    --load: Megatron-LM would load the pretrained checkpoint and start over at iteration 0.
    ftmem refuses on every rank, naming that checkpoint, and drops nothing."""
    (tmp_path / "hook").mkdir()
    pretrained = reference("tp2-dp2", str(tmp_path / "reference")).ckpt
    job = MegatronLMJob(str(tmp_path / "run"), "tp2-dp2", TREES["installer"], shm_dir,
                        extra=["--pretrained-checkpoint", pretrained])
    _train_paused_and_lose(job, tmp_path, lost=[1, 2])
    held = {n["node"]: n["versions"] for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"]}
    logged_before = [len(job.log(r)) for r in range(job.world)]
    assert job.start().wait(TIMEOUT) == [1] * job.world, job.log(0)[-3000:]
    for rank in range(job.world):
        log = job.log(rank)[logged_before[rank]:]
        assert (f"and the only checkpoint on disk is --pretrained-checkpoint {pretrained}, which starts training "
                f"over. ftmem does not start from scratch in place of what this job saved") in log, log[-3000:]
        assert "lm loss:" not in log  # no training
    assert {n["node"]: n["versions"] for n in jobs.status(shm_dir, job.job)["jobs"][0]["nodes"]
            if n["versions"]} == held  # nothing dropped (the relaunch started empty SMPs on the lost nodes)
