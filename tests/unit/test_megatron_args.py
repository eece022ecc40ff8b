"""The --ftmem-* flags validated together with Megatron's non-persistent flags: every
bad combination fails before training starts, naming the flags and the fix."""
import argparse

import pytest

from ftmem.errors import ConfigError
from ftmem_megatron.arguments import add_ftmem_args, add_non_persistent_args, validate_ftmem_args


def parse(argv, world_size=4):
    parser = add_non_persistent_args(add_ftmem_args(argparse.ArgumentParser()))
    parser.add_argument("--save")
    parser.add_argument("--load")
    args = parser.parse_args(argv)
    args.world_size = world_size
    return args


IN_MEMORY = ["--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
             "--save", "ckpt", "--load", "ckpt"]


def test_good_flags_make_the_engine_config(shm_dir):
    config = validate_ftmem_args(parse(IN_MEMORY + ["--ftmem-ec-k", "2", "--ftmem-ec-m", "1",
                                                    "--ftmem-ranks-per-node", "1", "--ftmem-shm-dir", shm_dir,
                                                    "--ftmem-dp-shard", "off", "--ftmem-job-id", "j1"]))
    assert (config.ec.k, config.ec.m, config.ranks_per_node, config.shm_dir, config.dp_shard, config.job_id) == \
        (2, 1, 1, shm_dir, "off", "j1")


def test_the_network_interface_flag_sets_ftmem_s_interface(monkeypatch):
    monkeypatch.delenv("FTMEM_SOCKET_IFNAME", raising=False)
    assert validate_ftmem_args(parse(IN_MEMORY + ["--ftmem-network-interface", "lo"])).network.interface == "lo"
    assert validate_ftmem_args(parse(IN_MEMORY)).network.interface is None
    # An interface this host lacks stops the job while Megatron checks its args (on every rank, so every
    # host), named as the flag.
    with pytest.raises(ConfigError) as e:
        validate_ftmem_args(parse(IN_MEMORY + ["--ftmem-network-interface", "ftmem-nosuch"]))
    assert str(e.value).startswith("--ftmem-network-interface names the network interface 'ftmem-nosuch', which "
                                   "this host ("), str(e.value)
    assert "its interfaces are lo" in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--ftmem-ec-k", "2", "--ftmem-ec-m", "1"],
     "--ftmem-ec-k, --ftmem-ec-m only apply to in-memory checkpoints, but --non-persistent-ckpt-type is None. "
     "Add --non-persistent-ckpt-type in_memory"),
    (["--non-persistent-ckpt-type", "in_memory", "--save", "c", "--load", "c"],
     "needs --non-persistent-save-interval N (N >= 1 iterations between in-memory checkpoints), got None"),
    (IN_MEMORY[:4], "needs --save and --load (usually the same directory)"),
    (IN_MEMORY + ["--ftmem-ec-k", "2"], "--ftmem-ec-k and --ftmem-ec-m go together (got k=2, m=None)"),
    (IN_MEMORY + ["--ftmem-ranks-per-node", "3"], "--ftmem-ranks-per-node 3 does not divide the world size 4"),
    (IN_MEMORY + ["--ftmem-ranks-per-node", "2", "--ftmem-ec-k", "2", "--ftmem-ec-m", "1"],
     "--ftmem-ec-k 2 --ftmem-ec-m 1 needs groups of 3 nodes, but 4 ranks at 2 per node make 2"),
    (IN_MEMORY + ["--ftmem-shm-dir", "/nonexistent/shm"], "'/nonexistent/shm' is not a directory"),
    (["--ftmem-network-interface", "lo"], "--ftmem-network-interface only apply to in-memory checkpoints"),
])
def test_bad_combinations_name_the_flags_and_the_fix(argv, message):
    with pytest.raises(ConfigError) as e:
        validate_ftmem_args(parse(argv))
    assert message in str(e.value)


def test_misspelt_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse(IN_MEMORY + ["--ftmem-ec-kk", "2"])
    assert "unrecognized arguments: --ftmem-ec-kk" in capsys.readouterr().err


@pytest.mark.parametrize("argv, enabled, timeout_s", [
    ([], True, None),
    (["--ftmem-failure-detection-timeout-s", "90"], True, 90),
    (["--ftmem-failure-detection", "off"], False, None),
    (["--ftmem-failure-detection", "on", "--ftmem-failure-detection-timeout-s", "30"], True, 30),
])
def test_failure_detection_flags_make_its_section(argv, enabled, timeout_s, shm_dir):
    config = validate_ftmem_args(parse(IN_MEMORY + ["--ftmem-shm-dir", shm_dir] + argv)).failure_detection
    assert (config.enabled, config.timeout_s) == (enabled, timeout_s)
