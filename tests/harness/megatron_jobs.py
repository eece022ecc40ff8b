"""Jobs of examples.megatron.pretrain_gpt (the megatron-core driver) with and without
ftmem, the uninterrupted reference runs the Megatron tests compare with, and where the
Megatron-LM trees ``make megatron-lm`` builds are."""
import os

from .common import job_id, read_json, run_once
from .ranks import REPO, LocalJob

ITERS, STOP, TIMEOUT = 6, 3, 240
# A tiny GPT for the driver: mock data, seeded.
TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-warmup-iters", "1",
            "--lr-decay-style", "cosine", "--mock-data", "--seed", "7"]

#: the Megatron-LM 0.19.2 trees ``make megatron-lm`` builds (tests/harness/megatron_lm/build_env.py)
TREES = {"installer": os.path.join(REPO, ".mlm", "stock"), "patch": os.path.join(REPO, ".mlm", "patched")}


class MegatronJob:
    """One job identity of the driver with in-memory checkpoints after every iteration
    and persistent ones only at the end; or ``stock``: the same training without ftmem
    (no --non-persistent-ckpt-type in_memory, no --ftmem-* flag), Megatron's persistent
    --ckpt-format torch saves alone."""

    def __init__(self, world, parallel, ftmem, shm_dir, root, stock=False):
        self.world, self.shm_dir, self.job, self.root = world, shm_dir, job_id(), root
        self.logs = os.path.join(root, "logs")
        self.args = TINY_GPT + parallel + [
            "--save", os.path.join(root, "ckpt"), "--load", os.path.join(root, "ckpt"), "--save-interval", "1000"]
        if not stock:
            self.args += ["--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
                          "--ftmem-shm-dir", shm_dir, *ftmem]

    def start(self, *extra, env=None, rank_env=None, launcher=LocalJob) -> LocalJob:
        """The job's ranks, started by ``launcher`` (a LocalJob, or one of its subclasses)."""
        return launcher("examples.megatron.pretrain_gpt", self.args + list(extra), self.world, self.job, self.logs,
                        env=env, rank_env=rank_env)

    def run(self, out: str, *extra, env=None, launcher=LocalJob) -> None:
        codes = self.start("--out", out, *extra, env=env, launcher=launcher).wait(TIMEOUT)
        assert codes == [0] * self.world, "\n".join(self.log(r)[-3000:] for r in range(self.world))

    def log(self, rank) -> str:
        return LocalJob.read_log(self.logs, rank)


def reference(world, parallel, root, save_interval=None) -> dict:
    """An uninterrupted run without ftmem (Megatron's torch-format saves alone, every
    ``save_interval`` iterations and at the end); its losses and final digests. Run once
    per session for the same arguments."""
    return run_once(("megatron", world, tuple(parallel), save_interval),
                    lambda: _reference(world, parallel, root, save_interval))


def _reference(world, parallel, root, save_interval) -> dict:
    job = MegatronJob(world, parallel, [], None, root, stock=True)
    if save_interval:
        job.args[job.args.index("--save-interval") + 1] = str(save_interval)
    job.run(os.path.join(root, "out.json"))
    for rank in range(world):
        # No ftmem line: the driver imports ftmem_megatron (its flags, its CPU support), nothing else.
        assert not [ln for ln in job.log(rank).splitlines() if ln.startswith("ftmem:")], job.log(rank)[-3000:]
    with open(os.path.join(root, "ckpt", "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(ITERS)  # Megatron's own save of the final state
    return read_json(os.path.join(root, "out.json"))
