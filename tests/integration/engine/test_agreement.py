"""The one way ranks agree through the job's store (ftmem/_common/agreement.py), at its edges:
the rank whose process serves the store ending first, a stale answer of an earlier attempt, a
rank late to a decision taken without it, a wait that runs out, an objection that does not
wait. On a real TCP store, with real processes where one's end is the point."""
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness.common import REPO
from harness.ranks import free_port, script_outputs
from benchmarks.bench_control_plane import CountedStore
from ftmem._common.agreement import NODE_WAIT_S, REQUESTS_PER_DECISION, Decision, unanimous
from ftmem._common.collective import NOTE_AFTER_S, Arrivals
from ftmem._common.job_store import PROBE_REQUESTS, StandingConnection
from ftmem._engine.preemption import whole_job_told
from ftmem._shm import node_round
from ftmem._shm.node_round import SharedMemoryRound
from ftmem.errors import CollectiveNotJoined

READERS = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from ftmem._common.agreement import Decision
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    decision = Decision(store, "ftmem/test/run", rank, 3)
    if rank == 0:
        decision.propose("flush")
        print("rank 0: read by", decision.read(live=3), flush=True)
        os._exit(0)  # as a rank ends by its signal: the store it serves ends with it
    while not decision.answered():  # as a rank that polls
        time.sleep(0.05)
    time.sleep(0.3 * rank)  # slow to read, as a crowded node's rank is
    print(f"rank {rank}: read", decision.answer(), decision.read(), flush=True)
""")


def test_the_rank_that_serves_the_store_ends_only_once_the_others_have_read_the_answer():
    """Rank 0's process serves the store and ends right after its decision, as a rank does at
    a signal. The others, slow to read, must get the answer, not find the store gone."""
    port = str(free_port())
    said = script_outputs(READERS, [[str(rank), port] for rank in range(3)], 60)
    assert "rank 0: read by 3" in said[0], said
    assert "rank 1: read flush" in said[1] and "rank 2: read flush" in said[2], said


def store_and_clients(n: int) -> tuple:
    """A TCP store served here, and ``n`` clients of it (a rank's each)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=30)) for _ in range(n)]
    return server, clients


def test_an_answer_of_an_earlier_attempt_is_never_read_as_this_one_s():
    """A store that outlives an attempt (torchrun's agent's) holds the last attempt's answer;
    a decision is named by its run, and the new run's sees nothing of it."""
    server, (old, new) = store_and_clients(2)
    Decision(old, "ftmem/preemption/run-1", 0, 2).propose("rank(s) [1] of this host had died first")
    fresh = Decision(new, "ftmem/preemption/run-2", 0, 2)
    assert not fresh.answered() and fresh.arrivals() == 0 and fresh.missing() == [1]
    assert fresh.propose("go") == "go"


def test_a_rank_late_to_a_decision_taken_without_it_follows_that_answer():
    """Rank 1 gave up waiting and put its answer; rank 0, late, proposes another and gets
    rank 1's: every rank takes the first answer, whenever it comes."""
    server, (early, late) = store_and_clients(2)
    first = Decision(early, "ftmem/rendezvous/0", 1, 2)
    first.arrive()
    assert first.wait(0.2) is None
    assert first.propose("abandoned") == "abandoned"
    second = Decision(late, "ftmem/rendezvous/0", 0, 2)
    assert second.arrive() == 2 and second.propose("go") == "abandoned"


def test_a_wait_that_runs_out_names_the_ranks_that_did_not_come():
    server, (client,) = store_and_clients(1)
    decision = Decision(client, "ftmem/end/run", 1, 4)
    decision.arrive()
    started = time.monotonic()
    assert decision.wait(0.5) is None and time.monotonic() - started < 10
    assert decision.missing() == [0, 2, 3]


def test_a_rank_with_an_objection_does_not_wait_and_every_rank_gets_the_first_objection():
    """The job's end: a rank that failed objects at once, without waiting for the others; the
    ranks that finished, arriving later, all get its objection; none waits the whole bound."""
    server, connections = store_and_clients(3)
    answers, took = {}, {}

    def rank_ends(rank: int, objection) -> None:
        time.sleep(0.2 * rank)
        started = time.monotonic()
        answers[rank] = unanimous(StandingConnection(connections[rank], 30.0), "ftmem/end/run", rank, 3, objection,
                                  30.0)
        took[rank] = time.monotonic() - started

    threads = [threading.Thread(target=rank_ends, args=(rank, "it ended with sys.exit(3)" if rank == 0 else None))
               for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {r: "rank 0: it ended with sys.exit(3)" for r in range(3)}, answers
    assert max(took.values()) < 10, took  # the bound was 30 s
    assert unanimous(StandingConnection(server, 30.0), "ftmem/end/run-2", 0, 1, None, 30.0) is None  # one rank alone


def _told_apart(arrive_after_s: dict, dead_here: dict, wait_s: float, world: int = 4) -> tuple:
    """Ranks told to stop ``arrive_after_s[rank]`` seconds apart, each deciding with
    ``whole_job_told`` on a connection of its own to one real store, counting its requests:
    (each rank's answer, its requests, its seconds from its signal to its answer)."""
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    answers, requests, took = {}, {}, {}

    def told(rank: int) -> None:
        store = CountedStore("127.0.0.1", server.port, 30.0)
        time.sleep(arrive_after_s[rank])
        started = time.monotonic()
        answers[rank] = whole_job_told(rank, world, dead_here.get(rank, lambda: []), wait_s,
                                       StandingConnection(store, wait_s), "ftmem/preemption/run")
        took[rank], requests[rank] = time.monotonic() - started, len(store.requests)

    threads = [threading.Thread(target=told, args=(rank,)) for rank in arrive_after_s]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers, requests, took


def test_ranks_told_to_stop_wait_for_the_last_one_told_on_the_store_without_polling_it():
    """A scheduler's SIGTERMs reach a job's ranks over a second or two. The ranks told first
    wait for the last one on the answer's key: a few requests each, however long they wait
    (polling the store every 50 ms made 2 requests per poll per rank: ~160,000 a second at
    8,000 ranks)."""
    answers, requests, _ = _told_apart({0: 0.0, 1: 0.1, 2: 0.2, 3: 1.5}, {}, 10.0)
    assert answers == {rank: None for rank in range(4)}, answers
    # The connection's check, then arrive (2), the wait, the answer, the read.
    assert max(requests.values()) <= PROBE_REQUESTS + REQUESTS_PER_DECISION, requests


def test_a_rank_of_this_host_that_dies_while_the_others_wait_ends_every_rank_s_wait_as_a_teardown():
    """Rank 3 is never told: it died, on rank 0's host, after rank 0 began to wait. Rank 0's
    watch of its host finds it and puts the teardown's answer, which ends every rank's wait
    at once rather than at the end of the 10 s bound."""
    died = time.monotonic() + 0.5
    answers, _, took = _told_apart({0: 0.0, 1: 0.0, 2: 0.0}, {0: lambda: [3] if time.monotonic() > died else []},
                                   10.0)
    why = "rank(s) [3] of this host had died first, as in a teardown after a failure"
    assert answers == {rank: why for rank in range(3)}, answers
    assert max(took.values()) < 10, took


def _connections_to(port: int) -> set[str]:
    """The client ends (address:port) of the TCP connections to ``port`` that this machine holds
    or closed within the last minute: open, or in TIME_WAIT (the end that closes first keeps that
    state for a minute), so that a connection made and dropped within a call is seen too. (A set,
    not a count: an earlier connection's end may leave the table meanwhile.)"""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # torch's store connects over either
        with open(table) as f:
            rows += [line.split() for line in f.readlines()[1:]]
    return {row[1] for row in rows if int(row[2].rsplit(":", 1)[1], 16) == port}


def gloo_pair(clients: list, bound_s: float) -> list:
    """A real gloo group of two over ``clients`` (each rank's connection), joined in threads,
    its operations timing out at ``bound_s`` as the protection's do."""
    groups: dict = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("gloo", clients[rank]), rank, 2,
                                             timedelta(seconds=bound_s))

    joining = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join(60)
    return [groups[0], groups[1]]


def test_a_late_collective_is_noted_and_its_latecomers_named_over_the_connection_made_at_the_start():
    """When a rank is late to a protection's collective, every other rank notes it on the store
    within the same second: over a connection made at the engine's start, not one made then (a
    new connection at every rank at once, each looked up by name on the store's one serving
    thread). A real gloo group of two, its operations timing out at the bound as the
    protection's do; rank 1 never comes."""
    server, clients = store_and_clients(2)
    bound_s = NOTE_AFTER_S + 1
    groups = gloo_pair(clients, bound_s)
    arrivals = Arrivals(StandingConnection(server, NOTE_AFTER_S), "ftmem/arrivals/run/rounds", 0, [0, 1])
    before = _connections_to(server.port)
    posted = time.monotonic()
    work = groups[0].allreduce([torch.ones(1)])
    with pytest.raises(CollectiveNotJoined, match=r"the test's collective: ranks \[1\] did not come within 3 s"):
        arrivals.wait([work], "the test's collective", bound_s, posted)
    assert not _connections_to(server.port) - before  # no connection made during the wait


def test_a_point_to_point_peer_that_comes_after_the_note_is_waited_for_and_one_that_never_comes_is_named():
    """The protection's exchange goes point to point. A gloo send or receive whose wait runs out
    closes its connection to the peer, so a wait cut short to note the latecomers can never be
    resumed: a peer that comes after the note (3 s late here, past NOTE_AFTER_S) must still get
    its bytes, and the sender's arrival is on the store. Then a peer that never comes is named
    once the bound runs out, not a note's wait after it. A real gloo group of two, in threads."""
    server, clients = store_and_clients(2)
    bound_s = NOTE_AFTER_S + 4
    groups = gloo_pair(clients, bound_s)
    arrivals = Arrivals(StandingConnection(server, NOTE_AFTER_S), "ftmem/arrivals/run/column", 0, [0, 1])
    received = torch.zeros(1000)

    def receive_late() -> None:
        time.sleep(NOTE_AFTER_S + 1)
        groups[1].recv([received], 0, 7).wait()

    receiver = threading.Thread(target=receive_late)
    receiver.start()
    posted = time.monotonic()
    arrivals.wait([groups[0].send([torch.arange(1000.0)], 1, 7)], "the test's exchange", bound_s, posted)
    receiver.join(30)
    assert torch.equal(received, torch.arange(1000.0))
    noted = Decision(server, "ftmem/arrivals/run/column/1", 1, 2)
    assert noted.arrivals() == 1 and noted.missing() == []  # rank 0 noted that it came, and only rank 0

    posted = time.monotonic()
    with pytest.raises(CollectiveNotJoined, match=r"the test's exchange: ranks \[1\] did not come within 6 s"):
        arrivals.wait([groups[0].send([torch.ones(10)], 1, 8)], "the test's exchange", bound_s, posted)
    assert time.monotonic() - posted < bound_s + NOTE_AFTER_S / 2


# -- a decision made node by node ------------------------------------------------------------
@pytest.fixture
def store_elsewhere():
    """The job's store served by a process of its own, as torchrun's agent serves it (a rank
    whose process serves the store waits for the others' reads, which would count here): its
    port, and the process."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_control_plane", "--serve"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), proc
    finally:
        proc.kill()
        proc.wait()


def _by_node(port: int, shm, decide, world: int = 6, per_node: int = 3, late: dict = {},
             connect=lambda port: CountedStore("127.0.0.1", port, 30.0)) -> tuple:
    """``world`` ranks in threads, ``per_node`` a node, each node's round in a directory of its
    own under ``shm``, each rank deciding with ``decide(rank, connection, round)`` on a
    connection of its own to the store at ``port`` (``connect(port)``), ``late[rank]`` seconds
    after the others (never, where negative): (each rank's answer, its requests to the store,
    its seconds to its answer)."""
    answers, requests, took = {}, {}, {}

    def rank_decides(rank: int) -> None:
        store = connect(port)
        node_dir = shm / f"node{rank // per_node}"
        os.makedirs(node_dir, mode=0o700, exist_ok=True)
        node_round = SharedMemoryRound(str(node_dir), "ftmem/test/run", range(rank // per_node * per_node,
                                                                               (rank // per_node + 1) * per_node), rank)
        time.sleep(late.get(rank, 0.0))
        started = time.monotonic()
        try:
            answers[rank] = decide(rank, StandingConnection(store, 30.0), node_round)
        except Exception as e:
            answers[rank] = f"raised {e}"
        took[rank], requests[rank] = time.monotonic() - started, len(getattr(store, "requests", ()))

    threads = [threading.Thread(target=rank_decides, args=(rank,)) for rank in range(world) if late.get(rank, 0) >= 0]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers, requests, took


def test_a_node_s_ranks_decide_through_one_speaker_and_the_others_ask_the_store_nothing(store_elsewhere, tmp_path,
                                                                                       monkeypatch):
    """The job's end, two nodes of three ranks: the last rank of each node to come speaks for
    it on the store, and its node's others take the answer from the node's shared memory,
    woken by their speaker (their own looks at the file are a minute apart here). The store
    serves the two speakers only, whatever the ranks a node; the round's files go once every
    rank of the node has the answer."""
    monkeypatch.setattr(node_round, "LOOK_S", 60.0)
    port, _ = store_elsewhere
    answers, requests, took = _by_node(port, tmp_path, lambda rank, store, node: unanimous(
        store, "ftmem/end/run", rank, 6, None, 30.0, node), late={2: 0.3, 4: 0.6})
    assert answers == {rank: None for rank in range(6)}, answers
    assert max(took.values()) < 20, took
    speakers = sorted(rank for rank, n in requests.items() if n)
    assert speakers == [2, 4], requests  # each node's last to come
    assert max(requests.values()) <= PROBE_REQUESTS + REQUESTS_PER_DECISION, requests
    assert not list((tmp_path / "node0" / "rounds").iterdir()) and not list((tmp_path / "node1" / "rounds").iterdir())


@pytest.mark.parametrize("objector", [4, 1], ids=["of-the-node", "of-another-node"])
def test_an_objection_reaches_the_ranks_of_a_node_without_a_speaker(store_elsewhere, tmp_path, objector):
    """Rank 5 never comes to the job's end (hung), so its node has no speaker; a rank objects at
    once. Of its node, rank 3 hears it through the node; of another node, on the store, once it
    waited for its node's speaker longer than a node's ranks come apart. No rank waits the 30 s
    bound."""
    port, _ = store_elsewhere
    answers, _, took = _by_node(port, tmp_path, lambda rank, store, node: unanimous(
        store, "ftmem/end/run", rank, 6, "it ended with sys.exit(3)" if rank == objector else None, 30.0, node),
        late={5: -1})
    assert answers == {rank: f"rank {objector}: it ended with sys.exit(3)" for rank in range(5)}, answers
    assert max(took.values()) < NODE_WAIT_S + 10, took


def test_a_rank_that_never_comes_is_named_by_its_node_s_ranks(store_elsewhere, tmp_path):
    """Rank 5 never comes to the job's end. Its node has no speaker: rank 3 and 4, once their
    wait runs out, name it from the node's files; node 0's speaker names node 1's ranks absent
    from the store. Whichever is put first holds for every rank, and it names rank 5."""
    port, _ = store_elsewhere
    answers, _, took = _by_node(port, tmp_path, lambda rank, store, node: unanimous(
        store, "ftmem/end/run", rank, 6, None, 1.0, node), late={5: -1})
    assert len(set(answers.values())) == 1 and len(answers) == 5, answers
    assert "5]" in answers[0] and "did not come within 1 s" in answers[0], answers
    assert max(took.values()) < 10, took


def test_a_store_that_fails_under_a_node_s_speaker_is_told_to_the_node_s_ranks(store_elsewhere, tmp_path):
    """The store is gone when node 0's speaker comes: its ranks hear why from it at once, not
    at the end of their 30 s wait."""
    port, proc = store_elsewhere
    answers, _, took = _by_node(port, tmp_path, lambda rank, store, node: (
        proc.kill(), proc.wait(), unanimous(store, "ftmem/end/run", rank, 3, None, 30.0, node))[-1]
        if rank == 2 else unanimous(store, "ftmem/end/run", rank, 3, None, 30.0, node), world=3, late={2: 0.5},
        connect=lambda port: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                           timeout=timedelta(seconds=30)))
    assert answers[2].startswith("raised"), answers
    assert answers[0] == answers[1] and answers[0].startswith("the job's store did not answer ("), answers
    assert max(took[0], took[1]) < 10, took


def test_a_preemption_decided_node_by_node_flushes_and_a_death_on_the_host_is_a_teardown(store_elsewhere, tmp_path):
    """Every rank told, over half a second: the answer is the go, through each node's speaker.
    Then rank 5 is never told: it died, on the host of rank 3 and 4, after they began to wait
    for their node's speaker (which never comes): the first of them to come, watching the host,
    puts the teardown at once (not once their wait for a speaker ran out), and every rank
    follows it."""
    port, _ = store_elsewhere
    answers, requests, _ = _by_node(port, tmp_path / "told", lambda rank, store, node: whole_job_told(
        rank, 6, lambda: [], 10.0, store, "ftmem/preemption/run", node), late={1: 0.2, 3: 0.5})
    assert answers == {rank: None for rank in range(6)}, answers
    assert sorted(rank for rank, n in requests.items() if n) == [1, 3], requests

    died = time.monotonic() + 0.5
    node_1_host = lambda: [5] if time.monotonic() > died else []  # noqa: E731
    answers, _, took = _by_node(port, tmp_path / "teardown", lambda rank, store, node: whole_job_told(
        rank, 6, node_1_host if rank in (3, 4) else lambda: [], 10.0, store, "ftmem/preemption/run-2", node),
        late={5: -1})
    why = "rank(s) [5] of this host had died first, as in a teardown after a failure"
    assert answers == {rank: why for rank in range(5)}, answers
    assert max(took.values()) < NODE_WAIT_S, took


def test_a_rank_without_its_node_s_round_decides_alone_and_is_never_counted_twice(store_elsewhere, tmp_path):
    """Rank 1 cannot make its node's round (its node's directory is gone): SharedMemoryRound.of
    says so and gives none, and rank 1 arrives on the store for itself. Its node's round never
    completes without it, so its node-mate is never counted by a speaker as well: the job's end
    is never agreed on a count that includes a rank twice. Every rank gets the same no, naming
    the rank missing from the round (rank 0's view) or from the store (the others')."""
    from ftmem._common.identity import RankIdentity
    lost = RankIdentity(job="job-1", rank=1, world_size=4, ranks_per_node=2, shm_dir=str(tmp_path / "gone"),
                        origin=None)
    assert SharedMemoryRound.of(lost, "ftmem/end/run") is None
    assert SharedMemoryRound.of(dataclasses.replace(lost, ranks_per_node=1), "ftmem/end/run") is None
    port, _ = store_elsewhere
    answers, _, _ = _by_node(port, tmp_path, lambda rank, store, node: unanimous(
        store, "ftmem/end/run", rank, 4, None, NODE_WAIT_S + 1, None if rank == 1 else node), world=4, per_node=2)
    assert len(answers) == 4 and len(set(answers.values())) == 1, answers
    assert re.fullmatch(rf"ranks \[[01]\] did not come within {NODE_WAIT_S + 1:g} s", answers[0]), answers
