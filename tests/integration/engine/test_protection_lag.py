"""Protection runs behind training: a save waits for its copy at most, never for the
protection of an older version, and what a crash restores while protection lags is the
newest version every rank holds whole, or after a node loss the newest protected one."""
import glob
import os
import re
import threading

import pytest
import torch

from harness.common import make_engine
from harness.ranks import wait_until
from harness.toy import TIMEOUT, TrainJob, reference_run
from ftmem import ShmBudgetError
from ftmem._common import testhooks


@pytest.fixture
def held_protection(monkeypatch, tmp_path):
    """Hold this process's protection of version 2 before its exchange, until a file in the
    fixture's folder lets it go on."""
    monkeypatch.setenv("FTMEM_TEST_HOOK_DIR", str(tmp_path))
    monkeypatch.setattr(testhooks, "_spec", "before_protect:hold:rank=0:version=2")
    return tmp_path


@pytest.mark.parametrize("slots", [3, 2])
def test_saves_go_on_while_a_protection_is_held_back(shm_dir, held_protection, ftmem_log, slots):
    engine = make_engine(shm_dir, slots=slots)
    state = {"w": torch.zeros(1 << 16)}
    engine.save(state, 1).wait_protected()
    state["w"].fill_(2)
    handles = [engine.save(state, 2)]
    wait_until(lambda: os.path.exists(held_protection / "paused.rank0.v2"), TIMEOUT, "the protection of 2 to be held")

    def train_on():
        for version in range(3, 7):
            state["w"].fill_(version)
            handles.append(engine.save(state, version))
            handles[-1].wait_reusable()

    # The protection of 2 is held: a save, or a copy, that waited for it would never return.
    saving = threading.Thread(target=train_on, daemon=True)
    saving.start()
    saving.join(TIMEOUT)
    if saving.is_alive():
        open(held_protection / "resume.rank0.v2", "w").close()  # let the engine close
        pytest.fail("the saves after version 2 waited for its protection")
    wait_until(lambda: 6 in engine.versions() or handles[-1].skipped, TIMEOUT, "version 6's commit")
    lag = engine.lag()
    assert (lag.newest_saved, lag.newest_protected, lag.versions) == (6, 1, 5)
    if slots == 3:  # the protected version, the one being protected, the newest copy
        assert engine.versions() == [1, 2, 6] and not any(h.skipped for h in handles)
    else:  # no slot for a copy while 1 is kept and 2 protected: the saves after 2 are skipped
        assert engine.versions() == [1, 2] and [h.skipped for h in handles] == [False] + [True] * 4
        assert "version 3 skipped" in ftmem_log.text()
    open(held_protection / "resume.rank0.v2", "w").close()
    engine.wait_protected()
    newest = 6 if slots == 3 else 2
    assert engine.lag().newest_protected == newest and engine.lag().unprotected == (3 if slots == 3 else 4)
    assert [h.protected for h in handles] == [True, False, False, False, slots == 3]
    assert "protection is 4 version(s) behind the saves: version 2 protected, 6 saved" in ftmem_log.text()
    assert ("protection caught up: version 6" in ftmem_log.text()) == (slots == 3)
    assert torch.equal(engine.restore().state["w"], torch.full((1 << 16,), float(newest)))
    engine.close(job_finished=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), 2)


@pytest.mark.parametrize("loss", [
    pytest.param("processes", id="processes", marks=pytest.mark.fault(
        "every rank SIGKILLed", phase="during protection", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: version 6, which every rank holds whole, its protection still held")),
    pytest.param("node", id="node", marks=pytest.mark.fault(
        "node lost (its ranks, SMP and memory)", phase="during protection", framework="engine (toy trainer)",
        expect="resumes bitwise from memory: the version protected before the held one, node 1 rebuilt from "
               "parity")),
])
def test_a_crash_while_protection_lags_restores_the_newest_version_it_can(shm_dir, tmp_path, reference, loss):
    """Rank 0's protection of a version >= 2 is held while both ranks save on to 6 and stop
    there (the toy trainer waits for 6 to be protected). A crash of processes then restores
    6, which every rank holds whole; the loss of node 1 restores the version protected
    before the held one, rebuilt from parity. Both train on bitwise like a run without ftmem."""
    job, hooks = TrainJob(shm_dir, tmp_path / "out", 2), tmp_path / "hooks"
    os.makedirs(hooks)
    hold = {0: {"FTMEM_TEST_HOOK": "before_protect:hold:rank=0:version=2+", "FTMEM_TEST_HOOK_DIR": str(hooks)}}
    # Version 0 is protected before version 1 is saved: else the first round could take a version >= 2
    # and be held, with nothing protected before it for the node loss to restore.
    with job.start("--stop-after", "6", "--protect-first", rank_env=hold) as run:
        run.wait_for(lambda: glob.glob(str(hooks / "paused.rank0.v*")), TIMEOUT, "rank 0's protection to be held")
        run.wait_for(lambda: 6 in job.held(0) and 6 in job.held(1), TIMEOUT, "both ranks to commit version 6")
        run.kill(0)
        run.kill(1)
    held = int(re.search(r"v(\d+)$", glob.glob(str(hooks / "paused.rank0.v*"))[0]).group(1))
    report = job.status()
    assert report["newest_held"] == 6 and 0 <= report["newest_protected"] < held <= 6, report
    if loss == "processes":
        job.restart_and_check(reference, expect_version=6)
    else:
        job.lose_node(1)
        job.restart_and_check(reference, expect_version=report["newest_protected"], rebuilt_ranks=(1,))


def test_a_budget_that_holds_two_versions_not_three_runs_with_two_and_says_so_once(shm_dir, ftmem_log):
    engine = make_engine(shm_dir, shm_budget="2.5MiB")  # one rank of 1 MiB: 3 versions need 3 MiB
    for version in range(1, 5):
        engine.save({"w": torch.full((1 << 18,), float(version))}, version).wait_protected()
    assert engine.store.data_slots == 2 and engine.versions() == [3, 4]
    assert not os.path.exists(engine.store.slot_path(2))
    assert ftmem_log.text().count("keeps 2 versions in memory, not 3") == 1, ftmem_log.text()
    engine.close(job_finished=True)


def test_a_first_save_beyond_the_budget_is_refused_with_the_numbers_and_a_later_one_loses_nothing(shm_dir):
    small = make_engine(shm_dir, shm_budget="1.5MiB")
    with pytest.raises(ShmBudgetError) as refused:
        small.save({"w": torch.zeros(1 << 18)}, 1)  # 1 MiB: two versions need 2 MiB
    assert ("needs 2.0 MiB (1 rank(s) x (2 versions x 1.0 MiB data + 2 x 0 B parity)), but \"shm_budget\" "
            "(--ftmem-shm-budget) allows it 1.5 MiB") in str(refused.value)
    assert not os.path.exists(small.store.slot_path(0))  # nothing allocated
    small.close()
    engine = make_engine(shm_dir, shm_budget="3MiB")
    engine.save({"w": torch.ones(1 << 18)}, 1).wait_protected()
    with pytest.raises(ShmBudgetError, match="needs 6.0 MiB"):
        engine.save({"w": torch.zeros(1 << 19)}, 2)  # the state doubled: beyond the budget
    assert torch.equal(engine.restore().state["w"], torch.ones(1 << 18))  # what was protected is intact
    engine.close(job_finished=True)
