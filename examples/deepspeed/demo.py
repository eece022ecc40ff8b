"""``make demo``: the small GPT trains with DeepSpeed (ZeRO-1) on three virtual nodes,
checkpointing to ftmem after every step; every rank is SIGKILLed and one whole node
is lost; the job restarts, load_checkpoint rebuilds the lost node's state from parity,
and training finishes bitwise identical to a run that never failed and never used
ftmem (DeepSpeed's default checkpoint engine saving every step)."""
from __future__ import annotations

import json
import os
import sys
import tempfile

from ftmem._shm import jobs

from examples.engine.demo import crash_and_lose_node, report, say
from examples.launch import LocalJob

WORLD, ITERS, KILL_AFTER, LOST_NODE, TIMEOUT_S = 3, 12, 7, 1, 600
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "zero1.json")
STOCK_ENGINE, NO_FTMEM = "checkpoint engine TorchCheckpointEngine", "ftmem modules loaded: none"  # train_gpt's lines


def run_demo(shm_dir: str = "/dev/shm") -> bool:
    work = tempfile.mkdtemp(prefix="ftmem-ds-demo-")
    job = f"ds-demo-{os.getpid()}"
    ref, out = os.path.join(work, "reference"), os.path.join(work, "crashed")

    def trainer(out_dir: str, job_id: str, *extra: str, stock: bool = False) -> LocalJob:
        """The trainer with ftmem, or ``stock``: DeepSpeed's default checkpoint engine, no ftmem module loaded."""
        os.makedirs(out_dir, exist_ok=True)
        # The persistent tier writes the newest version to disk when the job ends (its
        # interval is longer than the run), which lets the finished job free its memory.
        ftmem = {"shm_dir": shm_dir, "persist": {"dir": os.path.join(out_dir, "persist"), "interval": 100}}
        engine = ["--checkpoint-engine", "default"] if stock else ["--ftmem", json.dumps(ftmem)]
        args = ["--deepspeed-config", CONFIG, "--save-dir", os.path.join(out_dir, "ckpt"), "--iters", str(ITERS),
                "--out", out_dir, *engine, *extra]
        env = {"DS_ACCELERATOR": "cpu", **({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"} if stock else {})}
        return LocalJob("examples.deepspeed.train_gpt", args, WORLD, job_id, out_dir, env=env)

    say(f"DeepSpeed ZeRO-1 trains a small GPT on {WORLD} ranks, one per virtual node, for {ITERS} steps; "
        f'"checkpoint": {{"engine": "ftmem"}} snapshots it to shared memory after every step, '
        f"erasure coded across the nodes (k=2, m=1).")
    try:
        reference = trainer(ref, f"{job}-ref", stock=True)
        if reference.wait(TIMEOUT_S) != [0] * WORLD or not all(
                STOCK_ENGINE in reference.log(r) and NO_FTMEM in reference.log(r) for r in range(WORLD)):
            say(f"the reference run without ftmem failed or did not use DeepSpeed's default engine: {ref}")
            say("FAILED")
            return False
        say("reference run without failures and without ftmem (DeepSpeed's default checkpoint engine, "
            "TorchCheckpointEngine on every rank): done")
        crash_and_lose_node(trainer(out, job, "--stop-after", str(KILL_AFTER)), shm_dir, job, KILL_AFTER, LOST_NODE,
                            TIMEOUT_S)
        trainer(out, job, "--load").wait(TIMEOUT_S)
        return report(out, ref, WORLD, ITERS, shm_dir, job)
    finally:
        jobs.clean(shm_dir, job)


if __name__ == "__main__":
    sys.exit(0 if run_demo(*sys.argv[1:2]) else 1)
