"""Every bad input gets a clear answer (issue 15): a config value of the wrong type or
range names its key, the value and what is allowed; a job id never becomes a path
outside the shared-memory directory; a user's mistake on the command line is one line
on stderr and status 2, never a traceback; export does not overwrite without --force."""
import os
import re
import time

import pytest
import torch

from harness.common import job_id, run_cli
from ftmem import ConfigError, FtmemConfig, SnapshotEngine, cli
from ftmem._shm import jobs
from ftmem._common.identity import RankIdentity, resolve_job_id, root_dir
from ftmem_megatron.arguments import validate_ftmem_args
from test_megatron_args import IN_MEMORY, parse


def one_line_refusal(out) -> str:
    """The command failed with status 2 and said why in exactly one line."""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


# -- the config --------------------------------------------------------------------------

@pytest.mark.parametrize("section, message", [
    ({"ec": 3}, '"ftmem.ec" must be an object with the keys k, m, got 3.'),
    ({"ec": {"k": True, "m": 1}}, '"ftmem.ec.k" must be an integer from 1 to 254 (or leave it out), got true.'),
    ({"persist": {"dir": "/tmp/p", "interval": "3"}}, '"ftmem.persist.interval" must be an integer from 0 to 1,000,000,000, got "3".'),
    ({"persist": {"dir": "/tmp/p", "interval": 2.5}}, '"ftmem.persist.interval" must be an integer from 0 to 1,000,000,000, got 2.5.'),
    ({"persist": {"dir": "/tmp/p", "interval": 1, "keep": "2"}}, '"ftmem.persist.keep" must be an integer from 1 to 1,000,000,000, got "2".'),
    ({"persist": {"dir": "/tmp/p", "interval": 1, "keep": None}}, '"ftmem.persist.keep" must be an integer from 1 to 1,000,000,000, got null.'),
    ({"persist": {"dir": 7, "interval": 1}}, '"ftmem.persist.dir" must be a string (or leave it out), got 7.'),
    ({"persist": [1]}, '"ftmem.persist" must be an object with the keys dir, interval, keep, fsync, got [1].'),
    ({"shm_dir": None}, '"ftmem.shm_dir" must be a string, got null.'),
    ({"job_id": 123}, '"ftmem.job_id" must be a job id of 1-128 letters, digits, \'.\', \'_\' and \'-\', other than '
                      '\'.\' and \'..\' (or leave it out), got 123.'),
    ({"job_id": ".."}, '"ftmem.job_id" must be a job id of'),
    ({"ranks_per_node": True}, '"ftmem.ranks_per_node" must be an integer from 1 to 1,000,000,000 (or leave it out), got true.'),
    ({"ranks_per_node": 2.0}, '"ftmem.ranks_per_node" must be an integer from 1 to 1,000,000,000 (or leave it out), got 2.0.'),
    ({"dp_shard": 1}, '"ftmem.dp_shard" must be one of "auto", "on", "off", got 1.'),
    ({"allow_disk_fallback": "yes"}, '"ftmem.allow_disk_fallback" must be true or false, got "yes".'),
    ({"network": {"interface": 1}}, '"ftmem.network.interface" must be a network interface\'s name (1-15 '
                                    'characters, without \'/\', \':\' or white space) (or leave it out), got 1.'),
    ({"network": {"interface": "eth0 "}}, '"ftmem.network.interface" must be a network interface\'s name'),
    ({"network": {"interface": "eth0:1"}}, '"ftmem.network.interface" must be a network interface\'s name'),
    ({"network": "eth0"}, '"ftmem.network" must be an object with the keys interface, got "eth0".'),
    ({"slots": 4}, '"ftmem.slots" must be one of 2, 3, got 4.'),
    ({"preemption": {"signal": "TERM"}}, '"ftmem.preemption.signal" must be one of "SIGTERM", "SIGINT", "SIGUSR1", '
                                         '"SIGUSR2", "SIGHUP" (or leave it out), got "TERM".'),
    ({"preemption": {"grace_s": 0}}, '"ftmem.preemption.grace_s" must be an integer from 1 to 86,400, got 0.'),
    ({"failure_detection": {"timeout_s": 0}}, '"ftmem.failure_detection.timeout_s" must be an integer from 1 to '
                                              '86,400 (or leave it out), got 0.'),
    ({"failure_detection": {"enabled": "no"}}, '"ftmem.failure_detection.enabled" must be true or false, got "no".'),
    ({"failure_detection": {"timeout": 5}}, "unknown key 'timeout' in the \"ftmem.failure_detection\" config. Did you "
                                            "mean 'timeout_s'?"),
    ({"shm_budget": "lots"}, '"ftmem.shm_budget" must be a share of the shared-memory filesystem\'s size ("80%") or '
                             'a size ("64GiB", "500MB", or a number of bytes: "1000000" or 1000000), per node (or leave it out), '
                             'got "lots".'),
    ({"shm_budget": "120%"}, '"ftmem.shm_budget" must be a share of'),
    # Values past any real one, which used to pass and break later (an OverflowError at SIGTERM, at the first save).
    ({"preemption": {"grace_s": 10_000_000_000}}, '"ftmem.preemption.grace_s" must be an integer from 1 to 86,400, got '
                                                  '10000000000.'),
    ({"failure_detection": {"timeout_s": 10**30}}, '"ftmem.failure_detection.timeout_s" must be an integer from 1 to '
                                                   '86,400 (or leave it out), got 1000000000000000000000000000000.'),
    ({"failure_detection": {"timeout_s": 1e30}}, '"ftmem.failure_detection.timeout_s" must be an integer from 1 to '
                                                 '86,400 (or leave it out), got 1e+30.'),
    ({"persist": {"dir": "/tmp/p", "interval": 10**12}}, '"ftmem.persist.interval" must be an integer from 0 to '
                                                         '1,000,000,000, got 1000000000000.'),
    ({"ec": {"k": 200, "m": 100}}, '"ftmem.ec" k=200, m=100 makes groups of 300 nodes; the code (Reed-Solomon over '
                                   'GF(2^8)) takes at most k+m = 255.'),
    ({"shm_budget": 10**30}, '"ftmem.shm_budget" must be a share of'),
    ({"shm_budget": 0}, '"ftmem.shm_budget" must be a share of'),
    ({"shm_budget": True}, '"ftmem.shm_budget" must be a share of'),
    ([("ec", 1)], '"ftmem" must be an object with the keys ec, ranks_per_node, shm_dir, dp_shard, persist, network, '
                  'preemption, failure_detection, slots, shm_budget, job_id, allow_disk_fallback, got '
                  '[["ec", 1]].'),
    ("ftmem", '"ftmem" must be an object with the keys'),
])
def test_a_bad_config_value_names_its_key_the_value_and_what_is_allowed(section, message):
    with pytest.raises(ConfigError) as e:
        FtmemConfig.from_dict(section)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("budget", [1_000_000, "1000000"])
def test_a_budget_in_bytes_is_a_json_number_or_a_string(budget):
    assert FtmemConfig.from_dict({"shm_budget": budget}).shm_budget == budget


@pytest.mark.parametrize("name", ["FTMEM_FINISH_TIMEOUT_S", "FTMEM_COLLECTIVE_TIMEOUT_S", "FTMEM_FAILURE_TIMEOUT_S"])
@pytest.mark.parametrize("value", ["1e30", "inf", "nan", "0"])
def test_a_wait_an_environment_variable_sets_has_a_range_checked_at_the_start(name, value, monkeypatch, shm_dir):
    """A job's start, not its end, finds a bad wait: the engine reads each as it starts."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}: give ") + ".* in seconds \\(from 1 to 86,400\\)"):
        SnapshotEngine({"shm_dir": shm_dir}, rank=0, world_size=1)


def test_paths_that_cannot_work_are_refused_at_start(tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=re.escape(f'"ftmem.persist.dir" \'{a_file}\' is a file, not a directory')):
        FtmemConfig.from_dict({"persist": {"dir": str(a_file), "interval": 1}})
    with pytest.raises(ConfigError, match=re.escape(f'"ftmem.shm_dir" \'{a_file}\' is not a directory: point it')):
        FtmemConfig.from_dict({"shm_dir": str(a_file)})
    # Read-only (as root, which this suite may run as, permissions do not stop writes: ask as a user would).
    read_only = str(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: path != read_only)
    with pytest.raises(ConfigError, match=re.escape(f'"ftmem.shm_dir" \'{read_only}\' is not writable by this user')):
        FtmemConfig.from_dict({"shm_dir": read_only})


@pytest.mark.parametrize("argv, message", [
    (["--ftmem-ec-k", "0", "--ftmem-ec-m", "1"], "--ftmem-ec-k must be an integer from 1 to 254 (or leave it out), got 0."),
    (["--ftmem-ranks-per-node", "0"], "--ftmem-ranks-per-node must be an integer from 1 to 1,000,000,000 (or leave it "
                                       "out), got 0."),
    (["--ftmem-job-id", ".."], "--ftmem-job-id must be a job id of 1-128 letters"),
    (["--ftmem-shm-dir", "/nonexistent/shm"], "--ftmem-shm-dir '/nonexistent/shm' is not a directory"),
    (["--ftmem-network-interface", "a/b"], "--ftmem-network-interface must be a network interface's name"),
    (["--ftmem-preemption-grace-s", "0"], "--ftmem-preemption-grace-s must be an integer from 1 to 86,400, got 0."),
    (["--ftmem-failure-detection-timeout-s", "0"], "--ftmem-failure-detection-timeout-s must be an integer "
                                                   "from 1 to 86,400 (or leave it out), got 0."),
])
def test_megatron_flags_are_checked_by_the_same_schema_and_named_as_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        validate_ftmem_args(parse(IN_MEMORY + argv))
    assert str(e.value).startswith(message), str(e.value)


# -- job ids -----------------------------------------------------------------------------

BAD_JOB_IDS = [".", "..", "../../victim", "a/b", "x" * 200, "", "job\n"]


@pytest.mark.parametrize("job", BAD_JOB_IDS, ids=repr)
def test_training_refuses_a_job_id_that_is_no_directory_of_its_own(job, monkeypatch, shm_dir):
    monkeypatch.setenv("FTMEM_JOB_ID", job)
    if job:  # an empty FTMEM_JOB_ID is unset: the id is derived
        with pytest.raises(ConfigError, match=re.escape(f"FTMEM_JOB_ID {job!r} is not usable as a directory name")):
            RankIdentity.resolve(FtmemConfig.from_dict({"shm_dir": shm_dir}), rank=0, world_size=1)
    monkeypatch.delenv("FTMEM_JOB_ID")
    with pytest.raises(ConfigError, match='"ftmem.job_id" must be a job id'):
        FtmemConfig.from_dict({"job_id": job})
    with pytest.raises(ConfigError, match="is not usable as a directory name"):
        jobs.node_dirs(shm_dir, job)
    assert resolve_job_id("fine_id-1.2", 1, 1, "") == "fine_id-1.2"


@pytest.mark.parametrize("command", [["status"], ["clean"], ["export", "--out", "unused"]])
@pytest.mark.parametrize("job", BAD_JOB_IDS, ids=repr)
def test_commands_refuse_a_bad_job_id_in_one_line(command, job, shm_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--shm-dir", shm_dir, "--job", job])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"ftmem {command[0]}: argument --job: job id {job!r} is not usable as a directory name" in err


def test_clean_deletes_nothing_outside_the_shared_memory_directory(tmp_path):
    shm, victim = tmp_path / "shm", tmp_path / "victim"
    root = tmp_path / "shm" / os.path.basename(root_dir(str(shm)))
    (root / "real" / "node0").mkdir(parents=True)
    (victim / "node0").mkdir(parents=True)
    (victim / "node0" / "precious").write_text("keep me")
    (root / "link").symlink_to(victim)  # a job directory that leads elsewhere
    (root / "stray file").write_text("")
    assert "job id '../../victim' is not usable" in one_line_refusal(
        run_cli("clean", "--shm-dir", str(shm), "--job", "../../victim"))
    assert jobs.list_jobs(str(shm)) == ["real"]  # neither the link nor the file is a job
    assert "leads outside" in one_line_refusal(run_cli("clean", "--shm-dir", str(shm), "--job", "link"))
    with pytest.raises(ConfigError):
        jobs.clean(str(shm), "../../victim")
    out = run_cli("clean", "--shm-dir", str(shm), "--all")
    assert out.returncode == 0 and out.stdout == "job real: stopped its SMPs and freed 1 node directory\n", out.stderr
    assert (victim / "node0" / "precious").read_text() == "keep me"


# -- the command line --------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["bench", "save", "--mb", "-1"], "ftmem bench save: argument --mb: must be an integer from 1 to 1,000,000,000, got '-1'"),
    (["bench", "save", "--repeat", "0"], "ftmem bench save: argument --repeat: must be an integer from 1 to 1,000,000,000, got '0'"),
    (["bench", "ec", "--mb", "-1"], "ftmem bench ec: argument --mb: must be an integer from 1 to 1,000,000,000, got '-1'"),
    (["bench", "ec", "--piece-mb", "0"], "ftmem bench ec: argument --piece-mb: must be an integer from 1 to 1,000,000,000, got '0'"),
    (["bench", "protect", "--nodes", "2,0"], "ftmem bench protect: argument --nodes: must be an integer from 1 to 1,000,000,000, got '0'"),
    (["survival", "--nodes", "8", "--k", "2", "--m", "1", "--trials", "-5"],
     "ftmem survival: argument --trials: must be an integer from 1 to 20,000,000, got '-5'"),
    (["survival", "--nodes", "8", "--k", "2", "--m", "1", "--trials", "0"],
     "ftmem survival: argument --trials: must be an integer from 1 to 20,000,000, got '0'"),
    (["survival", "--nodes", "8", "--k", "2", "--m", "1", "--node-mtbf-hours", "0"],
     "ftmem survival: argument --node-mtbf-hours: must be a number from 0.001 to 1e+09, got '0'"),
    (["survival", "--nodes", "8", "--k", "2", "--m", "1", "--node-mtbf-hours", "-100"],
     "ftmem survival: argument --node-mtbf-hours: must be a number from 0.001 to 1e+09, got '-100'"),
    (["survival", "--nodes", "8", "--k", "2", "--m", "1", "--window-minutes", "nan"],
     "ftmem survival: argument --window-minutes: must be a number from 0.001 to 1e+07, got 'nan'"),
    (["survival", "--nodes", "2000000", "--k", "2", "--m", "1", "--failures", "2"],
     "ftmem survival: argument --nodes: must be an integer from 1 to 1,000,000, got '2000000'"),
    (["survival", "--nodes", "1000", "--k", "2", "--m", "1", "--failures", "500"],
     "ftmem survival: argument --failures: must be an integer from 0 to 100, got '500'"),
    (["demo", "--shm-dir", "/nonexistent"], "ftmem demo: argument --shm-dir: '/nonexistent' is not a directory"),
    # Values past any real one, which printed a 300-digit lag or "0 iterations" with status 0.
    (["plan", "--params", "7B", "--dp", "8", "--gpus-per-node", "8", "--net-gbps", "1e-300", "--step-s", "1"],
     "ftmem plan: argument --net-gbps: must be a number from 0.001 to 10000, got '1e-300'"),
    (["plan", "--params", "7B", "--dp", "8", "--gpus-per-node", "8", "--net-gbps", "12.5", "--step-s", "1e-300"],
     "ftmem plan: argument --step-s: must be a number from 0.001 to 100000, got '1e-300'"),
    (["plan", "--params", "7B", "--dp", "8", "--gpus-per-node", "8", "--net-gbps", "1e300", "--step-s", "1e300"],
     "ftmem plan: argument --net-gbps: must be a number from 0.001 to 10000, got '1e300'"),
    (["plan", "--params", "7B", "--dp", "8", "--gpus-per-node", "8", "--net-gbps", "12.5", "--step-s", "1",
      "--save-interval", "1e12"], "ftmem plan: argument --save-interval: must be an integer from 1 to 1,000,000,000"),
    (["export", "--job", "j", "--out", "o", "--version", "-3"],
     "ftmem export: argument --version: must be an integer from 0 to 1,000,000,000, got '-3'"),
])
def test_a_mistake_on_the_command_line_is_one_line_and_status_2(argv, says):
    assert one_line_refusal(run_cli(*argv)).startswith(says)


def test_status_of_a_job_that_is_not_there_fails_but_no_jobs_is_fine(shm_dir):
    assert one_line_refusal(run_cli("status", "--shm-dir", shm_dir, "--job", "nosuch")) == \
        f"ftmem status: no job 'nosuch' in {shm_dir} (jobs there: none). Name the shared-memory directory it runs " \
        f"in with --shm-dir."
    out = run_cli("status", "--shm-dir", shm_dir)
    assert out.returncode == 0 and out.stdout == f"no ftmem jobs in {shm_dir}\n"


@pytest.mark.parametrize("argv", [["status"], ["clean", "--all"], ["export", "--job", "j", "--out", "unused"]],
                         ids=["status", "clean", "export"])
def test_a_shm_dir_that_is_not_there_is_refused_not_reported_empty(argv):
    assert one_line_refusal(run_cli(*argv, "--shm-dir", "/nonexistent")) == \
        f"ftmem {argv[0]}: argument --shm-dir: '/nonexistent' is not a directory: name the shared-memory " \
        f"directory the job runs in (its \"shm_dir\") (see ftmem {argv[0]} --help)"


def test_clean_frees_only_what_it_was_asked_to(shm_dir):
    """``clean --all --job X`` once freed every job; a job that is not there was "cleaned"
    with status 0. Both are refused now, and the job held stays."""
    job = job_id()
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)
    engine.save({"w": torch.zeros(4)}, 1).wait_protected()
    engine.close()
    assert one_line_refusal(run_cli("clean", "--shm-dir", shm_dir, "--all", "--job", job)) == \
        "ftmem clean: argument --job: not allowed with argument --all (see ftmem clean --help)"
    assert one_line_refusal(run_cli("clean", "--shm-dir", shm_dir, "--job", "nosuch")) == \
        f"ftmem clean: no job 'nosuch' in {shm_dir} (jobs there: {job}): nothing was freed. Name the shared-memory " \
        f"directory it runs in with --shm-dir."
    assert jobs.status(shm_dir, job)["jobs"][0]["nodes"][0]["versions"] == [1]
    out = run_cli("clean", "--shm-dir", shm_dir, "--job", job)
    assert out.returncode == 0 and jobs.list_jobs(shm_dir) == []


def test_survival_of_a_million_nodes_answers_in_seconds():
    started = time.monotonic()
    out = run_cli("survival", "--nodes", "1000000", "--k", "2", "--m", "1", "--failures", "2")
    assert out.returncode == 0, out.stderr
    assert "       2     0.999998000" in out.stdout and time.monotonic() - started < 60


# -- export ------------------------------------------------------------------------------

@pytest.fixture
def held_job(shm_dir, monkeypatch):
    """A job whose memory holds version 6 in DeepSpeed's format (one rank, engine level)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # else DeepSpeed logs its accelerator guess on stderr
    job = job_id()
    engine = SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1,
                            format="deepspeed")
    engine.save({"tag": "global_step6", "rng": {}, "files": {
        "ckpt/global_step6/mp_rank_00_model_states.pt": {"module": {"w": torch.arange(6.0)}}}}, 6).wait_protected()
    engine.close()  # the job ends without finishing: its memory stays
    return job


def test_export_refuses_to_overwrite_unless_forced(held_job, shm_dir, tmp_path):
    out = str(tmp_path / "exported")
    export = ["export", "--job", held_job, "--shm-dir", shm_dir, "--out"]
    assert run_cli(*export, out).returncode == 0
    mine = os.path.join(out, "global_step6", "mine")  # the user's, beside the export
    with open(mine, "w") as f:
        f.write("mine")
    # DeepSpeed's pointer is `latest`; its publish also copies its recovery scripts there.
    assert one_line_refusal(run_cli(*export, out)) == (
        f"ftmem export: --out '{out}' already holds global_step6, latest, zero_to_fp32.py, zero_to_torch.py, which "
        f"exporting version 6 would replace. Name another directory, or pass --force to replace them.")
    assert os.path.exists(mine) and not [n for n in os.listdir(out) if n.endswith(".tmp")]  # nothing was written

    forced = run_cli(*export, out, "--force")
    assert forced.returncode == 0 and f"exported version 6 to {out}/global_step6" in forced.stdout, forced.stderr
    assert not os.path.exists(mine)
    assert torch.load(os.path.join(out, "global_step6", "mp_rank_00_model_states.pt"))["module"]["w"].tolist() == \
        list(range(6))
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "global_step6"

    os.rename(os.path.join(out, "global_step6"), os.path.join(out, "global_step5"))
    assert f"--out '{out}' already holds latest, " in one_line_refusal(run_cli(*export, out))  # a pointer alone

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert one_line_refusal(run_cli(*export, str(a_file))).startswith(f"ftmem export: --out '{a_file}' is a file")
    assert one_line_refusal(run_cli(*export, str(a_file / "sub"))).startswith(
        f"ftmem export: cannot write into --out '{a_file / 'sub'}' (Not a directory)")
