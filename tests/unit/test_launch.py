"""The local launcher's choice of a job's store port (examples/launch.py, which the tests, the
benchmarks and the demo start every job through)."""
import socket

from examples.launch import free_port


def test_a_job_s_store_port_is_free_and_below_the_ports_the_kernel_hands_out_by_itself():
    """Every gloo listener binds to port 0 and takes its port from the ephemeral range: a store
    port from there could be taken by another job's listener before rank 0 listens on it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(port < low for port in ports), (ports, low)
    assert len(set(ports)) > 1  # picked at random, not the same port for every job
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
