"""The driver of ``launcher.payload=cpu`` on a Ray cluster: one CPU-worker actor per slot, placed as miles places its
training actors, training data parallel under torch.distributed (gloo).

``python -m trainer.launch.ray_workers RUN_DIR ROWS_DIR --world N`` runs as the Ray job (after
:mod:`trainer.launch.ray_entry`'s preflight), on a cluster whose nodes offer ``GPU`` slots (``ray start
--num-gpus=G``; on CPU nodes the slots are declared, not detected). It

1. reserves ``N`` bundles of one ``GPU`` each in a placement group with strategy ``PACK`` (miles'
   ``create_placement_groups``: one bundle per training process, packed onto as few nodes as hold them) and waits
   for them (``--placement-timeout``, seconds; on expiry: exit 4 with the slots free and wanted);
2. starts one actor per bundle and orders them by node address, then by the GPU id Ray gave each (miles sorts
   its bundles the same way; :func:`rank_order`), so that consecutive ranks share a node: rank ``r`` is the
   ``r``-th actor in that order;
3. rank 0's actor hosts torch.distributed's TCP store on its node's address, at a port the kernel gives it and
   which it keeps listening from then on (:func:`host_store`): ``MASTER_ADDR``/``MASTER_PORT`` of every rank, each
   joining it as a client (torch.distributed's TCP rendezvous, no shared file); ``GLOO_SOCKET_IFNAME`` on each node
   is the interface that holds the node's Ray address, found on that node (``lo`` on a loopback test cluster, the
   cluster network's interface on hosts);
4. runs :func:`trainer.launch.cpu_worker.main` in every actor (``RUN_DIR RANK WORLD ROWS_DIR``: rank 0 appends
   ``metrics.jsonl``, every rank writes ``probe-rank-RANK.json`` with its Ray node's name in ``node``) and waits.

Exit 0 when every rank returned; 1 when one failed: the first failure printed as one line naming the rank, its
Ray node and the cause (a rank that raised, an actor whose process or node died), after the other ranks are
killed. A node that dies whole (its raylet with its ranks) first shows as an actor of it the driver can no longer
reach (``ActorUnavailableError``) or as a surviving rank's gloo error naming the lost peer's address ("Connection
closed by peer [ADDR]:PORT"); the driver then waits up to :data:`NODE_LOSS_WAIT_S` for Ray's health check to mark
that node dead, and the line names the node and the ranks it held (:func:`suspect_nodes`, :func:`lost_node`).
``RUN_DIR`` must be on a file system every node sees (one machine, or a shared mount).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.launch import cpu_worker

EXIT_FAILED, EXIT_PLACEMENT = 1, 4
# how long a rank's failure that names a peer node waits for Ray to mark that node dead: Ray's GCS declares a node
# dead after health_check_failure_threshold (5) missed checks of health_check_period_ms (3,000) each, about 15 s
# after its raylet is gone (ray/_private/ray_constants.py and the GCS health-check manager's defaults, Ray 2.x)
NODE_LOSS_WAIT_S = 40.0
# a gloo error's peer, its address in brackets either way: "[127.0.0.4]:40021", "[fd00::4]:40021"
# (gloo/transport/tcp/address.cc, Address::str)
PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


def interface_of(address: str, interfaces: Mapping[str, Sequence[Any]] | None = None) -> str | None:
    """The name of the network interface whose network (IPv4 or IPv6) holds ``address``, or None: ``lo`` for any
    127.0.0.0/8 address and for ``::1``. ``interfaces`` is ``psutil.net_if_addrs()``'s table (name -> addresses
    with ``family``, ``address``, ``netmask``), read from psutil (which Ray ships and puts on ``sys.path``) when
    None; an IPv6 address's ``%scope`` suffix is dropped. Raises ``ValueError`` for a string that is not an IP
    address."""
    ip = ipaddress.ip_address(address)
    if interfaces is None:
        import psutil

        interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6) or not addr.netmask:
                continue
            mask = ipaddress.ip_address(addr.netmask)
            prefix = bin(int(mask)).count("1")  # ipaddress reads an IPv6 mask only as a prefix length
            network = ipaddress.ip_network(f"{addr.address.split('%')[0]}/{prefix}", strict=False)
            if ip.version == network.version and ip in network:
                return name
    return None


# every rank joins the store rank 0's actor hosts as a client, as ranks under torchrun's agent do
# (torch/distributed/rendezvous.py, _create_c10d_store: rank 0 then starts no store of its own)
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def host_store(address: str, world: int) -> Any:
    """torch.distributed's ``TCPStore`` server for a group of ``world`` ranks, listening on ``address`` only (an
    IP address of this host) at a port the kernel gives (``.port``), until the returned store is dropped. Raises
    ``OSError`` when ``address`` is not this host's, ``ValueError`` when it is not an IP address, and torch's
    ``DistNetworkError`` (a ``RuntimeError``) when the store cannot start; the socket is closed then.

    The port is held, not probed and released: a port from the kernel's ephemeral range, released, may go to any
    process's outgoing connection (Ray's processes open many) before rank 0 binds it, and rank 0 then fails with
    EADDRINUSE. The socket is bound here and handed to the store (``master_listen_fd``), which would otherwise
    listen on every interface. Ranks join it with :data:`AGENT_STORE_ENV` set."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        sock.listen(world)
        port = int(sock.getsockname()[1])
        fd = sock.detach()
    try:
        return TCPStore(address, port, world, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def rank_env(master: str, port: int, node: dict[str, Any]) -> dict[str, str]:
    """The environment of one rank (its actor's :meth:`Rank.node` in ``node``): rank 0's store at ``master:port``
    joined as a client (:data:`AGENT_STORE_ENV`), its node's name for its probe, gloo on its node's interface."""
    return {
        **AGENT_STORE_ENV,
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        cpu_worker.NODE_ENV: node["name"],
        "GLOO_SOCKET_IFNAME": node["interface"],
    }


class Rank:
    """A Ray actor holding one training process (``num_gpus=1``, one slot of its bundle)."""

    def node(self) -> dict[str, Any]:
        """Where this actor runs: ``{"id": Ray node id, "address": node IP, "name": Ray node name, "gpu": first
        GPU id, "pid": its process, "interface": its node's interface for gloo}`` (``GLOO_SOCKET_IFNAME`` where
        set, else the interface holding the node's address, found on that node)."""
        import ray

        context = ray.get_runtime_context()
        name = (
            next((n.get("NodeName") for n in ray.nodes() if n.get("NodeID") == context.get_node_id()), None)
            or ray.util.get_node_ip_address()
        )
        gpus = ray.get_gpu_ids()
        address = ray.util.get_node_ip_address()
        return {
            "id": context.get_node_id(),
            "address": address,
            "name": name,
            "gpu": int(gpus[0]) if gpus else 0,
            "pid": os.getpid(),
            "interface": os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(address) or "",
        }

    def rendezvous_port(self, world: int) -> int:
        """Host the group's store on this actor's node address (:func:`host_store`; rank 0's actor, for as long as
        it lives) and return its port: ``MASTER_PORT``."""
        import ray

        self.store = host_store(ray.util.get_node_ip_address(), world)
        return int(self.store.port)

    def train(self, argv: list[str], env: dict[str, str]) -> int:
        """:func:`trainer.launch.cpu_worker.main` with ``argv`` after ``env`` is set in this process; returns its
        exit code (exceptions propagate to the driver as Ray task errors)."""
        os.environ.update(env)
        return cpu_worker.main(argv)


def _kill(actors: list[Any]) -> None:
    """Stop every rank's actor (the others of a failed rank would wait in gloo until its timeout)."""
    import ray

    for actor in actors:
        ray.kill(actor)


def _failed(ref: Any, kind: type[BaseException] = Exception) -> bool:
    """Whether the finished task ``ref`` raised (an exception of ``kind``)."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except kind:
        return True
    except Exception:  # noqa: BLE001 - raised, but not of ``kind``
        return False
    return False


def suspect_nodes(nodes: list[dict[str, Any]], rank: int, error: BaseException) -> dict[str, str]:
    """The nodes (Ray node id -> name, of ``nodes``, the ranks' :meth:`Rank.node` in rank order) that rank
    ``rank``'s failure ``error`` points at as possibly lost whole: its own when the driver lost its actor's
    connection (``ActorUnavailableError``: "Socket closed", what a dead node's actors give, not the
    ``ActorDiedError`` of a process that died on a live node); those whose addresses a rank's error names as
    peers (:data:`PEER`: gloo's "Connection closed by peer [ADDR]:PORT", "Read error [ADDR]:PORT: ...", IPv4 or
    IPv6); none for any other error."""
    import ray

    if isinstance(error, ray.exceptions.ActorUnavailableError):
        return {nodes[rank]["id"]: nodes[rank]["name"]}
    if isinstance(error, ray.exceptions.RayActorError):
        return {}
    addresses = {_address(m.group(1)) for m in PEER.finditer(str(error))} - {None}
    return {n["id"]: n["name"] for n in nodes if _address(n["address"]) in addresses}


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (so that ``fd00:0::4`` and ``fd00::4`` are one), None when it is not one."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def lost_node(suspects: dict[str, str], wait_s: float = NODE_LOSS_WAIT_S) -> str | None:
    """The name of the first of ``suspects`` (Ray node id -> name) that ``ray.nodes()`` shows not alive, polled
    once a second for up to ``wait_s`` seconds; None at once without suspects, or when none died in time."""
    import ray

    if not suspects:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        dead = [suspects[n["NodeID"]] for n in ray.nodes() if n.get("NodeID") in suspects and not n.get("Alive")]
        if dead:
            return dead[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(1.0)


def place(world: int, timeout_s: float) -> Any:
    """A ``PACK`` placement group of ``world`` one-GPU bundles, ready. Raises ``TimeoutError`` (with the slots the
    cluster has) when not ready in ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([{"GPU": 1}] * world, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        total = ray.cluster_resources().get("GPU", 0)
        ray.util.remove_placement_group(group)
        raise TimeoutError(f"{world} slots (GPU) wanted, the cluster has {total:g}; not placed in {timeout_s:g} s")
    return group


def rank_order(nodes: list[dict[str, Any]]) -> list[int]:
    """Indices of ``nodes`` (each actor's :meth:`Rank.node`, by bundle) in rank order: by node address (as a number:
    127.0.0.9 before 127.0.0.10; IPv4 before IPv6), then by the GPU id Ray gave the actor, as miles sorts its
    bundles. Raises ``ValueError`` for an address that is not an IP address."""

    def key(i: int) -> tuple[int, int, int]:
        ip = ipaddress.ip_address(nodes[i]["address"])
        return ip.version, int(ip), int(nodes[i]["gpu"])

    return sorted(range(len(nodes)), key=key)


def run(run_dir: str, rows_dir: str, world: int, timeout_s: float) -> int:
    """Place, rendezvous and train (module docstring); returns the exit code. A failure's one line is printed
    after Ray is shut down, so that it is the job log's last line (the actors' output arrives asynchronously)."""
    try:
        code, error = _run(run_dir, rows_dir, world, timeout_s)
    except Exception as ex:  # noqa: BLE001 - Ray's own failures (init, placement, a probe task) as one line
        lines = [line for line in str(ex).strip().splitlines() if line.strip()]
        code, error = EXIT_FAILED, f"{type(ex).__name__}: {lines[-1].strip() if lines else ''}"
    if error:
        sys.stdout.flush()
        print(f"ray_workers: error: {error}", file=sys.stderr, flush=True)
    return code


def _run(run_dir: str, rows_dir: str, world: int, timeout_s: float) -> tuple[int, str | None]:
    """:func:`run` until Ray is shut down: (exit code, the failure's line or None)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address="auto", logging_level=logging.ERROR)
    try:
        try:
            group = place(world, timeout_s)
        except TimeoutError as ex:
            return EXIT_PLACEMENT, f"placement: {ex}"
        actor: Any = ray.remote(num_gpus=1, num_cpus=0, max_restarts=0)(Rank)
        # one actor per bundle; each names its node and GPU, and the ranks follow from that (no separate task per
        # bundle to ask first: each would start a worker process of its own)
        actors: list[Any] = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
            ).remote()
            for bundle in range(world)
        ]
        found = ray.get([a.node.remote() for a in actors])
        order = rank_order(found)
        ranks, nodes = [actors[i] for i in order], [found[i] for i in order]
        master, port = nodes[0]["address"], ray.get(ranks[0].rendezvous_port.remote(world))
        for rank, node in enumerate(nodes):
            print(f"rank {rank}: node {node['name']} ({node['address']}), slot {node['gpu']}, pid {node['pid']}")
        print(f"rendezvous: {cpu_worker.tcp_url(master, port)}", flush=True)
        started = time.monotonic()
        refs = {
            ranks[rank].train.remote(
                [run_dir, str(rank), str(world), rows_dir],
                rank_env(master, port, node),
            ): rank
            for rank, node in enumerate(nodes)
        }
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if _failed(done[0]):  # the others' failures follow within moments: blame a dead actor before them
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
                dead = [r for r in [done[0], *more] if _failed(r, ray.exceptions.RayActorError)]
                done = dead[:1] or done
            rank = refs[done[0]]
            try:
                code = ray.get(done[0])
            except Exception as ex:  # noqa: BLE001 - any rank's failure ends the run, named in one line
                cause = str(ex).strip().splitlines()
                last = next((line for line in reversed(cause) if line.strip()), type(ex).__name__)
                last = last.split(" Some common causes")[0]  # Ray's advice after the cause of a dead actor
                seen = f"{type(ex).__name__}: {last.strip()}"
                lost = lost_node(suspect_nodes(nodes, rank, ex))
                elapsed = time.monotonic() - started
                _kill(ranks)
                if lost is not None:
                    held = ", ".join(str(r) for r, node in enumerate(nodes) if node["name"] == lost)
                    return EXIT_FAILED, (
                        f"node {lost} lost after {elapsed:.0f} s (Ray marks it dead), with rank(s) {held}; "
                        f"rank {rank} on node {nodes[rank]['name']} saw {seen}"
                    )
                return EXIT_FAILED, f"rank {rank} on node {nodes[rank]['name']} failed after {elapsed:.0f} s: {seen}"
            if code != 0:
                _kill(ranks)
                return EXIT_FAILED, f"rank {rank} on node {nodes[rank]['name']} exited {code}"
        print(f"ray_workers: {world} ranks on {len({n['name'] for n in nodes})} node(s) done", flush=True)
        return 0, None
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring. Exit 0, 1 (a rank failed), 2 (bad arguments), 4 (placement)."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.launch.ray_workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the run directory (shared by every node)")
    parser.add_argument("rows_dir", help="the fixed rows (trainer data build output)")
    parser.add_argument("--world", type=int, required=True, help="training processes (one per slot)")
    parser.add_argument("--placement-timeout", type=float, default=120.0, help="seconds to wait for the slots")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world {args.world}: expected at least 1")
    return run(args.run_dir, args.rows_dir, args.world, args.placement_timeout)


if __name__ == "__main__":
    raise SystemExit(main())
