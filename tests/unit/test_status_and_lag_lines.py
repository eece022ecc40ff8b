"""Two lines users read every day, saying no less than they must and no more: ``ftmem status``
of a job that holds nothing yet, and the log's lines on protection lagging behind the saves."""
from harness.common import job_id, make_engine, run_cli
from ftmem._engine.commit import LAG_SUMMARY_S, _LagLog


def test_status_of_a_job_that_holds_no_version_yet_says_so_in_words(shm_dir):
    """It printed ``newest version held None, newest protected None``."""
    job = job_id()
    engine = make_engine(shm_dir, job)
    try:
        out = run_cli("status", "--shm-dir", shm_dir, "--job", job)
    finally:
        engine.close(job_finished=True)
    assert out.returncode == 0, out.stderr
    assert f"job {job}: no version held yet\n" in out.stdout and "None" not in out.stdout, out.stdout
    assert "versions none, protected none" in out.stdout, out.stdout


def test_a_lag_that_comes_and_goes_is_said_twice_then_summed_up_at_most_once_a_minute():
    """On a loaded machine protection falls behind and catches up every few saves: a line per
    change flooded the log (about 30 pairs in 90 s). The first fall and the first catch-up each
    get their line; after that one line at most every LAG_SUMMARY_S sums up what came since."""
    lag, said, now = _LagLog(), [], 0.0
    for version in range(1, 200):  # a save every 3 s, behind every other one: 10 minutes
        now += 3.0
        line = lag.seen(version, version % 2, now)
        if line is not None:
            said.append((now, line))
    assert said[0][1].startswith("protection is 1 version(s) behind the saves: version 1 protected, 2 saved")
    assert said[1][1] == "protection caught up: version 2, the newest saved, is protected"
    summaries = said[2:]
    assert summaries and all(line.startswith("protection fell behind the saves ") for _, line in summaries)
    assert all(b - a >= LAG_SUMMARY_S for (a, _), (b, _) in zip(said[1:], said[2:]))
    assert len(said) <= 2 + (now - said[1][0]) // LAG_SUMMARY_S
    assert "fell behind the saves 10 time(s) in the last 60 s, at most 1 version(s)" in summaries[0][1]
