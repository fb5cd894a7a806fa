"""launcher=ray against a real Ray head on 127.0.0.1 (started and stopped here): a probe-only job with the
preflight on every node, a job that exits non-zero, and a cluster that cannot be reached."""

import json
import os
import subprocess
import sys

import pytest

import helpers
from helpers import run_train
from launch_fixtures import LocalRay, free_port, missing_ray

pytestmark = pytest.mark.skipif(missing_ray() is not None, reason=str(missing_ray()))
DIGEST = "sha256:" + "5e" * 32


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    with LocalRay(tmp_path_factory.mktemp("ray")) as head:
        yield head


def submit(tmp_path, address, *extra):
    run_dir = tmp_path / "run"
    result = run_train(
        [
            "experiment=smoke",
            "launcher=ray",
            f"launcher.address={address}",
            f"launcher.image=registry.example.invalid/smoke@{DIGEST}",
            "launcher.expect_gpus=false",
            "launcher.workdir=null",
            f"paths.kernel_cache={tmp_path}/kernels",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=tmp_path,
        timeout=180,
    )
    record = json.loads((run_dir / "record.json").read_text())
    return result, run_dir, record


def test_probe_job_on_every_node(tmp_path, ray_head):
    result, run_dir, record = submit(tmp_path, ray_head.address, "launcher.job=[python3,-m,trainer.probe,--node,job]")
    assert result.returncode == 0, result.stdout + result.stderr + ray_head.logs()
    assert record["status"] == "complete" and record["ray"]["status"] == "SUCCEEDED"
    assert record["preflight"]["ok"] is True and record["preflight"]["nodes"] == ["127.0.0.1"]
    node = json.loads((run_dir / "probes" / "127.0.0.1.json").read_text())
    assert node["image"]["digest"] == DIGEST  # from the runtime env
    assert record["probe"]["ranks"] == [node]
    runtime_env = json.loads((run_dir / "runtime_env.json").read_text())
    env = json.loads((run_dir / "env.json").read_text())
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["FI_PROVIDER"] == "efa"
    assert {k: runtime_env["env_vars"][k] for k in env} == env
    assert runtime_env["env_vars"]["RECIPE_BUNDLE_IMAGE_DIGEST"] == DIGEST
    # the job's own output (a probe run as the job, with the recipe's env expanded on the cluster) is in its log
    log = (run_dir / "logs" / "job.log").read_text()
    job_probe = json.loads(log[log.index('{\n  "components"') : log.rindex("}") + 1])
    assert job_probe["node"] == "job" and job_probe["image"]["digest"] == DIGEST
    assert (
        (run_dir / "submit.sh")
        .read_text()
        .startswith("#!/usr/bin/env bash\nray job submit --address " + ray_head.address)
    )


def test_job_that_exits_non_zero(tmp_path, ray_head):
    result, run_dir, record = submit(
        tmp_path, ray_head.address, "launcher.job=[python3,-c,'import sys; print(\"boom\"); sys.exit(7)']"
    )
    assert result.returncode == 1
    assert record["status"] == "failed"
    assert record["reason"].endswith("failed: Job entrypoint command failed with exit code 7; last log line: boom"), (
        record["reason"] + ray_head.logs()
    )
    assert record["preflight"]["ok"] is True  # the nodes were fine; the job failed
    assert "boom" in (run_dir / "logs" / "job.log").read_text()


def test_wait_dashboard_counts_the_alive_nodes(ray_head, capsys):
    """`jobsteps wait-dashboard --nodes N` (what sbatch.sh waits on between waves of Ray worker nodes) reads the
    head's state API: one node alive here, so 1 passes at once and 2 times out naming the count."""
    from trainer.launch.jobsteps import alive_nodes, wait_dashboard

    assert alive_nodes(ray_head.address) == 1
    assert wait_dashboard(ray_head.address, 30, nodes=1) == 0
    assert wait_dashboard(ray_head.address, 2, nodes=2) == 1
    assert "(1 of 2 nodes alive)" in capsys.readouterr().err
    assert alive_nodes(f"http://127.0.0.1:{free_port()}") == "Connection refused"


def test_unreachable_cluster(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    result, run_dir, record = submit(tmp_path, address, "launcher.job=[python3,-c,pass]")
    assert result.returncode == 1
    assert record["status"] == "failed"
    assert record["reason"] == f"launcher.address {address}: Ray cluster unreachable (Connection refused)"
    assert json.loads((run_dir / "job.json").read_text())["argv"] == ["python3", "-c", "pass"]  # launcher.job
    assert json.loads((run_dir / "argv.json").read_text())[:2] == ["python3", "train.py"]  # the miles launch


def test_ranks_follow_node_address_then_gpu_id_whatever_the_bundle_order():
    """``ray_workers.rank_order``: the actors as Ray placed them (by bundle) ranked by node address as a number
    (127.0.0.9 before 127.0.0.10, which a string sort would swap), then by GPU id; a node that names no IP address
    is refused."""
    from trainer.launch.ray_workers import rank_order

    nodes = [
        {"address": "127.0.0.10", "gpu": 0},
        {"address": "127.0.0.9", "gpu": 1},
        {"address": "127.0.0.10", "gpu": 1},
        {"address": "127.0.0.9", "gpu": 0},
        {"address": "::1", "gpu": 0},
    ]
    assert rank_order(nodes) == [3, 1, 0, 2, 4]
    assert rank_order([]) == []
    with pytest.raises(ValueError):
        rank_order([{"address": "n1", "gpu": 0}])


JOIN = """
import os, sys
import torch, torch.distributed as dist
from trainer.launch import cpu_worker
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=cpu_worker.rendezvous(None), rank=rank, world_size=2)
total = torch.ones(1) * (rank + 1)
dist.all_reduce(total)
print(f"sum {total.item()}", flush=True)
dist.destroy_process_group()
"""


def join_two(env: dict[str, str]) -> list[list[str]]:
    """Ranks 0 and 1 of :data:`JOIN` started at once with ``env``; the last two words each printed. Asserts that
    both exited 0 (within 120 s; killed otherwise)."""
    ranks = [
        subprocess.Popen([sys.executable, "-c", JOIN, str(rank)], env=env, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0]
    return [out.split()[-2:] for out in outputs]


def test_rank_zero_holds_the_rendezvous_port_until_every_rank_has_joined(tmp_path, monkeypatch):
    """``ray_workers.host_store`` through rank 0's actor (``Rank.rendezvous_port``, its node's address on
    127.0.0.1): the store's port stays bound from the moment the actor names it, also after a garbage collection
    (no other socket can take it: the race that failed a resumed four-node run with EADDRINUSE), on the address
    named only (another loopback address may bind that port; an address not this host's is refused). Two ranks
    with the environment ``rank_env`` gives them form a gloo group through it (all_reduce of 1 and 2 gives 3 on
    both); rank 0 started without :data:`AGENT_STORE_ENV` would start a store of its own on that port, and fails."""
    import errno
    import gc
    import socket

    import ray

    from trainer.launch.ray_workers import AGENT_STORE_ENV, Rank, host_store, rank_env

    with pytest.raises(OSError):  # not this host's address: refused at once, not after a client's timeout
        host_store("192.0.2.1", 2)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    actor = Rank()
    port = actor.rendezvous_port(2)
    gc.collect()
    for reuse in (0, 1):
        with socket.socket() as sock, pytest.raises(OSError) as taken:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
            sock.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
    with socket.socket() as other:  # bound to the address named, not to every interface
        other.bind(("127.0.0.2", port))
    node = {"name": "n1", "interface": "lo"}
    env = {**os.environ, "PYTHONPATH": str(helpers.REPO_ROOT), **rank_env("127.0.0.1", port, node)}
    assert AGENT_STORE_ENV.items() <= env.items()
    assert join_two(env) == [["sum", "3.0"], ["sum", "3.0"]]

    alone = {k: v for k, v in env.items() if k not in AGENT_STORE_ENV}
    rank0 = subprocess.run(
        [sys.executable, "-c", JOIN, "0"], env=alone, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert rank0.returncode != 0 and "EADDRINUSE" in rank0.stderr, rank0.stderr[-2000:]
    del actor.store
    gc.collect()
    with socket.socket() as sock:  # the store gone, its port is free again
        sock.bind(("127.0.0.1", port))


def test_ranks_meet_at_an_ipv6_address():
    """A node whose Ray address is IPv6 (here ``::1``): the store listens there and two ranks form their gloo
    group through ``tcp://[::1]:PORT`` (``cpu_worker.tcp_url``; unbracketed, torch would read no port)."""
    import socket

    from trainer.launch.ray_workers import host_store, rank_env

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as ex:
        pytest.skip(f"no IPv6 loopback here: {ex}")
    store = host_store("::1", 2)
    env = {
        **os.environ,
        "PYTHONPATH": str(helpers.REPO_ROOT),
        **rank_env("::1", store.port, {"name": "n1", "interface": "lo"}),
    }
    assert join_two(env) == [["sum", "3.0"], ["sum", "3.0"]]
    del store


LOST = """
import os, sys
import torch, torch.distributed as dist
from trainer.launch import cpu_worker
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=cpu_worker.rendezvous(None), rank=rank, world_size=2)
dist.barrier()
if rank == 1:
    os._exit(0)  # a lost node: gone without leaving the group
try:
    dist.all_reduce(torch.ones(1))
except Exception as ex:
    print(ex, flush=True)
"""


def test_interface_of_finds_the_network_holding_an_ipv4_or_ipv6_address():
    """``ray_workers.interface_of`` over a ``psutil.net_if_addrs()`` table: IPv4 by netmask, IPv6 by its mask as
    a prefix length (a link-local address's ``%scope`` dropped), loopback ``lo``; an address on no interface's
    network is None; a name is refused. And on this host, 127.0.0.1 is on ``lo``."""
    from collections import namedtuple
    from socket import AF_INET, AF_INET6, AF_PACKET

    import ray  # noqa: F401 - puts the psutil Ray ships on sys.path

    from trainer.launch.ray_workers import interface_of

    addr = namedtuple("snicaddr", "family address netmask broadcast ptp")
    table = {
        "lo": [
            addr(AF_INET, "127.0.0.1", "255.0.0.0", None, None),
            addr(AF_INET6, "::1", "ffff:" * 7 + "ffff", None, None),
        ],
        "eth0": [
            addr(AF_PACKET, "52:54:00:12:34:56", None, "ff:ff:ff:ff:ff:ff", None),
            addr(AF_INET, "10.1.2.3", "255.255.255.0", "10.1.2.255", None),
            addr(AF_INET6, "fd00::2", "ffff:ffff:ffff:ffff::", None, None),
            addr(AF_INET6, "fe80::5054:ff:fe12:3456%eth0", "ffff:ffff:ffff:ffff::", None, None),
        ],
        "ib0": [addr(AF_INET6, "fd01:0:0:7::1", "ffff:ffff:ffff:ff00::", None, None)],
    }
    found = {
        address: interface_of(address, table)
        for address in (
            "127.0.0.5",
            "::1",
            "10.1.2.200",
            "10.1.3.1",
            "fd00::1234",
            "fd00:0:0:0::9",
            "fe80::1",
            "fd01:0:0:1::1",
            "fd01:0:0:100::1",
            "2001:db8::1",
            "::ffff:10.1.2.3",
        )
    }
    assert found == {
        "127.0.0.5": "lo",
        "::1": "lo",
        "10.1.2.200": "eth0",
        "10.1.3.1": None,
        "fd00::1234": "eth0",
        "fd00:0:0:0::9": "eth0",
        "fe80::1": "eth0",
        "fd01:0:0:1::1": "ib0",
        "fd01:0:0:100::1": None,
        "2001:db8::1": None,
        "::ffff:10.1.2.3": None,
    }
    with pytest.raises(ValueError):
        interface_of("n1", table)
    assert interface_of("127.0.0.1") == "lo"


def test_a_lost_peer_is_named_by_its_ipv4_or_ipv6_address():
    """``ray_workers.suspect_nodes``: the nodes whose addresses a rank's gloo error names as its lost peer, IPv4
    or IPv6 (in any spelling of the same address); nothing for an error that names none."""
    from trainer.launch.ray_workers import suspect_nodes

    nodes = [
        {"id": "a", "name": "n1", "address": "127.0.0.2"},
        {"id": "b", "name": "n2", "address": "fd00::3"},
        {"id": "c", "name": "n3", "address": "127.0.0.4"},
    ]
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [{}]:40021"
    assert suspect_nodes(nodes, 0, RuntimeError(gloo.format("127.0.0.4"))) == {"c": "n3"}
    assert suspect_nodes(nodes, 0, RuntimeError(gloo.format("fd00:0::3"))) == {"b": "n2"}
    assert suspect_nodes(nodes, 0, RuntimeError(gloo.format("fd00::3") + "; " + gloo.format("127.0.0.2"))) == {
        "a": "n1",
        "b": "n2",
    }
    assert suspect_nodes(nodes, 0, RuntimeError(gloo.format("fd00::99"))) == {}
    assert suspect_nodes(nodes, 0, RuntimeError("Timed out waiting 1800000ms for recv operation")) == {}


def test_a_rank_lost_is_named_by_its_peers_gloo_error():
    """Two ranks in a gloo group on loopback (the store at 127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``); rank 1 exits
    without leaving it, and rank 0's failed all_reduce names its peer as this torch's gloo words it, so that
    ``suspect_nodes`` finds rank 1's node and not another."""
    from trainer.launch.ray_workers import host_store, rank_env, suspect_nodes

    store = host_store("127.0.0.1", 2)
    env = {
        **os.environ,
        "PYTHONPATH": str(helpers.REPO_ROOT),
        **rank_env("127.0.0.1", store.port, {"name": "n1", "interface": "lo"}),
    }
    ranks = [
        subprocess.Popen([sys.executable, "-c", LOST, str(rank)], env=env, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    try:
        error = ranks[0].communicate(timeout=120)[0]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    del store
    assert "[127.0.0.1]:" in error, error
    nodes = [{"id": "a", "name": "n1", "address": "127.0.0.2"}, {"id": "b", "name": "n2", "address": "127.0.0.1"}]
    assert suspect_nodes(nodes, 0, RuntimeError(error)) == {"b": "n2"}


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
