"""``bin/test-cluster up|run|status|down DIR``: the tests' multi-node cluster, by hand.

The same fixtures the tests use (:mod:`launch_fixtures`): a network namespace of its own with only loopback
(:class:`launch_fixtures.NetNamespace`), and in it munged, slurmctld and ``--nodes`` slurmd ``n1`` .. ``nN`` at
127.0.0.2 .. (:class:`launch_fixtures.LocalSlurm`); with ``--tools ROOTFS`` (``lockfiles/slurm-node.lock.json``
built and unpacked) every node has enroot and pyxis; with ``--ray`` a Ray cluster of as many nodes runs in the
same namespace (:class:`launch_fixtures.LocalRayCluster`, dashboard at 127.0.0.1:8265 in it). Nothing binds
outside the namespace.

* ``up DIR`` starts a supervisor process that holds all of it under ``DIR`` (configs, state, logs), writes
  ``DIR/cluster.json`` (its PID, the namespace, ``SLURM_CONF``, the nodes and their addresses) once every node
  is idle, and stops everything on ``down``, on SIGTERM, or after ``--lifetime`` seconds. ``up`` returns then:
  exit 0 and how to use it, or 1 with the end of the supervisor's log.
* ``run DIR -- CMD ...`` runs CMD inside the cluster (its namespace, ``SLURM_CONF``, a host name the daemons
  reach, with ``--tools`` the client's ``/opt``): ``sinfo``, ``srun -N4 hostname``, ``bin/train ...``.
* ``status DIR`` prints the nodes and their states (``--json``: cluster.json with ``states``); exit 1 when
  none is running there.
* ``down DIR`` stops the supervisor and waits for it (everything it started is stopped by PID).

Needs root (namespaces, Slurm's daemons), Slurm and munge (Debian slurm-wlm munge).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from launch_fixtures import (  # noqa: E402
    CLONE_NEWNET,
    LOGIN,
    LocalRayCluster,
    LocalSlurm,
    NetNamespace,
    _libc,
    _loopback_hostname,
    _overlay_opt,
    missing_slurm,
)

STATE = "cluster.json"
PROG = "bin/test-cluster"


class ClusterError(Exception):
    """A one-line refusal: printed as ``test-cluster: error: ...``, exit 2 (1 for a cluster not running)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def state_of(root: Path) -> dict:
    """``root/cluster.json`` of a running supervisor; :class:`ClusterError` (exit 1) when there is none."""
    try:
        state = json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        raise ClusterError(f"{root}: no test cluster running (no readable {STATE}); start one: up {root}", 1) from None
    if not isinstance(state, dict) or not isinstance(state.get("pid"), int) or not isinstance(state.get("netns"), str):
        raise ClusterError(f"{root / STATE}: expected the supervisor's record (pid, netns, slurm_conf, nodes)", 1)
    if not Path(f"/proc/{state['pid']}").exists():
        raise ClusterError(f"{root}: its supervisor (PID {state['pid']}) is gone; remove {root / STATE}", 1)
    return state


def serve(args: argparse.Namespace) -> int:
    """The supervisor: start the namespace, Slurm (and Ray), write cluster.json, hold them until told to stop."""
    root = args.dir
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    tools = Path(args.tools).absolute() if args.tools else None
    with (
        NetNamespace(lifetime_s=args.lifetime + 60) as netns,
        LocalSlurm(
            root / "slurm",
            gpus=args.gpus,
            cpus=args.cpus,
            nodes=args.nodes,
            netns=netns,
            tools=tools,
            lifetime_s=args.lifetime,
        ) as slurm,
    ):
        ray = LocalRayCluster(root / "ray", netns, nodes=args.nodes, lifetime_s=args.lifetime) if args.ray else None
        try:
            if ray is not None:
                ray.start()
            state = {
                "pid": os.getpid(),
                "netns": netns.path,
                "slurm_conf": str(slurm.conf),
                "nodes": slurm.names,
                "addresses": slurm.addresses,
                "tools": str(tools) if tools else None,
                "ray": {"address": ray.address} if ray is not None else None,
                "until_unix": int(time.time()) + args.lifetime,
            }
            (root / (STATE + ".tmp")).write_text(json.dumps(state, indent=1) + "\n")
            os.replace(root / (STATE + ".tmp"), root / STATE)
            print(f"up: {json.dumps(state)}", flush=True)
            deadline = time.monotonic() + args.lifetime
            while not stop["now"] and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            (root / STATE).unlink(missing_ok=True)
            if ray is not None:
                ray.stop()
    print("down", flush=True)
    return 0


def up(args: argparse.Namespace) -> int:
    """Start the supervisor in a session of its own and wait until it has written cluster.json."""
    if os.geteuid() != 0:
        raise ClusterError("needs root (network, mount and UTS namespaces; Slurm's daemons)")
    if missing_slurm():
        raise ClusterError(f"Slurm is not installed (missing: {' '.join(missing_slurm())}; Debian slurm-wlm munge)")
    root = args.dir
    if args.tools and not (Path(args.tools) / "opt" / "enroot" / "bin" / "enroot").is_file():
        raise ClusterError(
            f"--tools {args.tools}: expected a root file system with opt/enroot/bin/enroot "
            "(lockfiles/slurm-node.lock.json built and unpacked)"
        )
    if (root / STATE).exists():
        try:
            state_of(root)
            raise ClusterError(f"{root}: a test cluster is already running there (down {root} first)")
        except ClusterError as ex:
            if ex.code != 1:
                raise
            (root / STATE).unlink()
    root.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "serve", str(root), f"--nodes={args.nodes}", f"--cpus={args.cpus}"]
    argv += [f"--gpus={args.gpus}", f"--lifetime={args.lifetime}"]
    argv += [f"--tools={args.tools}"] if args.tools else []
    argv += ["--ray"] if args.ray else []
    with open(root / "cluster.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 180
    while not (root / STATE).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
            tail = (root / "cluster.log").read_text(errors="replace")[-1500:]
            print(
                f"test-cluster: error: the cluster did not come up (log {root / 'cluster.log'}):\n{tail}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.3)
    state = json.loads((root / STATE).read_text())
    if args.json:
        print(json.dumps(state, indent=1))
        return 0
    nodes, addresses = state["nodes"], state["addresses"]
    listed = ", ".join(f"{n} ({addresses[n]})" for n in nodes)
    print(f"test cluster up in {root}: {len(nodes)} Slurm nodes {listed}")
    if state["ray"]:
        print(f"  Ray: {len(nodes)} nodes, job submission at {state['ray']['address']} (inside the cluster)")
    print(f"  stops by itself in {args.lifetime} s; by hand: {PROG} down {root}")
    print(f"  {PROG} run {root} -- srun -N{len(nodes)} hostname -i")
    return 0


def enter(state: dict, root: Path) -> None:
    """Join the cluster as its clients do: its network namespace, (with tools) the client's ``/opt``, and a UTS
    namespace whose host name is ``127.0.0.1``."""
    fd = os.open(state["netns"], os.O_RDONLY)
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        raise ClusterError(f"cannot join the cluster's network namespace {state['netns']}")
    os.close(fd)
    if state["tools"]:
        tools = Path(state["tools"])
        _overlay_opt([root / "slurm" / "layers" / LOGIN / "opt", tools / "opt", Path("/opt")])
    _loopback_hostname("127.0.0.1")


def client_env(state: dict) -> dict[str, str]:
    """This environment with the cluster's ``SLURM_CONF`` (and enroot on ``PATH`` with tools)."""
    env = {**os.environ, "SLURM_CONF": state["slurm_conf"]}
    if state["tools"]:
        env["PATH"] = "/opt/enroot/bin" + os.pathsep + env.get("PATH", "")
    return env


def run(args: argparse.Namespace) -> int:
    """Exec ``args.command`` inside the cluster (never returns on success)."""
    state = state_of(args.dir)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ClusterError("run DIR -- CMD [ARGS]: no command given")
    enter(state, args.dir)
    try:
        os.execvpe(command[0], command, client_env(state))
    except OSError as ex:
        raise ClusterError(f"{command[0]}: {ex.strerror}", 127) from None


def status(args: argparse.Namespace) -> int:
    """Print the nodes' states (``sinfo`` inside the cluster)."""
    state = state_of(args.dir)
    sinfo = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"],
        capture_output=True,
        text=True,
        timeout=30,
        env=client_env(state),
        preexec_fn=lambda: enter(state, args.dir),
    )
    states = dict(line.split() for line in sinfo.stdout.splitlines() if len(line.split()) == 2)
    if args.json:
        print(json.dumps({**state, "states": states}, indent=1))
    else:
        for node in state["nodes"]:
            print(f"{node}  {state['addresses'][node]}  {states.get(node, 'unknown')}")
    return 0 if sinfo.returncode == 0 else 1


def down(args: argparse.Namespace) -> int:
    """SIGTERM the supervisor and wait up to 90 s for it to stop what it started."""
    state = state_of(args.dir)
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 90
    while Path(f"/proc/{state['pid']}").exists() and time.monotonic() < deadline:
        try:  # the supervisor is not our child (up started it in its own session): it may linger as a zombie
            if Path(f"/proc/{state['pid']}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.3)
    if Path(f"/proc/{state['pid']}/stat").exists() and (args.dir / STATE).exists():
        raise ClusterError(f"{args.dir}: the supervisor (PID {state['pid']}) did not stop in 90 s", 1)
    print(f"test cluster in {args.dir} stopped")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line: up, run, status, down (and serve, the supervisor up starts), each taking DIR."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("up", "start a cluster under DIR"),
        ("serve", "(internal) the supervisor up starts"),
        ("run", "run a command inside the cluster: run DIR -- CMD"),
        ("status", "the nodes and their states"),
        ("down", "stop the cluster under DIR"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("dir", type=lambda v: Path(v).absolute(), help="the cluster's directory")
        if name in ("up", "serve"):
            s.add_argument("--nodes", type=int, default=4, help="Slurm nodes n1..nN (default 4, at most 8)")
            s.add_argument("--cpus", type=int, default=2, help="CPUs each node offers (default 2)")
            s.add_argument("--gpus", type=int, default=0, help="simulated GPUs each node offers (default 0)")
            s.add_argument("--tools", help="root file system with enroot and pyxis in /opt (slurm-node.lock.json)")
            s.add_argument("--ray", action="store_true", help="a Ray cluster of as many nodes, in the same namespace")
            s.add_argument("--lifetime", type=int, default=3600, help="seconds until it stops by itself (default 3600)")
        if name in ("up", "status"):
            s.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "run":
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS]")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; exit 0, 1 (no cluster running, or it did not come up), 2 (refused input)."""
    args = parser().parse_args(argv)
    if getattr(args, "nodes", 1) not in range(1, 9):
        print("test-cluster: error: --nodes: expected 1 to 8", file=sys.stderr)
        return 2
    try:
        return {"up": up, "serve": serve, "run": run, "status": status, "down": down}[args.cmd](args)
    except ClusterError as ex:
        print(f"test-cluster: error: {ex}", file=sys.stderr)
        return ex.code


if __name__ == "__main__":
    raise SystemExit(main())
