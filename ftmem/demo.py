"""``ftmem demo``: three ranks on three virtual nodes train with erasure-coded
in-memory snapshots; every rank is SIGKILLed and one whole node is lost; the job
restarts, rebuilds the lost node's state from parity, and finishes bitwise identical
to a run that never failed."""
from __future__ import annotations

import json
import os
import tempfile

import torch

from . import jobs
from .launch import LocalJob

WORLD = 3
LOST_NODE = 1
TIMEOUT_S = 180


def read_losses(out: str, rank: int) -> dict[int, float]:
    with open(os.path.join(out, f"rank{rank}.losses.jsonl")) as f:
        return {r["it"]: r["loss"] for r in map(json.loads, f)}


def same_final_weights(out_a: str, out_b: str, rank: int) -> bool:
    a = torch.load(os.path.join(out_a, f"rank{rank}.final.pt"))
    b = torch.load(os.path.join(out_b, f"rank{rank}.final.pt"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_demo(iters: int = 12, kill_after: int = 7, shm_dir: str = "/dev/shm") -> bool:
    work = tempfile.mkdtemp(prefix="ftmem-demo-")
    job = f"demo-{os.getpid()}"
    train = ["--iters", str(iters), "--ranks-per-node", "1", "--shm-dir", shm_dir, "--ec-k", "2", "--ec-m", "1"]
    say = lambda msg: print(f"[demo] {msg}", flush=True)  # noqa: E731
    say(f"{WORLD} ranks on {WORLD} virtual nodes train a small model for {iters} steps, saving model, optimizer, "
        f"scheduler and RNG to shared memory after every step, erasure coded across the nodes (k=2, m=1).")
    try:
        ref = os.path.join(work, "reference")
        LocalJob("ftmem.toy_train", train + ["--out", ref], WORLD, f"{job}-ref", ref).wait(TIMEOUT_S)
        say(f"reference run without failures: done ({ref})")

        crashed = os.path.join(work, "crashed")
        with LocalJob("ftmem.toy_train", train + ["--out", crashed, "--stop-after", str(kill_after)],
                      WORLD, job, crashed) as first:
            first.wait_for(lambda: all("stopped after" in first.log(r) for r in range(WORLD)), TIMEOUT_S,
                           f"every rank to reach step {kill_after}")
            first.kill_all()
        nodes = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
        say(f"SIGKILLed every rank after step {kill_after}. The SMPs outlived them: "
            + "; ".join(f"node {n['node']} holds versions {n['versions']}, protected {n['protected']}" for n in nodes))
        jobs.lose_node(shm_dir, job, LOST_NODE)
        say(f"lost node {LOST_NODE} entirely: its SMP SIGKILLed and its shared memory deleted")

        LocalJob("ftmem.toy_train", train + ["--out", crashed], WORLD, job, crashed).wait(TIMEOUT_S)
        for rank in range(WORLD):
            restored = [ln for ln in LocalJob.read_log(crashed, rank).splitlines() if ln.startswith("ftmem: restored")]
            say(f"restarted rank {rank}: {restored[-1] if restored else 'NOTHING RESTORED'}")

        ok = True
        for rank in range(WORLD):
            ref_losses, got = read_losses(ref, rank), read_losses(crashed, rank)
            same_losses = all(got[it] == ref_losses[it] for it in range(iters))
            same_weights = same_final_weights(ref, crashed, rank)
            say(f"rank {rank}: losses of all {iters} steps bitwise equal to the reference: {same_losses}; "
                f"final weights bitwise equal: {same_weights}")
            ok = ok and same_losses and same_weights
        left = jobs.status(shm_dir, job)["jobs"][0]["nodes"]
        say(f"after the clean finish the SMPs freed the job's shared memory: {not left}")
        say("SUCCESS" if ok and not left else "FAILED")
        return ok and not left
    finally:
        for j in (job, f"{job}-ref"):
            jobs.clean(shm_dir, j)
