import os
import re
import socket

import pytest

from ftmem import SnapshotEngine
from ftmem.adapter import check_startup
from ftmem.config import MEMORY_FILESYSTEMS, FtmemConfig, filesystem_of
from ftmem.errors import ConfigError
from ftmem._common.identity import RankIdentity, resolve_job_id
from ftmem._engine.failure_detector import watched_rank


def test_defaults_fit_the_node_count():
    cfg = FtmemConfig.from_dict(None)
    assert (cfg.shm_dir, cfg.dp_shard) == ("/dev/shm", "auto")
    assert [cfg.ec.resolve(n) for n in (1, 2, 3, 8)] == [(1, 0), (1, 1), (2, 1), (2, 1)]


def test_full_section_parses():
    cfg = FtmemConfig.from_dict({"ec": {"k": 4, "m": 2}, "ranks_per_node": 2, "shm_dir": "/dev/shm",
                                 "dp_shard": "on", "persist": {"dir": "/tmp/x", "interval": 100}})
    assert cfg.ec.resolve(6) == (4, 2) and cfg.persist.interval == 100 and cfg.ranks_per_node == 2


@pytest.mark.parametrize("section, named, hint", [
    ({"ranks_per_nod": 1}, "'ranks_per_nod'", "'ranks_per_node'"),
    ({"ec": {"k": 2, "mm": 1}}, "'mm'", "'m'"),
    ({"persist": {"intervall": 3}}, "'intervall'", "'interval'"),
])
def test_misspelt_key_is_named_with_a_suggestion(section, named, hint):
    with pytest.raises(ConfigError) as err:
        FtmemConfig.from_dict(section)
    assert named in str(err.value) and f"Did you mean {hint}" in str(err.value)


@pytest.mark.parametrize("section, fragment", [
    ({"dp_shard": "maybe"}, "dp_shard"),
    ({"ec": {"k": 0, "m": 1}}, "ec.k"),
    ({"ec": {"k": 2, "m": -1}}, "ec.m"),
    ({"ec": {"k": 3, "m": 0}}, "protects nothing"),
    ({"ec": {"k": 3}}, "needs both"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"shm_dir": "/no/such/dir"}, "is not a directory"),
    ({"persist": {"dir": "/tmp/ckpt"}}, '"ftmem.persist" needs both "dir" and "interval" >= 1'),
    ({"persist": {"interval": 10}}, '"ftmem.persist" needs both "dir" and "interval" >= 1'),
])
def test_bad_values_say_what_is_wrong(section, fragment):
    with pytest.raises(ConfigError, match=fragment):
        FtmemConfig.from_dict(section)


def test_shm_dir_must_be_kept_in_memory_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    """A shared-memory directory on a disk (here the test's tmp dir) would write every
    snapshot to that disk: refused, naming the file system, unless FTMEM_SHM_ANY_FILESYSTEM=1."""
    monkeypatch.delenv("FTMEM_SHM_ANY_FILESYSTEM", raising=False)
    kind = filesystem_of(str(tmp_path))
    assert kind not in MEMORY_FILESYSTEMS and filesystem_of("/dev/shm") == "tmpfs"
    with pytest.raises(ConfigError, match=rf"'{tmp_path}' is on {kind}, a file system not kept in memory .*"
                                          rf"FTMEM_SHM_ANY_FILESYSTEM=1"):
        FtmemConfig.from_dict({"shm_dir": str(tmp_path)})
    assert FtmemConfig.from_dict({"shm_dir": "/dev/shm"}).shm_dir == "/dev/shm"
    monkeypatch.setenv("FTMEM_SHM_ANY_FILESYSTEM", "1")
    assert FtmemConfig.from_dict({"shm_dir": str(tmp_path)}).shm_dir == str(tmp_path)


def test_job_identity_precedence(monkeypatch):
    for var in ("FTMEM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    derived = resolve_job_id(None, 8, 1, "save dir /ckpt/a")
    assert derived == resolve_job_id(None, 8, 1, "save dir /ckpt/a")  # a relaunch of the same job finds it
    assert derived != resolve_job_id(None, 16, 1, "save dir /ckpt/a") != resolve_job_id(None, 8, 2, "save dir /ckpt/a")
    assert derived != resolve_job_id(None, 8, 1, "save dir /ckpt/b")  # an unrelated job does not
    # What launchers set does not count: torchrun draws a new run id at every launch, and
    # unrelated jobs share the master's address and port.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4f1c")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert resolve_job_id(None, 8, 1, "save dir /ckpt/a") == derived
    assert resolve_job_id("from-config", 8, 1, "save dir /ckpt/a") == "from-config"
    monkeypatch.setenv("FTMEM_JOB_ID", "from-env")
    assert resolve_job_id("from-config", 8, 1, "save dir /ckpt/a") == "from-env"
    monkeypatch.setenv("FTMEM_JOB_ID", "bad/name")
    with pytest.raises(ConfigError, match="not usable as a directory name"):
        resolve_job_id(None, 8, 1, "x")


def test_virtual_nodes(monkeypatch):
    monkeypatch.setenv("FTMEM_JOB_ID", "j")
    ident = RankIdentity.resolve(FtmemConfig.from_dict({"ranks_per_node": 2}), rank=5, world_size=6)
    assert (ident.node, ident.local_rank, ident.num_nodes) == (2, 1, 3)
    assert ident.node_dir == f"/dev/shm/ftmem-{os.geteuid()}/j/node2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # the launcher's default
    assert RankIdentity.resolve(FtmemConfig.from_dict({}), rank=4, world_size=6).node == 1
    with pytest.raises(ConfigError, match="not a multiple of ranks_per_node"):
        RankIdentity.resolve(FtmemConfig.from_dict({"ranks_per_node": 4}), rank=0, world_size=6)


def test_an_ec_group_larger_than_the_node_count_is_refused():
    with pytest.raises(ConfigError, match="needs groups of 4 nodes, but the job has 3 node"):
        FtmemConfig.from_dict({"ec": {"k": 2, "m": 2}}).ec.resolve(3)


def test_network_interface_from_the_config_else_the_environment(monkeypatch):
    """ftmem's groups bind to the config's interface, else FTMEM_SOCKET_IFNAME's, else to none
    of their own (gloo's choice, GLOO_SOCKET_IFNAME's, as the training's groups)."""
    monkeypatch.delenv("FTMEM_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the training's: never ftmem's
    assert FtmemConfig.from_dict(None).network.resolve() is None
    assert FtmemConfig.from_dict({"network": {}}).network.resolve() is None
    assert FtmemConfig.from_dict({"network": {"interface": None}}).network.resolve() is None
    assert FtmemConfig.from_dict({"network": {"interface": "lo"}}).network.resolve() == "lo"
    monkeypatch.setenv("FTMEM_SOCKET_IFNAME", "lo")
    assert FtmemConfig.from_dict(None).network.resolve() == "lo"
    monkeypatch.setenv("FTMEM_SOCKET_IFNAME", "ftmem-nosuch")  # the config wins: the environment is not read
    assert FtmemConfig.from_dict({"network": {"interface": "lo"}}).network.resolve() == "lo"
    monkeypatch.setenv("FTMEM_SOCKET_IFNAME", "")  # empty is unset
    assert FtmemConfig.from_dict(None).network.resolve() is None


def test_failure_detection_timeout_from_the_config_else_the_environment(monkeypatch):
    """On by default at 60 s; FTMEM_FAILURE_TIMEOUT_S sets it where the config leaves it out;
    ``"enabled": false`` turns it off whatever the environment says."""
    monkeypatch.delenv("FTMEM_FAILURE_TIMEOUT_S", raising=False)
    assert FtmemConfig.from_dict(None).failure_detection.resolve() == 60
    assert FtmemConfig.from_dict({"failure_detection": {"timeout_s": 5}}).failure_detection.resolve() == 5
    monkeypatch.setenv("FTMEM_FAILURE_TIMEOUT_S", "7")
    assert FtmemConfig.from_dict(None).failure_detection.resolve() == 7
    assert FtmemConfig.from_dict({"failure_detection": {"timeout_s": 5}}).failure_detection.resolve() == 5
    assert FtmemConfig.from_dict({"failure_detection": {"enabled": False}}).failure_detection.resolve() is None
    monkeypatch.setenv("FTMEM_FAILURE_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=re.escape("FTMEM_FAILURE_TIMEOUT_S='soon': give how long a rank may go "
                                                    "without a heartbeat")):
        FtmemConfig.from_dict(None).failure_detection.resolve()


@pytest.mark.parametrize("world, per_node", [(3, 1), (6, 2), (8, 4), (2, 2), (1, 1)])
def test_every_rank_is_watched_by_one_rank_and_from_another_node_where_there_is_one(world, per_node):
    watchers = {rank: watched_rank(rank, world, per_node) for rank in range(world)}
    assert sorted(watchers.values()) == list(range(world))  # each rank watched exactly once
    for watcher, watched in watchers.items():
        assert watched != watcher or world == 1
        assert watched // per_node != watcher // per_node or world <= per_node


@pytest.mark.parametrize("given", ["config", "environment"])
def test_an_interface_the_host_lacks_is_refused_at_start_naming_those_it_has(given, monkeypatch, shm_dir):
    monkeypatch.delenv("FTMEM_SOCKET_IFNAME", raising=False)
    section = {"shm_dir": shm_dir, "job_id": "j", "ranks_per_node": 1}
    if given == "config":
        section["network"] = {"interface": "ftmem-nosuch"}
        source = '"ftmem.network.interface"'
    else:
        monkeypatch.setenv("FTMEM_SOCKET_IFNAME", "ftmem-nosuch")
        source = "FTMEM_SOCKET_IFNAME"
    config = FtmemConfig.from_dict(section)  # a config is checked on the host that runs it, not where it is parsed
    present = ", ".join(name for _, name in socket.if_nameindex())
    refusal = (f"{source} names the network interface 'ftmem-nosuch', which this host ({socket.gethostname()}) "
               f"does not have; its interfaces are {present}.")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        config.network.resolve()
    # The engine refuses it first of all: here before it asks for torch.distributed, which 2 ranks need,
    # and so before any group is made. So do the adapters' checks at the job's start.
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        SnapshotEngine(config, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        check_startup(config, rank=0, world_size=1)
