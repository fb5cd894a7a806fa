"""trainer.launch.ports: ports for servers that bind later are free, distinct and below the kernel's ephemeral
range (where outgoing connections take theirs), with the kernel's choice only where that range has no room."""

import socket

import pytest

import helpers
from trainer.launch import ports
from trainer.launch.jobsteps import RAY_HEAD_PORT_FLAGS, RAY_NODE_PORT_FLAGS, RAY_WORKER_PORT_FLAGS, ray_port_flags


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    taken = ports.free_ports(16)
    assert len(set(taken)) == 16 and all(ports.FLOOR <= p < low for p in taken), taken
    for port in taken:  # free once released
        with socket.socket() as sock:
            sock.bind(("", port))
    on_loopback = ports.free_ports(1, "127.0.0.1")[0]
    assert ports.FLOOR <= on_loopback < low


def test_a_taken_port_is_never_given_and_no_room_falls_back_to_the_kernel():
    """With room for one port only (``below=FLOOR + 1``) that port is given while free; held by another socket,
    the kernel's choice (from its ephemeral range) is given instead, never the taken one."""
    low, high = ports.ephemeral_range()
    try:
        only = ports.free_ports(1, "127.0.0.1", below=ports.FLOOR + 1)
    except OSError:
        pytest.skip(f"port {ports.FLOOR} is in use here")
    if only != [ports.FLOOR]:
        pytest.skip(f"port {ports.FLOOR} is in use here")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports.FLOOR))
        holder.listen(1)
        [other] = ports.free_ports(1, "127.0.0.1", below=ports.FLOOR + 1)
    assert other != ports.FLOOR and low <= other <= high
    [kernel] = ports.free_ports(1, "127.0.0.1", below=ports.FLOOR)  # no room at all
    assert low <= kernel <= high


def test_an_address_not_of_this_host_is_refused():
    with pytest.raises(OSError):
        ports.free_ports(1, "192.0.2.1")


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    for bad in ("", "40000", "x y", "50000 40000", "0 100", "1 70000"):
        path.write_text(bad)
        assert ports.ephemeral_range(path) == ports.EPHEMERAL_DEFAULT, bad
    assert ports.ephemeral_range(tmp_path / "missing") == ports.EPHEMERAL_DEFAULT


def test_ray_start_flags_name_distinct_ports_for_each_component():
    for head in (False, True):
        flags = ray_port_flags(head)
        named = [f for f in flags if f not in RAY_WORKER_PORT_FLAGS]
        expected = [*RAY_NODE_PORT_FLAGS, *(RAY_HEAD_PORT_FLAGS if head else ())]
        assert [f.split("=")[0] for f in named] == expected
        numbers = [int(f.split("=")[1]) for f in named]
        assert len(set(numbers)) == len(numbers) and all(ports.FLOOR <= p < ports.ephemeral_range()[0] for p in numbers)
        assert flags[len(named) :] == list(RAY_WORKER_PORT_FLAGS)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
