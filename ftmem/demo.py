"""``ftmem demo``: two ranks on two virtual nodes train, one is SIGKILLed, the job
restarts, restores from the SMPs' shared memory and finishes bitwise identical to a
run that never failed."""
from __future__ import annotations

import json
import os
import tempfile

import torch

from . import jobs
from .launch import LocalJob

WORLD = 2
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
    train = ["--iters", str(iters), "--ranks-per-node", "1", "--shm-dir", shm_dir]
    say = lambda msg: print(f"[demo] {msg}", flush=True)  # noqa: E731
    say(f"{WORLD} ranks on {WORLD} virtual nodes train a small model for {iters} steps, "
        f"saving model, optimizer, scheduler and RNG to shared memory after every step.")
    try:
        ref = os.path.join(work, "reference")
        LocalJob("ftmem.toy_train", train + ["--out", ref], WORLD, f"{job}-ref", ref).wait(TIMEOUT_S)
        say(f"reference run without failures: done ({ref})")

        crashed = os.path.join(work, "crashed")
        with LocalJob("ftmem.toy_train", train + ["--out", crashed, "--stop-after", str(kill_after)],
                      WORLD, job, crashed) as first:
            first.wait_for(lambda: all("stopped after" in first.log(r) for r in range(WORLD)), TIMEOUT_S,
                           f"both ranks to reach step {kill_after}")
            first.kill(1)
            first.kill(0)
        held = {n["node"]: (n["versions"], n["smp_pid"]) for n in jobs.status(shm_dir, job)["jobs"][0]["nodes"]}
        say(f"SIGKILLed rank 1, then rank 0, after step {kill_after}. The SMPs outlived them and hold: "
            + "; ".join(f"node {n}: versions {v} (SMP pid {p})" for n, (v, p) in held.items()))

        LocalJob("ftmem.toy_train", train + ["--out", crashed], WORLD, job, crashed).wait(TIMEOUT_S)
        restored = [line for line in LocalJob.read_log(crashed, 0).splitlines() if line.startswith("ftmem: restored")]
        say(f"restarted the job: {restored[-1] if restored else 'NOTHING RESTORED'}")

        ok = bool(restored)
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
