"""Random-kill loops (issue 14): a job is SIGKILLed over and over at moments and in
ways a seeded RNG picks — one rank, every rank, a whole virtual node (its ranks, its
SMP and its shared memory), with the persistent tier sometimes two nodes — and
restarted each time as a launcher would (the whole job, the same command with
``--load``). Every restart must resume by itself from the newest version memory can
recover (or, with the persistent tier and memory unable to serve, from the newest
checkpoint on disk), never hang, and every job identity must end with per-step losses
and final state bitwise equal to an uninterrupted run without ftmem.

A trial: the job runs (or restarts) until a step the RNG picked, a few versions on,
shows in its loss lines, or until every rank logged its restore, or — the last trial
of a loop — until its last step (the kill then lands in the final save, the teardown,
or after the job freed its memory); a random short delay; then the victim is killed,
the launcher kills the rest a moment later, lost nodes lose their memory, and the next
pass restarts the job. A job that reaches its end is checked bitwise (losses: the last
value written for each step, i.e. the final successful pass's) and, if trials remain,
a new job identity begins. Every decision and what each restart had to restore is
printed (shown with the logs of a failing pass; ``-s`` shows it always).

What a restart must restore is read off the job before it, independently of the
restore: with every node there, the newest version every rank committed (from
``ftmem status``); with a node lost, a version no older than the newest known
protected — by the loss lines (a step's line means the save before it returned, so the
version before that is protected job-wide) and by ``ftmem status``; never newer than
what the loss lines allow. A node is only lost once the pass protected a version of
its own, so that parity a previous rebuild did not restore is never needed.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import pytest

from harness.common import read_json, run_once
from harness.ranks import LocalJob, wait_until
from ftmem._shm import jobs
from ftmem._disk.persist import flushed
from harness.ds_jobs import DSJob
from harness.megatron_jobs import MegatronJob
from harness.toy import assert_same_training

SEED = 1414
# Full length (``make test-faults``, pytest --full-faults): kills and iterations per job identity.
DS_TRIALS, MEGATRON_TRIALS = 20, 10
DS_ITERS, MEGATRON_ITERS = 72, 36
# The short loops of ``make test`` kill once per victim kind and moment kind (PLAN), each
# in a seeded pass of its own, then once more at the end: every kind of kill, in fewer passes.
SHORT_DS_ITERS, SHORT_MEGATRON_ITERS = 24, 16
PASS_TIMEOUT = 300  # one pass (start, restore, steps, or the end); generous for a loaded machine
RESTORED = re.compile(r"^ftmem: restored iteration (\d+) from (memory|disk)(.*)$", re.MULTILINE)


def log(msg: str) -> None:
    print(f"[random-kills] {msg}", flush=True)


# ---------------------------------------------------------------- the two trainers

class DeepSpeedIdentity:
    """examples.deepspeed.train_gpt, ZeRO-1, 3 ranks on 3 virtual nodes, k=2 m=1, a save
    every step; step s's loss line precedes the save of version s+1."""

    world, nodes, m, step_offset = 3, 3, 1, 1

    def __init__(self, shm_dir, root, persist: bool, iters: int):
        ftmem = {"ec": {"k": 2, "m": 1}, "ranks_per_node": 1}
        self.persist = os.path.join(root, "persist") if persist else None
        if persist:
            ftmem["persist"] = {"dir": self.persist, "interval": 2}
        self.job = DSJob("zero1.json", self.world, shm_dir, root, ftmem=ftmem)
        self.job.args[self.job.args.index("--iters") + 1] = str(iters)
        self.iters, self.shm_dir, self.id = iters, shm_dir, self.job.job
        self.log_dir = self.job.out
        self.loss_files = [os.path.join(self.job.out, f"rank{r}.losses.jsonl") for r in range(self.world)]

    def start(self, load: bool) -> LocalJob:
        return self.job.start(*(["--load"] if load else []))

    def disk_version(self) -> Optional[int]:
        done = flushed(self.persist) if self.persist else []
        return done[-1]["version"] if done else None

    def check_resumed(self, text: str, rank: int, version: int) -> None:
        assert f"rank {rank}: resuming at step {version} (client_state)" in text, text[-3000:]

    def check_end(self, reference: str) -> None:
        assert_same_training(self.job.out, reference, self.world, self.iters)
        if self.persist:  # a clean end writes the newest version to disk, then frees the memory
            assert self.id not in jobs.list_jobs(self.shm_dir)
            assert self.disk_version() == self.iters
        else:  # kept in memory: said, and held
            assert f"keeps its newest version ({self.iters}) in shared memory" in self.job.log(0)[-20000:]
            nodes = jobs.status(self.shm_dir, self.id)["jobs"][0]["nodes"]
            assert all(n["versions"][-1] == self.iters for n in nodes), nodes
            jobs.clean(self.shm_dir, self.id)


def deepspeed_reference(root: str, iters: int) -> str:
    """The uninterrupted run without ftmem: DeepSpeed's stock engine saving every step
    (once per session: both loops compare against it)."""
    return run_once(("deepspeed-random-kills", iters), lambda: _deepspeed_reference(root, iters))


def _deepspeed_reference(root: str, iters: int) -> str:
    job = DSJob("zero1.json", DeepSpeedIdentity.world, None, root, stock=True)
    job.args[job.args.index("--iters") + 1] = str(iters)
    assert job.run() == [0] * job.world, job.log(0)[-5000:]
    for rank in range(job.world):
        assert "checkpoint engine TorchCheckpointEngine" in job.log(rank), job.log(rank)[-3000:]
        assert f"rank {rank}: ftmem modules loaded: none" in job.log(rank), job.log(rank)[-3000:]
    return job.out


class MegatronIdentity:
    """examples.megatron.pretrain_gpt, TP 2 on 2 ranks on 2 virtual nodes (mirrored, k=1
    m=1), an in-memory save every iteration, Megatron's persistent save at the end;
    iteration i's loss line (rank 0's) precedes the save of version i."""

    world, nodes, m, step_offset = 2, 2, 1, 0
    PARALLEL = ["--tensor-model-parallel-size", "2"]

    def __init__(self, shm_dir, root, iters: int):
        self.job = MegatronJob(self.world, self.PARALLEL, ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1",
                                                           "--ftmem-ec-m", "1"], shm_dir, root)
        self.job.args[self.job.args.index("--train-iters") + 1] = str(iters)
        self.iters, self.shm_dir, self.id, self.persist = iters, shm_dir, self.job.job, None
        self.log_dir, self.out = self.job.logs, os.path.join(root, "out.json")
        self.loss_files = [os.path.join(root, "losses.jsonl")]
        os.makedirs(self.log_dir, exist_ok=True)

    def start(self, load: bool) -> LocalJob:  # --load is part of the command: a fresh job finds nothing
        return self.job.start("--out", self.out, "--loss-log", self.loss_files[0])

    def disk_version(self) -> Optional[int]:
        try:
            with open(os.path.join(self.job.root, "ckpt", "latest_checkpointed_iteration.txt")) as f:
                return int(f.read())
        except FileNotFoundError:
            return None

    def check_resumed(self, text: str, rank: int, version: int) -> None:
        if rank == 0:
            assert f"starting at iteration {version}" in text, text[-3000:]

    def check_end(self, reference: dict) -> None:
        with open(self.loss_files[0]) as f:
            losses = {r["it"]: r["hex"] for r in map(json.loads, f)}  # the last pass's value per iteration
        assert losses == {i: reference["losses"][str(i)]["hex"] for i in range(1, self.iters + 1)}
        assert read_json(self.out)["digests"] == reference["digests"]
        assert self.id not in jobs.list_jobs(self.shm_dir)  # Megatron's final save is on disk: freed


def megatron_reference(root: str, iters: int) -> dict:
    """The uninterrupted run without ftmem (no in_memory, no --ftmem-* flag)."""
    job = MegatronJob(MegatronIdentity.world, MegatronIdentity.PARALLEL, [], None, root, stock=True)
    job.args[job.args.index("--train-iters") + 1] = str(iters)
    job.run(os.path.join(root, "out.json"))
    for rank in range(job.world):
        assert "ftmem" not in job.log(rank), job.log(rank)[-3000:]
    return read_json(os.path.join(root, "out.json"))


# ---------------------------------------------------------------- one pass of a job

@dataclass
class Expected:
    """What the restart after a kill must restore, read off the job before it."""
    source: str  # "memory" or "disk"
    low: int
    high: int
    rebuilt: frozenset = frozenset()


@dataclass
class Pass:
    """One start of the job's ranks and what they printed since."""
    ident: object
    run: LocalJob
    start: int  # the version it resumes from (0: a fresh job)
    expected: Optional[Expected]
    log_at: list = field(default_factory=list)
    loss_at: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # per loss file: the newest step it printed in this pass
    began: float = field(default_factory=time.monotonic)
    restored_after: float = 0.0  # seconds from the start to every rank's restore line

    def text(self, rank: int) -> str:
        with open(os.path.join(self.ident.log_dir, f"rank{rank}.log"), errors="replace") as f:
            f.seek(self.log_at[rank])
            return f.read()

    def read_steps(self) -> None:
        for i, path in enumerate(self.ident.loss_files):
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self.loss_at[i])
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            self.loss_at[i] += len(complete)
            for line in complete.splitlines():
                self.steps[i] = max(self.steps[i], json.loads(line)["it"])

    def versions_seen(self) -> list[int]:
        """Per loss file, the version saved right after its newest step of this pass."""
        return [s + self.ident.step_offset if s >= 0 else self.start for s in self.steps]

    def tails(self) -> str:
        return "\n".join(f"--- rank {r} (this pass) ---\n{self.text(r)[-4000:]}" for r in range(self.ident.world))


def begin(ident, load: bool, expected: Optional[Expected]) -> Pass:
    def size(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    log_at = [size(os.path.join(ident.log_dir, f"rank{r}.log")) for r in range(ident.world)]
    loss_at = [size(p) for p in ident.loss_files]
    run = ident.start(load)
    start = expected.low if expected else 0  # refined once the restore is read
    return Pass(ident, run, start, expected, log_at, loss_at, [-1] * len(ident.loss_files))


def check_restore(p: Pass, where: str) -> None:
    """Every rank of a restarted pass restored one same version, as expected; a fresh
    pass restored nothing."""
    texts = [p.text(r) for r in range(p.ident.world)]
    found = [RESTORED.findall(t) for t in texts]
    if p.expected is None:
        assert not any(found), f"{where}: a fresh job restored something: {found}\n{p.tails()}"
        return
    e = p.expected
    assert all(len(f) == 1 for f in found), f"{where}: not one restore line per rank: {found}\n{p.tails()}"
    versions = {int(f[0][0]) for f in found}
    assert len(versions) == 1, f"{where}: the ranks restored different versions: {found}\n{p.tails()}"
    version = versions.pop()
    for rank, [(_, source, detail)] in enumerate(found):
        assert source == e.source, f"{where}: rank {rank} restored from {source}, expected {e}\n{p.tails()}"
        if source == "memory":
            assert ("rebuilt from parity" in detail) == (rank in e.rebuilt), \
                f"{where}: rank {rank}: {detail!r}, expected rebuilt ranks {sorted(e.rebuilt)}\n{p.tails()}"
    assert e.low <= version <= e.high, f"{where}: restored {version}, expected {e}\n{p.tails()}"
    p.start = version


def check_resumed(p: Pass, ended: bool) -> None:
    """The training script resumed where the restore says: checked for the ranks that
    went on to train (a loss line in this pass), or all of them once the job ended."""
    if p.expected is None:
        return
    p.read_steps()
    for rank in range(p.ident.world):
        printed = rank < len(p.steps) and p.steps[rank] >= 0  # DeepSpeed: rank r's file; Megatron: rank 0's
        if ended or printed:
            p.ident.check_resumed(p.text(rank), rank, p.start)


def restore_logged(p: Pass) -> bool:
    return all(RESTORED.search(p.text(r)) for r in range(p.ident.world))


def run_until(p: Pass, moment: tuple, where: str) -> bool:
    """Until ``moment`` (("restore",) or ("version", v)); True if the job ended by itself
    first (every rank exited 0). A rank exiting otherwise, or no progress within
    PASS_TIMEOUT, fails the test with the logs."""
    ended = []

    def reached() -> bool:
        codes = [proc.poll() for proc in p.run.procs]
        if any(c not in (None, 0) for c in codes):
            p.run.kill_all()
            pytest.fail(f"{where}: a rank failed (exit codes {codes}) before any kill\n{p.tails()}")
        if all(c == 0 for c in codes):
            ended.append(True)
            return True
        if moment[0] == "restore":
            return restore_logged(p)
        p.read_steps()
        return max(p.versions_seen()) >= moment[1]

    try:
        wait_until(reached, PASS_TIMEOUT, f"{where}: {moment}")
    except TimeoutError as e:
        hung(p, str(e))
    return bool(ended)


def finish(p: Pass, where: str) -> None:
    def ended() -> bool:
        return all(proc.poll() is not None for proc in p.run.procs)
    try:
        wait_until(ended, PASS_TIMEOUT, f"{where}: the end of the job")
    except TimeoutError as e:
        hung(p, str(e))
    codes = [proc.returncode for proc in p.run.procs]
    assert codes == [0] * p.ident.world, f"{where}: exit codes {codes}\n{p.tails()}"


def hung(p: Pass, what: str) -> None:
    """Fail with where every live rank is stuck: SIGABRT makes Python's faulthandler
    (PYTHONFAULTHANDLER, set by the tests) print each thread's stack into the rank's log."""
    live = [proc for proc in p.run.procs if proc.poll() is None]
    for proc in live:
        os.kill(proc.pid, signal.SIGABRT)
    try:
        wait_until(lambda: all(proc.poll() is not None for proc in live), 30, "the stack dumps")
    finally:
        p.run.kill_all()
    pytest.fail(f"{what} (a hang? the stacks of ranks still running are in their logs)\n{p.tails()}")


# ---------------------------------------------------------------- the loop

class KillLoop:
    """``trials`` kills (at least); with a ``plan`` of (victim kind, moment kind), each of
    those first, as soon as a pass allows it, the rest drawn by the seeded RNG."""

    def __init__(self, new_identity, trials: int, reference, two_nodes: bool, rng: random.Random,
                 plan: Sequence[tuple[str, str]] = ()):
        self.new_identity, self.trials, self.reference, self.rng = new_identity, trials, reference, rng
        self.two_nodes, self.plan = two_nodes, list(plan)
        # The last kill's delay after the last step: up to 2 s lands in the final save, the
        # teardown or after the end; a job that ended first starts a new identity and tries
        # again, which the short loops, with their fast ends, cannot afford often.
        self.end_delay = 0.3 if plan else 2.0
        self.summary: list[str] = []
        self.kinds_killed: set[tuple[str, str]] = set()  # (victim kind, moment kind) of each kill

    def _planned(self, p: Pass, fresh: bool, kinds: list[str]) -> Optional[tuple[str, str]]:
        """The first planned kill this pass allows, taken off the plan."""
        for kind, how in self.plan:
            protectable = p.start + 3 <= p.ident.iters  # a lost node needs a version of this pass protected
            if kind in kinds and (kind != "node" or protectable) and (how != "restore" or (not fresh and kind != "node")):
                self.plan.remove((kind, how))
                return kind, how
        return None

    def choose(self, p: Pass, fresh: bool, last: bool) -> tuple[tuple, float, str, list[int]]:
        """The moment, the extra delay, the victim kind and the node(s) it takes. The last
        trial kills the job at its end (the final save, the teardown, or after the job freed
        its memory); the others at a step a few versions on, or right after the restore."""
        ident, rng = p.ident, self.rng
        first = 3 if fresh else p.start + 1  # a fresh job: only once version 1 is protected
        kinds = ["rank", "all", "node"] + (["two_nodes"] if self.two_nodes and ident.disk_version() else [])
        planned = None if last else self._planned(p, fresh, kinds)
        kind = planned[0] if planned else rng.choice(kinds)
        if kind == "node" and p.start + 3 > ident.iters:
            kind = "rank"  # no version of this pass could be protected before the end
        lowest = min(p.start + 3 if kind == "node" else first, ident.iters)
        r = rng.random()
        if last:
            moment, delay = ("version", ident.iters), rng.uniform(0, self.end_delay)
        elif planned:
            moment = ("restore",) if planned[1] == "restore" else ("version", rng.randint(lowest, min(lowest + 3, ident.iters)))
            delay = rng.uniform(0, 0.5 if planned[1] == "restore" else 0.3)
        elif not fresh and kind != "node" and r < 0.1:
            moment, delay = ("restore",), rng.uniform(0, 0.5)
        else:
            moment, delay = ("version", rng.randint(lowest, min(lowest + 3, ident.iters))), rng.uniform(0, 0.3)
        nodes = rng.sample(range(ident.nodes), {"node": 1, "two_nodes": 2}.get(kind, 0))
        return moment, delay, kind, nodes

    def kill(self, p: Pass, kind: str, nodes: list[int]) -> None:
        """SIGKILL the victim; the launcher kills the rest a moment later; lost nodes lose
        their SMP and shared memory as the machine dies."""
        run, rng, ident = p.run, self.rng, p.ident
        if kind == "rank":
            nodes.append(rng.randrange(ident.world))  # ranks_per_node 1: rank n is node n
            run.kill(nodes[0])
        elif kind == "all":
            for rank in rng.sample(range(ident.world), ident.world):
                run.kill(rank)
        else:
            for node in nodes:
                run.kill(node)
                # A job that ended cleanly before the kill freed its memory already: nothing to lose.
                if ident.id in jobs.list_jobs(ident.shm_dir) and node in dict(jobs.node_dirs(ident.shm_dir, ident.id)):
                    jobs.lose_node(ident.shm_dir, ident.id, node)
        time.sleep(rng.uniform(0, 0.5))
        run.kill_all()

    def expect(self, p: Pass) -> Expected:
        """What the restart must restore, from the loss lines and ``ftmem status``."""
        ident = p.ident
        p.read_steps()
        seen = p.versions_seen()
        protected = max(seen) - 2 if max(seen) - 2 > p.start else p.start  # the save before the newest returned
        newest = max(p.start, min(seen))  # a version every rank committed was preceded by its lines
        held = jobs.status(ident.shm_dir, ident.id)["jobs"][0]["nodes"] if ident.id in jobs.list_jobs(
            ident.shm_dir) else []
        present = {n["node"] for n in held}
        common = set.intersection(*(set(n["versions"]) for n in held)) if held else set()
        missing = frozenset(range(ident.nodes)) - present
        if not common or len(missing) > ident.m:
            disk = ident.disk_version()
            assert disk is not None, f"memory cannot serve and nothing is on disk: {held}\n{p.tails()}"
            return Expected("disk", disk, disk)
        if not missing:
            return Expected("memory", max(common), max(common))
        marks = [n["protected"] for n in held if n["protected"] is not None]
        return Expected("memory", max([protected] + marks), min(max(common), max(newest, protected)),
                        rebuilt=missing)

    def run(self, shm_dir: str, root: str) -> None:
        self.current: Optional[Pass] = None
        try:
            self._run(shm_dir, root)
        finally:
            if self.current is not None:
                self.current.run.kill_all()  # whatever failed, no rank outlives the test
            for line in self.summary:
                log(line)

    def _run(self, shm_dir: str, root: str) -> None:
        started = time.monotonic()
        identities, kills, passes, killed_last = 0, 0, 0, False
        ident, p = None, None
        while True:
            if p is None:  # a new job identity
                identities += 1
                ident = self.new_identity(shm_dir, os.path.join(root, f"job{identities}"))
                p = begin(ident, load=False, expected=None)
            passes += 1
            self.current = p
            where = f"seed {SEED}, trial {kills + 1}, job {identities} ({ident.id}), pass {passes}"
            fresh = p.expected is None
            if not fresh:
                run_until(p, ("restore",), where)
                p.restored_after = time.monotonic() - p.began
                check_restore(p, where)
            if killed_last or p.start >= ident.iters:
                # The last restart runs to the end; so does one that resumed at the end
                # (it trains nothing; killing it in its teardown over and over tests nothing new).
                finish(p, where)
                check_resumed(p, ended=True)
                ident.check_end(self.reference)
                if killed_last:
                    break
                self.summary.append(f"{where}: resumed at {p.start}, the end: ran to it, bitwise")
                p = None
                continue
            last = kills + 1 >= self.trials and not self.plan
            moment, delay, kind, nodes = self.choose(p, fresh, last=last)
            ended = run_until(p, moment, where)
            time.sleep(delay)
            codes = [proc.poll() for proc in p.run.procs]
            if any(c not in (None, 0) for c in codes):
                p.run.kill_all()
                pytest.fail(f"{where}: a rank failed (exit codes {codes}) before the kill\n{p.tails()}")
            if ended or codes == [0] * ident.world:
                finish(p, where)
                check_restore(p, where)
                check_resumed(p, ended=True)
                ident.check_end(self.reference)
                self.summary.append(f"{where}: resumed at {p.start}, ended by itself before the kill: bitwise")
                p = None
                continue
            self.kill(p, kind, nodes)
            kills += 1
            self.kinds_killed.add((kind, "end" if last else moment[0]))
            killed_last = last
            check_resumed(p, ended=False)
            expected = self.expect(p)
            self.summary.append(f"{where}: resumed at {p.start} ({p.restored_after:.0f} s), {moment} +{delay:.2f} s, "
                                f"killed {kind} {nodes} ({time.monotonic() - p.began:.0f} s), loss lines up to "
                                f"version {max(p.versions_seen())}; restart must restore {expected}")
            p = begin(ident, load=True, expected=expected)
        self.summary.append(f"{kills} kills, {identities} job identities, {passes} passes: "
                            f"{time.monotonic() - started:.0f} s wall")


# ---------------------------------------------------------------- the loops

# Each victim kind at a step, one of them right after a restore, and the last kill at the end.
PLAN = [("rank", "version"), ("all", "restore"), ("node", "version")]
PERSIST_PLAN = [("rank", "restore"), ("all", "version"), ("node", "version"), ("two_nodes", "version")]


def check_covered(loop: KillLoop, plan: Sequence[tuple[str, str]]) -> None:
    """The loop killed every victim kind at every moment kind its plan names, and at the end."""
    missing = set(plan) - loop.kinds_killed
    assert not missing, f"the loop never killed {sorted(missing)}; it killed {sorted(loop.kinds_killed)}"
    assert any(how == "end" for _, how in loop.kinds_killed), loop.kinds_killed


@pytest.mark.timeout(2400)  # each pass has its own bounded waits (PASS_TIMEOUT); this is the whole loop
@pytest.mark.parametrize("persist", [
    pytest.param(False, id="memory", marks=pytest.mark.fault(
        "random SIGKILLs", phase="at random moments", framework="DeepSpeed ZeRO-1",
        expect="resumes bitwise from memory: every restart from what the job before left (rebuilt from parity "
               "after a node loss), none hangs")),
    pytest.param(True, id="persist", marks=pytest.mark.fault(
        "random SIGKILLs", phase="at random moments", framework="DeepSpeed ZeRO-1",
        expect="resumes bitwise from disk where memory cannot serve (two nodes lost), else from memory; none "
               "hangs")),
])
def test_deepspeed_random_kills(persist, shm_dir, tmp_path, monkeypatch, request):
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # a hung rank's stacks, see hung()
    full = request.config.getoption("--full-faults")
    iters, plan = (DS_ITERS, []) if full else (SHORT_DS_ITERS, PERSIST_PLAN if persist else PLAN)
    reference = deepspeed_reference(str(tmp_path / "reference"), iters)
    loop = KillLoop(lambda shm, root: DeepSpeedIdentity(shm, root, persist, iters), DS_TRIALS if full else len(plan) + 1,
                    reference, two_nodes=persist, rng=random.Random(f"{SEED}-deepspeed-{persist}"), plan=plan)
    loop.run(shm_dir, str(tmp_path))
    check_covered(loop, plan)


@pytest.mark.timeout(1200)
@pytest.mark.fault("random SIGKILLs", phase="at random moments", framework="Megatron (megatron-core)",
                   expect="resumes bitwise from memory: every restart from what the job before left (rebuilt from "
                          "parity after a node loss), none hangs")
def test_megatron_random_kills(shm_dir, tmp_path, monkeypatch, request):
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    full = request.config.getoption("--full-faults")
    iters, plan = (MEGATRON_ITERS, []) if full else (SHORT_MEGATRON_ITERS, PLAN)
    reference = megatron_reference(str(tmp_path / "reference"), iters)
    loop = KillLoop(lambda shm, root: MegatronIdentity(shm, root, iters), MEGATRON_TRIALS if full else len(plan) + 1,
                    reference,
                    two_nodes=False, rng=random.Random(f"{SEED}-megatron"), plan=plan)
    loop.run(shm_dir, str(tmp_path))
    check_covered(loop, plan)
