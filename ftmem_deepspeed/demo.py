"""``make demo``: the small GPT trains with DeepSpeed (ZeRO-1) on three virtual nodes,
checkpointing to ftmem after every step; every rank is SIGKILLed and one whole node
is lost; the job restarts, load_checkpoint rebuilds the lost node's state from parity,
and training finishes bitwise identical to a run that never failed."""
from __future__ import annotations

import json
import os
import sys
import tempfile

from ftmem import jobs
from ftmem.demo import read_losses, same_final_weights
from ftmem.launch import LocalJob

WORLD, ITERS, KILL_AFTER, LOST_NODE, TIMEOUT_S = 3, 12, 7, 1, 600
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "zero1.json")


def run_demo(shm_dir: str = "/dev/shm") -> bool:
    work = tempfile.mkdtemp(prefix="ftmem-ds-demo-")
    job = f"ds-demo-{os.getpid()}"
    say = lambda msg: print(f"[demo] {msg}", flush=True)  # noqa: E731
    env = {"DS_ACCELERATOR": "cpu"}

    def trainer(name: str, job_id: str, *extra: str) -> LocalJob:
        out = os.path.join(work, name)
        os.makedirs(out, exist_ok=True)
        args = ["--deepspeed-config", CONFIG, "--save-dir", os.path.join(out, "ckpt"), "--iters", str(ITERS),
                "--out", out, "--ftmem", json.dumps({"shm_dir": shm_dir}), *extra]
        return LocalJob("ftmem_deepspeed.train_gpt", args, WORLD, job_id, out, env=env)

    say(f"DeepSpeed ZeRO-1 trains a small GPT on {WORLD} ranks, one per virtual node, for {ITERS} steps; "
        f'"checkpoint": {{"engine": "ftmem"}} snapshots it to shared memory after every step, '
        f"erasure coded across the nodes (k=2, m=1).")
    try:
        trainer("reference", f"{job}-ref").wait(TIMEOUT_S)
        say("reference run without failures: done")
        with trainer("crashed", job, "--stop-after", str(KILL_AFTER)) as first:
            first.wait_for(lambda: all("stopped after" in first.log(r) for r in range(WORLD)), TIMEOUT_S,
                           f"every rank to reach step {KILL_AFTER}")
            first.kill_all()
        nodes = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
        say(f"SIGKILLed every rank after step {KILL_AFTER}. The SMPs outlived them: "
            + "; ".join(f"node {n['node']} holds versions {n['versions']}, protected {n['protected']}" for n in nodes))
        jobs.lose_node(shm_dir, job, LOST_NODE)
        say(f"lost node {LOST_NODE} entirely: its SMP SIGKILLed and its shared memory deleted")
        trainer("crashed", job, "--load").wait(TIMEOUT_S)
        out, ref = os.path.join(work, "crashed"), os.path.join(work, "reference")
        ok = True
        for rank in range(WORLD):
            restored = [ln for ln in LocalJob.read_log(out, rank).splitlines() if ln.startswith("ftmem: restored")]
            got, want = read_losses(out, rank), read_losses(ref, rank)
            same = all(got.get(it) == want[it] for it in range(ITERS)) and same_final_weights(out, ref, rank)
            say(f"rank {rank}: {restored[-1] if restored else 'NOTHING RESTORED'}; losses of all {ITERS} steps "
                f"and final weights bitwise equal to the reference: {same}")
            ok = ok and same and bool(restored)
        left = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
        say(f"after the clean finish the SMPs freed the job's shared memory: {not left}")
        say("SUCCESS" if ok and not left else "FAILED")
        return ok and not left
    finally:
        for j in (job, f"{job}-ref"):
            jobs.clean(shm_dir, j)


if __name__ == "__main__":
    sys.exit(0 if run_demo(*sys.argv[1:2]) else 1)
