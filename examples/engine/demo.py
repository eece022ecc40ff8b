"""``ftmem demo``: three ranks on three virtual nodes train with erasure-coded
in-memory snapshots; every rank is SIGKILLed and one whole node is lost; the job
restarts, rebuilds the lost node's state from parity, and finishes bitwise identical
to a run that never failed and never used ftmem."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from ftmem._shm import jobs
from ftmem.cli import Parser, shm_dir_arg

from examples.launch import LocalJob

WORLD = 3
LOST_NODE = 1
TIMEOUT_S = 180
TRAINER = "examples.engine.toy_train"


def read_losses(out: str, rank: int) -> dict[int, float]:
    with open(os.path.join(out, f"rank{rank}.losses.jsonl")) as f:
        return {r["it"]: r["loss"] for r in map(json.loads, f)}


def same_final_weights(out_a: str, out_b: str, rank: int) -> bool:
    a = torch.load(os.path.join(out_a, f"rank{rank}.final.pt"))
    b = torch.load(os.path.join(out_b, f"rank{rank}.final.pt"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def crash_and_lose_node(run: LocalJob, shm_dir: str, job: str, kill_after: int, lost_node: int,
                        timeout: float = TIMEOUT_S) -> None:
    """Once every rank of ``run`` stopped after ``kill_after``, SIGKILL them all, then
    lose ``lost_node`` entirely; say what the SMPs held in between."""
    world = len(run.procs)
    with run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), timeout,
                     f"every rank to reach step {kill_after}")
        run.kill_all()
    nodes = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
    say(f"SIGKILLed every rank after step {kill_after}. The SMPs outlived them: "
        + "; ".join(f"node {n['node']} holds versions {n['versions']}, protected {n['protected']}" for n in nodes))
    jobs.lose_node(shm_dir, job, lost_node)
    say(f"lost node {lost_node} entirely: its SMP SIGKILLed and its shared memory deleted")


def report(out: str, ref: str, world: int, iters: int, shm_dir: str, job: str) -> bool:
    """Say, per rank, what it restored and whether it ended bitwise like the reference."""
    ok = True
    for rank in range(world):
        restored = [ln for ln in LocalJob.read_log(out, rank).splitlines() if ln.startswith("ftmem: restored")]
        got, want = read_losses(out, rank), read_losses(ref, rank)
        same = all(got.get(it) == want[it] for it in range(iters)) and same_final_weights(out, ref, rank)
        say(f"rank {rank}: {restored[-1] if restored else 'NOTHING RESTORED'}; losses of all {iters} steps "
            f"and final weights bitwise equal to the reference: {same}")
        ok = ok and same and bool(restored)
    left = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
    say(f"after the clean finish the SMPs freed the job's shared memory: {not left}")
    say("SUCCESS" if ok and not left else "FAILED")
    return ok and not left


def run_demo(iters: int = 12, kill_after: int = 7, shm_dir: str = "/dev/shm") -> bool:
    work = tempfile.mkdtemp(prefix="ftmem-demo-")
    job = f"demo-{os.getpid()}"
    train = ["--iters", str(iters), "--ranks-per-node", "1", "--shm-dir", shm_dir, "--ec-k", "2", "--ec-m", "1"]
    say(f"{WORLD} ranks on {WORLD} virtual nodes train a small model for {iters} steps, saving model, optimizer, "
        f"scheduler and RNG to shared memory after every step, erasure coded across the nodes (k=2, m=1).")
    ref, out = os.path.join(work, "reference"), os.path.join(work, "crashed")
    try:
        # The reference never touches ftmem: the same steps without snapshots.
        LocalJob(TRAINER, ["--iters", str(iters), "--no-snapshots", "--out", ref], WORLD, f"{job}-ref",
                 ref).wait(TIMEOUT_S)
        say(f"reference run without failures and without ftmem (no snapshots): done ({ref})")
        crash_and_lose_node(LocalJob(TRAINER, train + ["--out", out, "--stop-after", str(kill_after)], WORLD, job, out),
                            shm_dir, job, kill_after, LOST_NODE)
        LocalJob(TRAINER, train + ["--out", out], WORLD, job, out).wait(TIMEOUT_S)
        return report(out, ref, WORLD, iters, shm_dir, job)
    finally:
        jobs.clean(shm_dir, job)


def main(argv=None) -> int:
    parser = Parser(prog="ftmem demo", description=__doc__.replace("\n", " "))
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    return 0 if run_demo(shm_dir=args.shm_dir) else 1


if __name__ == "__main__":
    sys.exit(main())
