"""A real single-node Slurm cluster and a real Ray head on loopback, for the tests and demos of the launchers.

Everything binds to 127.0.0.1 only, lives in a directory the caller gives (configs, state, logs, sockets),
is bounded in time (``timeout``) and is stopped by the PIDs this module started, never by name:

* :class:`LocalSlurm`: a private ``munged`` (its own key and socket), ``slurmctld`` and ``slurmd -N localhost``
  from a private ``slurm.conf`` (``SlurmctldHost=localhost(127.0.0.1)``, ``NodeAddr=127.0.0.1``: addresses, not
  names to look up, so no ``/etc/hosts`` is needed; ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`` and
  daemons whose host name is ``127.0.0.1`` in their own UTS namespace, so that nothing listens on other
  interfaces), with ``gpus`` GPUs simulated by character
  devices (``mknod``, major 195 as NVIDIA's) for scheduling only. ``env()`` gives the ``SLURM_CONF`` for
  ``sbatch``/``squeue``.
* :class:`LocalRay`: ``ray start --head --block`` on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
  ``--node-ip-address=127.0.0.1``, dashboard on 127.0.0.1, usage stats off), stopped by SIGTERM to its PID
  with draining off, then SIGKILL to every process it started that is still alive.

Facts (Debian slurm-wlm 22.05, munge 0.5.15, PyPI ray 2.60): shared/docs/CLUSTER.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol")


def _search_path() -> str:
    """PATH plus the system directories the daemons live in (Bazel's strict action env drops /usr/sbin)."""
    return os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"


def missing_slurm() -> list[str]:
    """The Slurm/munge programs absent from PATH (and /usr/sbin)."""
    return [b for b in SLURM_BINARIES if shutil.which(b, path=_search_path()) is None]


def missing_ray() -> str | None:
    """None when the ``ray`` CLI is beside this interpreter or on PATH, else why not."""
    beside = Path(sys.executable).parent / "ray"
    return None if beside.is_file() or shutil.which("ray") else "the ray CLI (PyPI ray[default]) is not installed"


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A TCP port free on 127.0.0.1 in [low, high) (outside Ray's default worker ports 10002-19999 and the
    kernel's ephemeral range)."""
    import random

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port on 127.0.0.1")


def _descendants(pid: int) -> list[int]:
    """PIDs whose parent chain reaches ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        out += children
        frontier += children
    return out


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (SIGKILL after ``grace_s``), then SIGKILL every descendant it had that is still alive
    (by PID: daemons that double-fork, workers in their own sessions)."""
    family = _descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_matching(needle: str) -> None:
    """SIGKILL every process whose command line contains ``needle`` (read from /proc): what a process that
    exited left running in other process groups."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue


def _wait_for(predicate, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log and log.is_file() else ""
    raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s\n{tail}")


def _loopback_hostname(name: str = "127.0.0.1") -> None:
    """In a child before exec: a UTS namespace of its own whose host name is ``name`` (an address, ``127.0.0.1``).

    With ``NoInAddrAny``/``NoCtldInAddrAny`` the Slurm daemons bind to the address of ``gethostname()`` (Slurm
    22.05 ``slurm_setup_addr``), which would need the machine's name to resolve (``/etc/hosts``) and could be a
    public address; an address as the name resolves without any lookup, to loopback. Needs root (CAP_SYS_ADMIN).
    """
    import ctypes

    if ctypes.CDLL("libc.so.6", use_errno=True).unshare(0x04000000) != 0:  # CLONE_NEWUTS, <sched.h>
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed")
    socket.sethostname(name)


ENROOT_PREFIX, PYXIS_PREFIX = "/opt/enroot", "/opt/pyxis"  # where lockfiles/slurm-node.lock.json installs them
LOGIN = "login"  # the view of /opt that Slurm's clients (sbatch, srun outside a job) get
MS_RDONLY, MS_REC, MS_PRIVATE = 1, 16384, 1 << 18  # <sys/mount.h>
CLONE_NEWNS = 0x00020000  # <sched.h>


def _overlay_opt(lowers: list[Path]) -> None:
    """In a child before exec: a mount namespace of its own (mounts private, so nothing reaches this machine's)
    whose ``/opt`` is a read-only overlay of ``lowers``, the first on top. enroot and pyxis find their
    configuration under the prefix they were built with (``/opt/enroot/etc``, ``/opt/pyxis``), so each node's
    own files sit in a layer over the built tree, which sits over this machine's ``/opt``. Needs root."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate / failed")
    options = ("lowerdir=" + ":".join(str(p) for p in lowers)).encode()
    if libc.mount(b"overlay", b"/opt", b"overlay", MS_RDONLY, options) != 0:
        raise OSError(ctypes.get_errno(), f"overlay on /opt ({options.decode()}) failed")


class LocalSlurm:
    """munged + slurmctld + one slurmd per node on this machine under ``root`` (a fresh directory). Use as a
    context manager.

    ``nodes``: 1 gives the node ``localhost``; more give ``n1`` ... ``nN``, each its own slurmd (``-N nI``) with
    its own port, spool, pid and log file, all on 127.0.0.1 (Slurm 22.05's slurmd binds 127.0.0.1 whatever
    ``NodeAddr`` says); ``gpus`` and ``cpus``: what each node offers to the scheduler (simulated devices, gres
    ``gpu``); ``lifetime_s``: upper bound of every daemon's life (``timeout``), in case the caller never stops
    them; ``tools``: a root file system holding enroot and pyxis under ``/opt`` (lockfiles/slurm-node.lock.json,
    unpacked), which every node and client then sees at ``/opt`` in a mount namespace of its own, pyxis loaded
    through ``PlugStackConfig`` (each node's ``runtime_path`` and enroot paths its own: :meth:`_write_node_layers`).
    """

    def __init__(
        self,
        root: Path,
        gpus: int = 2,
        cpus: int = 2,
        memory_mb: int = 4000,
        lifetime_s: int = 600,
        nodes: int = 1,
        netns: NetNamespace | None = None,
        tools: Path | None = None,
    ):
        self.root = Path(root)
        self.netns = netns
        self.tools = Path(tools).absolute() if tools is not None else None
        self.gpus, self.cpus, self.memory_mb, self.lifetime_s = gpus, cpus, memory_mb, lifetime_s
        self.names = ["localhost"] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]
        # in a namespace of its own each node has its own address (n1 127.0.0.2, ...) and host name (that address)
        self.addresses = {
            name: f"127.0.0.{i + 2}" if netns is not None else "127.0.0.1" for i, name in enumerate(self.names)
        }
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        # munged's socket and slurmd's spool (slurmstepd sockets) need paths under the 108-byte limit of a unix
        # socket address; a deep ``root`` (Bazel's TEST_TMPDIR is ~125 bytes) gets a short directory of their own
        self.short: Path | None = None
        self.sockets = self.root
        if len(str(self.root.absolute())) > 48:
            self.short = self.sockets = Path(tempfile.mkdtemp(prefix="rb-slurm-", dir="/tmp"))

    def env(self) -> dict[str, str]:
        """The environment for Slurm commands against this cluster (with ``tools``: enroot's ``bin`` on ``PATH``,
        where pyxis looks for ``enroot``)."""
        path = _search_path() if self.tools is None else f"{ENROOT_PREFIX}/bin{os.pathsep}{_search_path()}"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    def _write_node_layers(self) -> None:
        """With ``tools``: each node's own files over ``/opt`` (and the client's, ``login``): pyxis's
        ``plugstack.conf`` with the node's ``runtime_path``, and an ``enroot.conf.d`` file with the node's runtime,
        cache, data and temp paths, so that four nodes on one machine keep their containers apart."""
        for name in [*self.names, LOGIN]:
            state = self.root / "nodes" / name
            layer = self.root / "layers" / name / "opt"
            (layer / "pyxis" / "etc").mkdir(parents=True, exist_ok=True)
            (layer / "pyxis" / "etc" / "plugstack.conf").write_text(
                f"required {PYXIS_PREFIX}/lib/slurm/spank_pyxis.so runtime_path={state}/pyxis\n"
            )
            conf_d = layer / "enroot" / "etc" / "enroot" / "enroot.conf.d"
            conf_d.mkdir(parents=True, exist_ok=True)
            paths = {"RUNTIME": "run", "CACHE": "cache", "DATA": "data", "TEMP": "tmp"}
            for sub in paths.values():
                (state / "enroot" / sub).mkdir(parents=True, exist_ok=True)
            (conf_d / "node.conf").write_text(
                "".join(f"ENROOT_{key}_PATH {state}/enroot/{sub}\n" for key, sub in paths.items())
            )

    def _communication(self) -> str:
        """slurm.conf's ``CommunicationParameters``: bind only the host name's address (loopback) on this machine's
        network; in the cluster's own namespace the wildcard address, which reaches nothing outside it (a step's
        ``srun`` on node ``n2``, host name 127.0.0.3, is called back at the source address of its request,
        127.0.0.1)."""
        return (
            "#CommunicationParameters="
            if self.netns is not None
            else "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"
        )

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "dev"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("spool", "munge"):
            (self.sockets / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.sockets / "munge", 0o700)
        key = self.sockets / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        for i in range(self.gpus):
            dev = r / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))
        ctld_port, slurmd_port = free_port(), free_port()
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.addresses[name]} NodeHostname={name}"
            + ("" if len(self.names) == 1 else f" Port={free_port()}")
            + f" CPUs={self.cpus} RealMemory={self.memory_mb}{gres} State=UNKNOWN"
            for name in self.names
        )
        each = "" if len(self.names) == 1 else "-%n"  # per-node files when several slurmd share this machine
        self.conf.write_text(f"""\
ClusterName=recipebundle
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
{self._communication()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.sockets}/munge/munge.sock
StateSaveLocation={r}/state
SlurmdSpoolDir={self.sockets}/spool{each}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd{each}.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd{each}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={self.memory_mb // self.cpus // 2}
MpiDefault=none
ReturnToService=2
MinJobAge=600
GresTypes=gpu
{f"PlugStackConfig={PYXIS_PREFIX}/etc/plugstack.conf" if self.tools is not None else ""}
{nodes}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        if self.tools is not None:
            self._write_node_layers()
        if self.gpus:
            (r / "gres.conf").write_text(
                "AutoDetect=off\n"
                + "".join(f"NodeName={name} Name=gpu File={r}/dev/nvidia[0-{self.gpus - 1}]\n" for name in self.names)
            )

    def _preexec(self, hostname: str = "127.0.0.1", node: str = LOGIN):
        """What a child runs before exec: join the cluster's network namespace (if any), then (with ``tools``) a
        mount namespace whose ``/opt`` is ``node``'s view (:func:`_overlay_opt`), then a UTS namespace whose host
        name is ``hostname``."""
        layer = self.root / "layers" / node / "opt"

        def enter() -> None:
            if self.netns is not None:
                self.netns.enter()
            if self.tools is not None:
                _overlay_opt([layer, self.tools / "opt", Path("/opt")])
            _loopback_hostname(hostname)

        return enter

    def _spawn(self, argv: list[str], log: str, hostname: str = "127.0.0.1", node: str = LOGIN) -> subprocess.Popen:
        out = open(self.root / log, "wb")
        program = shutil.which(argv[0], path=_search_path()) or argv[0]
        proc = subprocess.Popen(
            ["timeout", str(self.lifetime_s), program, *argv[1:]],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
            preexec_fn=self._preexec(hostname, node),
        )
        self.procs.append(proc)
        return proc

    def start(self) -> LocalSlurm:
        """Start the cluster (see :meth:`_start`); on any failure stop what was started, then re-raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalSlurm:
        """Write the config, start the daemons, wait until the node is idle (about 2 s)."""
        self._write_config()
        m = self.sockets / "munge"
        self._spawn(
            [
                "munged",
                "-F",
                "-f",
                f"--key-file={m}/munge.key",
                f"--socket={m}/munge.sock",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            "munged.out",
        )
        _wait_for(lambda: (m / "munge.sock").exists(), 10, "munged", self.root / "munged.out")
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.out")
        for name in self.names:
            (self.sockets / f"spool-{name}").mkdir(exist_ok=True)
            self._spawn_slurmd(name)
        self._wait_idle(30, "the Slurm node")
        return self

    def _spawn_slurmd(self, name: str, log: str | None = None) -> None:
        """Node ``name``'s slurmd, at its address, in a UTS namespace of its own (:meth:`kill_node` finds it); its
        output in ``log`` (default ``slurmd-NAME.out``)."""
        argv = ["slurmd", "-D", "-f", str(self.conf), "-N", name]
        self._spawn(argv, log or f"slurmd-{name}.out", self.addresses[name], name)

    def _wait_idle(self, timeout_s: float, what: str) -> None:
        """Wait until ``sinfo`` shows every node idle; raises ``RuntimeError`` naming ``what`` after ``timeout_s``."""

        def idle() -> bool:
            out = self.client(["sinfo", "-h", "-N", "-o", "%t"], timeout=30)
            return out.returncode == 0 and out.stdout.split() == ["idle"] * len(self.names)

        _wait_for(idle, timeout_s, what, self.root / "slurmctld.log")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons by PID (slurmd, slurmctld, munged)."""
        try:
            self.client(["scancel", "--user=root", "--full"], timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass  # not installed, or slurmctld never came up: nothing to cancel
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs = []
        if self.short is not None:
            shutil.rmtree(self.short, ignore_errors=True)

    def kill_node(self, name: str) -> list[int]:
        """Kill node ``name`` as a power cut would: SIGKILL every process in its UTS namespace (its slurmd, the
        slurmstepd it forked and every task under them: they share the host name the node's slurmd got), at once.
        Returns the PIDs killed (its slurmd's first). The node stays down until :meth:`restart_node`."""
        proc = next(p for p in self.procs if list(cast(list, p.args))[-2:] == ["-N", name])
        uts = os.readlink(f"/proc/{proc.pid}/ns/uts")
        if uts == os.readlink("/proc/self/ns/uts"):
            raise RuntimeError(f"node {name} has no UTS namespace of its own")
        victims = [proc.pid]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != proc.pid:
                try:
                    if os.readlink(entry / "ns" / "uts") == uts:
                        victims.append(int(entry.name))
                except OSError:
                    continue  # gone meanwhile
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        self.procs.remove(proc)
        return victims

    def restart_node(self, name: str, timeout_s: float = 120) -> None:
        """Start node ``name`` again after :meth:`kill_node` (a node back from a power cut: a fresh slurmd on the
        same address, spool and port) and wait until ``sinfo`` shows every node idle (``ReturnToService=2``
        returns it to service once it registers and the killed job's cleanup is done). Raises ``RuntimeError``
        after ``timeout_s`` with the controller's log tail."""
        self._spawn_slurmd(name, f"slurmd-{name}-restarted.out")  # the killed one's output stays
        self._wait_idle(timeout_s, f"node {name} back in service")

    def client(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``srun``, ``sinfo``) against this cluster, in a UTS namespace whose host
        name is ``127.0.0.1`` as the daemons' (``srun`` listens for its tasks at its own host name's address,
        which need not resolve: a fresh root's does not); captures its output (text)."""
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.env(), timeout=timeout, preexec_fn=self._preexec()
        )

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ray_port_args() -> list[str]:
    """``ray start`` arguments that give a node its own free ports for every component with a fixed default
    (dashboard agent 52365, client server 10001, ...), so that two Ray heads on one machine do not collide;
    worker ports are left to the kernel (``--min-worker-port=0``)."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        "--min-worker-port=0",
        "--max-worker-port=0",
    ]


class LocalRay:
    """A Ray head on 127.0.0.1 (``ray start --head --block``) with its temp dir under ``root``."""

    def __init__(self, root: Path, cpus: int = 2, lifetime_s: int = 600):
        self.root = Path(root)
        self.cpus, self.lifetime_s = cpus, lifetime_s
        self.proc: subprocess.Popen | None = None
        self.port = free_port()
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"

    @staticmethod
    def env() -> dict[str, str]:
        """Loopback-only Ray: every port on 127.0.0.1, no usage stats, immediate teardown on SIGTERM."""
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }

    def start(self) -> LocalRay:
        """Start the head (see :meth:`_start`); on any failure stop what was started, then re-raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalRay:
        """Start the head and wait until its dashboard answers and its state API counts the head alive (about
        5-10 s): the dashboard's modules run in processes of their own, and a job submitted before they are up
        may find none."""
        from trainer.launch.host.ray import ray_cli, reachable
        from trainer.launch.jobsteps import alive_nodes

        self.root.mkdir(parents=True, exist_ok=True)
        # Ray's unix sockets live in the temp dir: keep its path short (108-byte limit)
        self.temp = Path("/tmp") / f"ray-rb-{os.getpid()}-{self.port}"
        log = open(self.root / "ray-head.log", "wb")
        self.proc = subprocess.Popen(
            [
                "timeout",
                str(self.lifetime_s),
                ray_cli(),
                "start",
                "--head",
                "--block",
                f"--port={self.port}",
                f"--num-cpus={self.cpus}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                "--node-ip-address=127.0.0.1",
                f"--temp-dir={self.temp}",
                *ray_port_args(),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        _wait_for(
            lambda: (
                (reachable(self.address, 2) is None and alive_nodes(self.address) == 1) or self.proc.poll() is not None
            ),
            120,
            "the Ray head",
            self.root / "ray-head.log",
        )
        if self.proc.poll() is not None:
            raise RuntimeError("the Ray head exited:\n" + (self.root / "ray-head.log").read_text()[-2000:])
        return self

    def logs(self, chars: int = 3000) -> str:
        """The end of the head's own log and of its dashboard's (``session_latest/logs/dashboard.log``): what a
        failed assertion shows of a head that went away."""
        paths = [
            self.root / "ray-head.log",
            getattr(self, "temp", self.root) / "session_latest" / "logs" / "dashboard.log",
        ]
        return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-chars:] for p in paths if p.is_file())

    def stop(self) -> None:
        """SIGTERM the head (by PID; ``timeout`` passes it on), SIGKILL what it left; remove its temp dir."""
        if self.proc is not None:
            _stop(self.proc, grace_s=20)
            self.proc = None
        shutil.rmtree(getattr(self, "temp", self.root / "none"), ignore_errors=True)

    def __enter__(self) -> LocalRay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


CLONE_NEWNET = 0x40000000  # <sched.h>
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFADDR, IFF_UP = 0x8913, 0x8914, 0x8916, 0x1  # <linux/sockios.h>, <net/if.h>
NODE_ADDRESSES = tuple(f"127.0.0.{i}" for i in range(2, 10))  # the test clusters' node addresses (n1 127.0.0.2, ...)


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6", use_errno=True)


def _loopback_up() -> None:
    """Bring ``lo`` up in this process's network namespace (a new one has it down): SIOCSIFFLAGS with IFF_UP."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _add_loopback_addresses(addresses: tuple[str, ...]) -> None:
    """Give ``lo`` the ``addresses`` (aliases ``lo:1``, ``lo:2``, ...; SIOCSIFADDR). Any address of 127.0.0.0/8
    answers on ``lo`` without this, but glibc's ``getaddrinfo`` with ``AI_ADDRCONFIG`` (Slurm resolves its node
    addresses so) returns no IPv4 address unless an interface has one other than 127.0.0.1."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for i, address in enumerate(addresses, start=1):
            name = f"lo:{i}".encode()
            request = struct.pack("16sHH4s8x", name, socket.AF_INET, 0, socket.inet_aton(address))
            fcntl.ioctl(sock, SIOCSIFADDR, request)


class NetNamespace:
    """A network namespace of its own with only its loopback interface (and the addresses
    :data:`NODE_ADDRESSES` on it), held by a ``sleep`` bounded by ``lifetime_s`` and by a file descriptor of this
    process: what runs in it (:meth:`enter` before exec, :meth:`argv` for a command) can bind any address of
    127.0.0.0/8, or all interfaces, and still be reachable from nothing outside it. :meth:`stop` kills every
    process in it. Needs root (CAP_SYS_ADMIN)."""

    def __init__(self, lifetime_s: int = 3600):
        self.lifetime_s = lifetime_s
        self.proc: subprocess.Popen | None = None
        self.fd: int | None = None

    def start(self) -> NetNamespace:
        """Start the holder (unshare(CLONE_NEWNET), ``lo`` up with the node addresses, then ``sleep``) and open
        its namespace: :meth:`enter` joins that file, whatever becomes of the holder's PID."""

        def new_namespace() -> None:
            if _libc().unshare(CLONE_NEWNET) != 0:
                import ctypes

                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
            _loopback_up()
            _add_loopback_addresses(NODE_ADDRESSES)

        self.proc = subprocess.Popen(["sleep", str(self.lifetime_s)], preexec_fn=new_namespace, start_new_session=True)
        self.fd = os.open(f"/proc/{self.proc.pid}/ns/net", os.O_RDONLY)
        self.inode = os.fstat(self.fd).st_ino
        return self

    @property
    def path(self) -> str:
        """The namespace as a path of this process (``/proc/PID/fd/FD``), for ``nsenter --net``."""
        assert self.fd is not None, "start() first"
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def enter(self) -> None:
        """In a child before exec: join this namespace (setns on the descriptor :meth:`start` opened)."""
        import ctypes

        assert self.fd is not None, "start() first"
        if _libc().setns(self.fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run in this namespace (``nsenter``), for use from a shell or another process."""
        return ["nsenter", f"--net={self.path}", "--", *command]

    def members(self) -> list[int]:
        """PIDs of the processes in this namespace (by the inode of ``/proc/PID/ns/net``)."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.stat(entry / "ns" / "net").st_ino == self.inode:
                        out.append(int(entry.name))
                except OSError:
                    continue
        return out

    def stop(self) -> None:
        """SIGKILL every process left in the namespace (the holder among them) and close it."""
        if self.proc is not None:
            for pid in self.members():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc.wait()
            self.proc = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> NetNamespace:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalRayCluster:
    """A Ray cluster of ``nodes`` nodes on this machine: a head (``n1``) and ``nodes - 1`` workers (``ray start
    --block``), each its own node name, address (``127.0.0.2`` .. ``127.0.0.N+1``), temp dir and ports, offering
    ``gpus_per_node`` ``GPU`` slots (declared: the CPU worker takes one each) and ``cpus_per_node`` CPUs.

    Everything runs in ``netns`` (a :class:`NetNamespace`): Ray binds some ports on all interfaces once it runs as a
    multi-node cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, which ``ray start --address`` requires), and in
    a namespace with only loopback that reaches nothing else. The job submission address (the dashboard on the
    head's 127.0.0.1:8265) and ``ray job`` clients must run in the same namespace (``netns.enter``).
    """

    def __init__(
        self,
        root: Path,
        netns: NetNamespace,
        nodes: int = 4,
        gpus_per_node: int = 2,
        cpus_per_node: int = 2,
        lifetime_s: int = 600,
    ):
        self.root, self.netns = Path(root), netns
        self.nodes, self.gpus, self.cpus, self.lifetime_s = nodes, gpus_per_node, cpus_per_node, lifetime_s
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.ips = [f"127.0.0.{i + 1}" for i in range(1, nodes + 1)]
        self.port, self.dashboard_port = 6379, 8265  # the namespace is the cluster's own: Ray's default ports
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.procs: list[subprocess.Popen] = []
        self._restarts = 0
        self.temp = Path(tempfile.mkdtemp(prefix="rb-ray-", dir="/tmp"))  # unix sockets: short paths

    def env(self) -> dict[str, str]:
        """Ray as a multi-node cluster (the worker nodes need it), no usage stats, immediate teardown."""
        return {**LocalRay.env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

    def _temp_dir(self, i: int, attempt: int = 1) -> Path:
        return self.temp / (self.names[i] if attempt == 1 else f"{self.names[i]}-{attempt}")

    def _spawn(self, i: int, argv: list[str], attempt: int = 1, env: dict[str, str] | None = None) -> None:
        from trainer.launch.host.ray import ray_cli

        log = open(self.root / f"ray-{self.names[i]}.log", "ab")
        common = [
            f"--node-name={self.names[i]}",
            f"--node-ip-address={self.ips[i]}",
            f"--num-cpus={self.cpus}",
            f"--num-gpus={self.gpus}",
            f"--temp-dir={self._temp_dir(i, attempt)}",
            "--object-store-memory=200000000",  # bytes; Ray's default (30% of memory per node) is far more
        ]
        ports = [a for a in ray_port_args() if i == 0 or not a.startswith("--ray-client-server-port")]
        self.procs.append(
            subprocess.Popen(
                ["timeout", str(self.lifetime_s), ray_cli(), "start", "--block", *argv, *common, *ports],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env(), **(env or {})},
                start_new_session=True,
                preexec_fn=self.netns.enter,
            )
        )

    def alive_nodes(self) -> int:
        """Alive nodes as the head's dashboard lists them (0 while it does not answer); asked from a child in the
        namespace, where the dashboard is."""
        ask = subprocess.run(
            [sys.executable, "-c", _ALIVE_SCRIPT, self.address],
            capture_output=True,
            text=True,
            timeout=10,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))},
            preexec_fn=self.netns.enter,
        )
        return int(ask.stdout.strip() or 0) if ask.returncode == 0 else 0

    def start(self) -> LocalRayCluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalRayCluster:
        """Start the head, wait for its dashboard, then each worker until it is alive (~30 s for four nodes)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn(
            0,
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
            ],
        )
        _wait_for(lambda: self.alive_nodes() >= 1, 60, "the Ray head", self.root / "ray-n1.log")
        # one worker at a time, each alive before the next (as sbatch.sh's launcher.ray_join_wave=1): three
        # starting at once on two cores start their agents slower than a raylet waits for them, and it exits
        for i in range(1, self.nodes):
            self._start_worker(i)
        return self

    def _start_worker(
        self, i: int, attempts: int = 3, timeout_s: float = 90, env: dict[str, str] | None = None, first: int = 1
    ) -> None:
        """Start worker node ``i`` and wait until the head counts ``i + 1`` alive nodes. A ``ray start`` that exits
        first is started again (``attempts`` in all): it waits a fixed 30 s for its raylet to register (Ray's
        ``raylet_start_wait_time_s``, ``ray/_private/node.py``), which two busy cores can exceed; what it left
        running is killed by its temp dir first. Raises RuntimeError with the log's tail when none came up."""
        log = self.root / f"ray-{self.names[i]}.log"
        for attempt in range(first, first + attempts):
            self._spawn(i, [f"--address={self.ips[0]}:{self.port}"], attempt, env)
            proc = self.procs[-1]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if self.alive_nodes() >= (i + 1 if first == 1 else self.nodes):
                    return
                time.sleep(0.2)
            if proc.poll() is None:
                break
            self.procs.remove(proc)
            _kill_matching(str(self._temp_dir(i, attempt)))
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        raise RuntimeError(f"the Ray worker node {self.names[i]} did not come up ({attempt} tries)\n{tail}")

    def stop_node(self, name: str) -> None:
        """Stop the worker node ``name`` (its ``ray start --block`` and what it started), as a node that died or
        never started; wait until the head no longer counts it (up to 60 s). Raises RuntimeError otherwise."""
        i = self.names.index(name)
        target = str(self._temp_dir(i))
        proc = next(p for p in self.procs if any(target in str(a) for a in cast(list, p.args)))
        alive = self.alive_nodes()
        _stop(proc, grace_s=20)
        self.procs.remove(proc)
        _kill_matching(target)
        _wait_for(lambda: self.alive_nodes() == alive - 1, 60, f"the head noting {name} gone")

    def restart_node(self, name: str, env: dict[str, str]) -> None:
        """Start the worker node ``name`` that :meth:`stop_node` stopped again, with ``env`` added to its
        environment (e.g. another ``RECIPE_BUNDLE_IMAGE_DIGEST``: a node of another image), in a new temp dir;
        returns once every node is alive."""
        self._start_worker(self.names.index(name), env=env, first=self._restarts + 10)
        self._restarts += 3

    def stop(self) -> None:
        """SIGTERM every node (workers first), SIGKILL what they left; remove the temp dirs."""
        for proc in reversed(self.procs):
            _stop(proc, grace_s=20)
        self.procs = []
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# trainer.launch.jobsteps.alive_nodes (what sbatch.sh waits on), asked from a child in the cluster's namespace
_ALIVE_SCRIPT = """\
import sys
from trainer.launch.jobsteps import alive_nodes
alive = alive_nodes(sys.argv[1], 2)
print(alive if isinstance(alive, int) else 0)
"""
_REPO = Path(__file__).absolute().parent.parent
