"""ftmem's bytes take the network the job names for them (``"network": {"interface": ...}``),
and the training's gloo keeps GLOO_SOCKET_IFNAME's: a two-node job in two network namespaces,
joined by two networks, and the byte counters of their interfaces."""
import json
import os
import subprocess
import sys

import pytest

from harness.common import REPO, job_id
from harness.netns import ip, two_hosts

# The two networks between the nodes: each interface is named alike on both, as on a cluster.
TRAINING, FTMEM = "train", "ftnet"
SUBNETS = {TRAINING: "198.18.1", FTMEM: "198.18.2"}  # a /24 each; node n has .n+1
STATE_BYTES = 4 << 20  # each rank's snapshot: its mirror on the other node crosses ftmem's network
TRAINING_BYTES = 1 << 20  # the training's all-reduce: it crosses the training's network
TIMEOUT = 60


@pytest.fixture
def two_nodes():
    """Two network namespaces, the job's nodes, joined by a veth pair per network."""
    with two_hosts(SUBNETS) as hosts:
        yield hosts.names


def sent(nodes, interface: str) -> int:
    """The bytes both nodes sent on ``interface`` (its transmit counters)."""
    return sum(json.loads(ip("-n", node, "-s", "-j", "link", "show", "dev", interface))[0]["stats64"]["tx"]["bytes"]
               for node in nodes)


def tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def test_ftmem_s_bytes_take_its_interface_and_the_training_s_keep_gloo_s(two_nodes, shm_dir, tmp_path):
    before = {name: sent(two_nodes, name) for name in SUBNETS}
    job, procs, logs = job_id(), [], [str(tmp_path / f"rank{rank}.log") for rank in range(2)]
    try:
        for rank, node in enumerate(two_nodes):
            # Any port is free on the nodes' own networks.
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=f"{SUBNETS[TRAINING]}.1", MASTER_PORT="29500", GLOO_SOCKET_IFNAME=TRAINING,
                       FTMEM_JOB_ID=job, FTMEM_COLLECTIVE_TIMEOUT_S="20", OMP_NUM_THREADS="1")
            env.pop("FTMEM_SOCKET_IFNAME", None)
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", node, sys.executable, "-m", "tests.harness.network_job",
                     "--shm-dir", shm_dir, "--interface", FTMEM, "--state-bytes", str(STATE_BYTES),
                     "--training-bytes", str(TRAINING_BYTES)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        codes = [proc.wait(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = "\n".join(f"--- rank {rank} ---\n{tail(path)}" for rank, path in enumerate(logs))
    assert codes == [0, 0], said
    assert f"ftmem's process groups take the network interface {FTMEM}" in said
    moved = {name: sent(two_nodes, name) - before[name] for name in SUBNETS}
    # The snapshots crossed to their mirrors on ftmem's network, and none of them on the training's,
    # which carried the training's all-reduce (and the rendezvous on the job's store).
    assert moved[FTMEM] >= STATE_BYTES, moved
    assert TRAINING_BYTES <= moved[TRAINING] < STATE_BYTES, moved


def test_an_interface_without_an_address_is_refused_naming_it(two_nodes):
    """An interface the host has but gloo cannot bind to (no address) is refused as the first
    group would be made, with the key that named it, not with gloo's bare complaint."""
    ip("-n", two_nodes[0], "link", "add", "noaddr", "type", "veth", "peer", "name", "noaddr-peer")
    tried = subprocess.run(["ip", "netns", "exec", two_nodes[0], sys.executable, "-c",
                            "from ftmem._common.collective import _bound_to; _bound_to('noaddr')"],
                           cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert tried.returncode != 0
    assert ("ftmem.errors.ConfigError: ftmem's network interface 'noaddr' (\"ftmem.network.interface\", "
            "FTMEM_SOCKET_IFNAME) has no address gloo can bind to") in tried.stderr, tried.stderr
