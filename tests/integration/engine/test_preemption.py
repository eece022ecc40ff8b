"""The preemption signal on one rank without a persistent tier, and with a handler of the
script's own, and the job's decision whether a SIGTERM is a preemption where rank 0 serves the
store (the flushes with a tier run through the frameworks: tests/integration/deepspeed and
megatron)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from harness.common import job_id
from harness.ranks import RANK_ENV, REPO, LocalJob, free_port, script_outputs, wait_until

SCRIPT = textwrap.dedent("""
    import signal, sys, time
    import torch
    from ftmem import SnapshotEngine
    if sys.argv[2] == "own handler":
        signal.signal(signal.SIGTERM, lambda *a: (print("the script's handler ran", flush=True), sys.exit(3)))
    engine = SnapshotEngine({"shm_dir": sys.argv[1]})
    engine.save({"w": torch.ones(4)}, 1).wait_protected()
    print("ready", flush=True)
    while True:
        time.sleep(60)
""")


def _start(shm_dir: str, how: str, tmp_path) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "rank.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, shm_dir, how], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, FTMEM_JOB_ID=job_id()))
    wait_until(lambda: "ready" in open(log).read() or proc.poll() is not None, 60, "the engine's first save")
    return proc, log


@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="between saves", framework="engine (toy trainer)",
                   expect="ends every rank within 60 s by SIGTERM, saying what memory holds is lost without a "
                          "persistent tier")
def test_without_a_persistent_tier_sigterm_says_what_is_lost_and_ends_the_process_as_sigterm_does(shm_dir, tmp_path):
    proc, log = _start(shm_dir, "ftmem's", tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
    said = open(log).read()
    assert ("ftmem: SIGTERM: no persistent tier (\"ftmem.persist\") to flush to: what memory holds (version 1 "
            "protected, 1 saved) is lost if the job's machines go") in said, said


@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="between saves", framework="engine (toy trainer)",
                   expect="ends every rank within 60 s through the script's own SIGTERM handler, which keeps the "
                          "signal")
def test_a_handler_the_script_set_first_keeps_the_signal(shm_dir, tmp_path):
    proc, log = _start(shm_dir, "own handler", tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 3
    finally:
        proc.kill()
    said = open(log).read()
    assert "SIGTERM has a handler of its own" in said and "the script's handler ran" in said, said
    assert "no persistent tier (\"ftmem.persist\") to flush to" not in said


ASYNCIO = textwrap.dedent("""
    import asyncio, signal, sys
    import torch
    from ftmem import SnapshotEngine

    def start_engine():
        engine = SnapshotEngine({"shm_dir": sys.argv[1]})
        engine.save({"w": torch.ones(4)}, 1).wait_protected()
        return engine

    async def main():
        loop = asyncio.get_running_loop()
        engine = start_engine() if sys.argv[2] == "loop after ftmem" else None
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the loop takes the signal wakeup fd
        engine = engine or start_engine()
        print("ready", flush=True)
        await asyncio.sleep(120)  # the main thread waits in the loop's selector

    asyncio.run(main())
""")


@pytest.mark.parametrize("order", ["loop after ftmem", "loop before ftmem"])
@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="between saves", framework="engine (toy trainer)",
                   expect="ends every rank within 60 s by SIGTERM, an asyncio loop owning the wakeup fd "
                          "notwithstanding")
def test_an_event_loop_that_owns_the_signal_wakeup_fd_does_not_keep_ftmem_from_hearing_sigterm(order, shm_dir,
                                                                                                tmp_path):
    """asyncio's add_signal_handler takes the wakeup fd. Taken after ftmem's start, ftmem's
    watch was never woken, and its handler, which leaves the signal to the watch, swallowed
    SIGTERM: the process ran on. Taken before, ftmem did not handle the signal at all. The
    loop wakes the main thread for any signal, and ftmem's handler then wakes the watch."""
    log = str(tmp_path / "rank.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", ASYNCIO, shm_dir, order], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, FTMEM_JOB_ID=job_id()))
    try:
        wait_until(lambda: "ready" in open(log).read() or proc.poll() is not None, 60, "the engine's first save")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
    said = open(log).read()
    assert "ftmem: SIGTERM: no persistent tier (\"ftmem.persist\") to flush to" in said, said


@pytest.mark.fault("SIGTERM to the whole job (preemption)", phase="at the job's end", framework="adapter runtime",
                   expect="ends every rank within the grace by SIGTERM, the newest version flushed to the tier")
def test_a_main_thread_inside_a_store_get_does_not_keep_the_preemption_from_its_decision(shm_dir, tmp_path):
    """Both ranks' main threads wait in a ``get`` on the job's store (a framework waiting for a
    key a slow rank has not set) when SIGTERM comes to every rank. A store client serves one
    call at a time, so the preemption's decision, made on the default client, waited behind the
    get until the grace ran out, and nothing was flushed. On a connection of its own it goes
    through: the newest version reaches the persistent tier, and both ranks end by SIGTERM."""
    persist, job = tmp_path / "persist", job_id()
    job_env = {"SHM_DIR": shm_dir}
    with LocalJob("tests.harness.lifecycle_job", ["--out", str(tmp_path), "--steps", "3", "--persist", str(persist),
                                                  "--persist-interval", "100", "--end", "store-get"], 2, job,
                  str(tmp_path), env=job_env) as ranks:
        ranks.wait_for(lambda: all("ends with store-get" in ranks.log(r) for r in range(2)), 120,
                       "both main threads in the store's get")
        for proc in ranks.procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(120) for proc in ranks.procs] == [-signal.SIGTERM] * 2, ranks.tails()
    assert "flushed version 3 to" in ranks.log(0) and "at SIGTERM" in ranks.log(0), ranks.tails()
    assert (persist / "newest").read_text() == "v3"


TEARDOWN = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from ftmem._common.job_store import StandingConnection
    from ftmem._engine.preemption import whole_job_told
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=60))
    if rank == 1:  # the failure a teardown follows
        os._exit(0)
    # The decision's keys, as ftmem keeps them: on the store itself, outside the default group's prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False)
    def dead_here():
        if rank == 2:  # a rank that reads /dev/shm slower than rank 0 on a crowded node: after its decision
            while not store.check(["ftmem/preemption/run/answer"]):
                time.sleep(0.01)
            time.sleep(0.3)
        return [1]
    print("decided:", whole_job_told(rank, 3, dead_here, 10.0,
                                     StandingConnection(dist.distributed_c10d._get_default_store(), 10.0),
                                     "ftmem/preemption/run"), flush=True)
    os._exit(0)  # as the engine ends the process: rank 0's ends the store with it
""")


@pytest.mark.fault("rank exits abruptly (os._exit)", phase="at the job's end", framework="engine (toy trainer)",
                   expect="refuses with a reason: every rank reads that the SIGTERM is a teardown, no preemption (rank "
                          "1 died first)")
def test_the_rank_that_serves_the_store_ends_only_once_the_others_read_why_this_is_no_preemption(tmp_path):
    """Rank 0 serves the job's store (the deepspeed launcher's env://). Rank 1 died, so the
    SIGTERM that follows is a teardown: rank 0 decides so at once; rank 2 gets there after that
    decision, and must read the same reason, not find the store gone with rank 0."""
    env = dict(os.environ, **RANK_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    said = script_outputs(TEARDOWN, [[str(rank)] for rank in range(3)], 120, env)
    why = "decided: rank(s) [1] of this host had died first, as in a teardown after a failure"
    assert why in said[0] and why in said[2], said
