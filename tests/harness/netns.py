"""Hosts of a job as network namespaces on this machine, joined by veth pairs (one per
network, named alike on every host, as on a cluster), whose links a test can cut and heal:
a network partition, not a process killed. Needs root."""
from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from typing import Iterator, Mapping, Sequence

import pytest

from harness.ranks import LocalJob, start_rank


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


class Hosts:
    """Two hosts (network namespaces), host n holding address ``<subnet>.<n + 1>`` on each of
    ``networks`` (name: a /24's first three octets), and its loopback up."""

    def __init__(self, networks: Mapping[str, str]):
        self.networks = dict(networks)
        tag = uuid.uuid4().hex[:8]
        self.names = [f"ftmem-test-{tag}-node{n}" for n in range(2)]
        self._made: list[str] = []

    def address(self, host: int, network: str) -> str:
        return f"{self.networks[network]}.{host + 1}"

    def make(self) -> None:
        for name in self.names:
            try:
                ip("netns", "add", name)
            except (RuntimeError, FileNotFoundError) as e:
                pytest.skip(f"no network namespaces here ({e})")
            self._made.append(name)
        for network, subnet in self.networks.items():
            ip("link", "add", network, "netns", self.names[0], "type", "veth", "peer", "name", network, "netns",
               self.names[1])
            for n, name in enumerate(self.names):
                ip("-n", name, "addr", "add", f"{subnet}.{n + 1}/24", "dev", network)
                ip("-n", name, "link", "set", network, "up")
        for name in self.names:
            ip("-n", name, "link", "set", "lo", "up")

    def remove(self) -> None:
        if self._made:
            # Deleting one end of a pair deletes both; a namespace outlives its name while a
            # process (an SMP the shm_dir fixture stops) is still in it, its pairs must not.
            for network in self.networks:
                subprocess.run(["ip", "-n", self._made[0], "link", "delete", network], capture_output=True,
                               timeout=30)
        for name in self._made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """Every link between the hosts down for the block (host 1's ends: nothing crosses),
        then up again."""
        for network in self.networks:
            ip("-n", self.names[1], "link", "set", network, "down")
        try:
            yield
        finally:
            for network in self.networks:
                ip("-n", self.names[1], "link", "set", network, "up")

    def launcher(self, network: str, ranks_per_host: int = 1) -> type:
        """A LocalJob whose rank r runs on host r // ranks_per_host, its gloo and the job's store
        (served by rank 0) on ``network``."""
        hosts = self

        class OnHosts(LocalJob):
            def start_rank(self, module: str, args: Sequence[str], env: dict, log_path: str):
                host = int(env["RANK"]) // ranks_per_host
                env = {**env, "MASTER_ADDR": hosts.address(0, network), "GLOO_SOCKET_IFNAME": network}
                return start_rank(module, args, env, log_path, ("ip", "netns", "exec", hosts.names[host]))

        return OnHosts


@contextlib.contextmanager
def two_hosts(networks: Mapping[str, str]) -> Iterator[Hosts]:
    """:class:`Hosts` made for the block and removed after it, whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    hosts = Hosts(networks)
    try:
        hosts.make()
        yield hosts
    finally:
        hosts.remove()
