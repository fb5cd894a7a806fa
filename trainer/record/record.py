"""Run records: what a run directory holds and how it is written (atomically).

``record.json`` says what produced the directory (the bundle's revision, the launcher's Python and
packages, the locks' sha256, hashes of the resolved config, argv and environment) and the run's status.
Every file is written to a temporary name in the same directory and renamed into place;
``record.json`` is written last, so a directory without it is incomplete.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict, Unpack

from trainer import REPO_ROOT, __version__
from trainer.inputs import open_regular
from trainer.publish import atomic_write, canonical_json
from trainer.redact import redact_argv

LAUNCHER_PACKAGES = ("hydra-core", "omegaconf", "rich", "pyyaml", "packaging")

# The shape of record.json. ``from`` is a keyword, hence the functional form.
SourceRevision = TypedDict("SourceRevision", {"revision": str | None, "dirty": bool | None, "from": str})
SourceRevision.__doc__ = """The bundle's source revision (:func:`git_revision`): the commit (None when unknown or
dirty under Nix), whether the tree had uncommitted changes (None when unknown) and where that was read from
(``git``, ``nix flake`` or ``unknown``)."""


class BundleInfo(SourceRevision):
    """``record.json``'s ``bundle``: the package version and its :class:`SourceRevision`."""

    version: str


class LauncherEnv(TypedDict):
    """``record.json``'s ``launcher_env``: the launcher's Python version, ``sys.prefix`` and the versions of
    :data:`LAUNCHER_PACKAGES` (None where absent)."""

    python: str
    executable_prefix: str
    packages: dict[str, str | None]


class ProcessIdentity(TypedDict):
    """What names a process across pid reuse (:func:`process_identity`): ``pid``, ``pid_started`` (clock ticks
    after boot), ``boot_id`` and ``pid_ns``; None where it cannot be read."""

    pid: int
    pid_started: int | None
    boot_id: str | None
    pid_ns: str | None


class RunRecordFields(TypedDict, total=False):
    """The keys of ``record.json`` that a record has once the run reached the point that writes them: the
    composition (:meth:`trainer.compose.prepare.PreparedRun.record_fields`: ``kind`` ... ``composition_sha256``),
    the files' sha256 by relative path, the launcher's :class:`ProcessIdentity` while it runs, the state's times
    (``YYYY-MM-DDTHH:MM:SSZ``), how it ended (``reason``, None for a clean end; ``message`` of a hand-off), the
    attestation (``{"path", "signed_by"}`` or ``{"error"}``), and what each launcher adds (``probe``: the
    processes' probes, ``{"ranks", "nodes"}``, None until they ran; ``slurm``, ``ray``, ``image``, ``data``,
    ``sources``, ``megatron``, ``times``, ``preflight``, ``logs``, ``observed``...; after a ``--resume``, ``attempts``
    and ``resumed_from``)."""

    kind: str
    launcher: str
    overrides: list[str]
    choices: dict[str, str | None]
    stack: dict[str, Any]
    lock: dict[str, str]
    composition_sha256: str
    files_sha256: dict[str, str]
    pid: int
    pid_started: int | None
    boot_id: str | None
    pid_ns: str | None
    started_utc: str
    finished_utc: str
    handed_off_utc: str
    reason: str | None
    message: str
    attestation: dict[str, Any]
    probe: dict[str, Any] | None
    slurm: dict[str, Any]
    ray: dict[str, Any]
    image: dict[str, Any]
    data: dict[str, Any]
    sources: dict[str, Any]
    megatron: dict[str, Any]
    times: dict[str, Any]
    preflight: dict[str, Any]
    logs: dict[str, Any] | list[Any] | str
    observed_versions: dict[str, Any]
    observed: dict[str, Any]
    attempts: list[dict[str, Any]]  # a --resume: the earlier attempts, oldest first (trainer.launch.checkpoint)
    resumed_from: dict[str, Any]  # a --resume: {"attempt", "iteration", "checkpoint", "sha256"}


class RunRecord(RunRecordFields):
    """``record.json``: the keys every record this bundle writes has (:func:`launcher_record`), and the
    :class:`RunRecordFields` a run adds as it goes. A record read back (:func:`trainer.record.rundir.load_record`)
    has its fields' JSON types checked, not their presence, and any field may be null there: readers use
    ``.get()``."""

    schema_version: int
    status: str
    created_utc: str
    host: str
    bundle: BundleInfo
    launcher_env: LauncherEnv
    locks: dict[str, str | None]
    command: list[str]


def write_json(path: Path, obj: Any) -> str:
    """Write ``obj`` as canonical JSON atomically; return the sha256 of the bytes written."""
    return atomic_write(path, canonical_json(obj))


def sha256_file(path: Path) -> str | None:
    """sha256 of a file's bytes, read as a stream (a FIFO or device is refused without blocking:
    :func:`trainer.inputs.open_regular`), or None if it does not exist."""
    digest = hashlib.sha256()
    try:
        with open_regular(path, "file", None) as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def git_revision(root: Path = REPO_ROOT) -> SourceRevision:
    """The bundle's source revision: ``{"revision", "dirty"}`` from git, or from ``TRAINER_SOURCE_REVISION``
    (set by the Nix app, whose source has no .git), or unknown."""
    env_rev = os.environ.get("TRAINER_SOURCE_REVISION")
    if env_rev:
        dirty = env_rev == "dirty"  # the flake of a git tree with uncommitted changes has no rev
        return {"revision": None if dirty else env_rev, "dirty": dirty, "from": "nix flake"}
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        )
        return {"revision": rev, "dirty": dirty, "from": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None, "from": "unknown"}


def package_versions(names: Iterable[str] = LAUNCHER_PACKAGES) -> dict[str, str | None]:
    """Installed versions of ``names`` in the running interpreter (None where absent)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def launcher_record(status: str, **fields: Unpack[RunRecordFields]) -> RunRecord:
    """The common part of ``record.json``: status, time, host, bundle revision, launcher environment, locks.

    ``fields`` are merged in (e.g. hashes of the files of the run directory).
    """
    record: RunRecord = {
        "schema_version": 1,
        "status": status,
        "created_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "bundle": {"version": __version__, **git_revision()},
        "launcher_env": {
            "python": platform.python_version(),
            "executable_prefix": sys.prefix,
            "packages": package_versions(),
        },
        "locks": {
            "lockfiles/launcher.lock": sha256_file(REPO_ROOT / "lockfiles" / "launcher.lock"),
            "lockfiles/stack.json": sha256_file(REPO_ROOT / "lockfiles" / "stack.json"),
        },
        "command": redact_argv(sys.argv),
        **fields,
    }
    return record


PID_MAX = 1 << 22  # the largest pid Linux can give (PID_MAX_LIMIT, 4,194,304): a larger one names no process
START_SLACK_S = 2.0  # a process that started this much later than the run's record cannot be the run's launcher


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field 22, ``starttime``; the
    command name, field 2, may hold spaces and parentheses, so the fields are counted after its last ``)``), or
    None when it cannot be read (no such process, no ``/proc``)."""
    try:
        text = Path(f"/proc/{int(pid)}/stat").read_bytes()
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``, a UUID), or None when it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def pid_namespace(pid: int | None = None) -> str | None:
    """The pid namespace of process ``pid`` (default: this one) as the kernel names it (the link
    ``/proc/PID/ns/pid``, e.g. ``pid:[4026531836]``), or None when it cannot be read. A pid means the same process
    only to readers in the same namespace."""
    try:
        return os.readlink(f"/proc/{'self' if pid is None else int(pid)}/ns/pid")
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The state of process ``pid`` (``/proc/PID/stat`` field 3, after the command name's last ``)``: ``R``,
    ``S``, ``D``, ``Z`` zombie, ``X`` dead, ...), or None when it cannot be read."""
    try:
        text = Path(f"/proc/{int(pid)}/stat").read_bytes()
        return text[text.rindex(b")") + 2 :].split()[0].decode("ascii", "replace")
    except (OSError, ValueError, IndexError):
        return None


def process_identity(pid: int | None = None) -> ProcessIdentity:
    """What names process ``pid`` (default: this one) across pid reuse, as a running record saves it: ``pid``,
    ``pid_started`` (:func:`process_started`, clock ticks after boot), ``boot_id`` (:func:`boot_id`) and
    ``pid_ns`` (:func:`pid_namespace` of this process: the namespace in which the number ``pid`` names it)."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "pid_started": process_started(pid), "boot_id": boot_id(), "pid_ns": pid_namespace()}


def unverifiable(record: Mapping[str, Any]) -> str | None:
    """Why the process a ``running`` record names cannot be checked from this process (one line), or None when it
    can: the record saved a pid namespace (``pid_ns``, :func:`process_identity`) other than this process's, so
    its pid names another process here or none (a run in a container, a reader in one). Such a run is reported
    running and its record never rewritten by a reader."""
    saved, here = record.get("pid_ns"), pid_namespace()
    if record.get("status") != "running" or not isinstance(saved, str) or here is None or saved == here:
        return None
    return f"its process cannot be checked from here (it runs in pid namespace {saved[:40]}, this reader in {here})"


def _started_wall(pid: int) -> float | None:
    """When process ``pid`` started, as a Unix time in seconds (boot time ``btime`` of ``/proc/stat`` plus
    :func:`process_started` over ``SC_CLK_TCK``), or None when it cannot be read."""
    ticks = process_started(pid)
    try:
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return None if ticks is None else btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def process_gone(record: Mapping[str, Any]) -> str | None:
    """Why the process a ``running`` record names on this host is not the run's (one line), or None when it may
    be (another status, another host, no pid, or a live process that is the one the record saved).

    Gone: a pid that is no process id (not an integer 1..:data:`PID_MAX`: ``0`` and negative ones name process
    groups, ``2147483648`` overflows ``kill``), a machine restarted since (``boot_id`` differs), no such process,
    a zombie (state ``Z`` or ``X``, :func:`process_state`: ``kill(pid, 0)`` succeeds on one), or a live process
    that is another one (its start time, ``/proc/PID/stat`` field 22, differs from the
    record's ``pid_started``; for a record without it, the process started more than :data:`START_SLACK_S` after
    the record's ``started_utc``/``created_utc``: the pid was reused). Never gone: a process this reader cannot
    check (:func:`unverifiable`: the record saved another pid namespace)."""
    pid = record.get("pid")
    if record.get("status") != "running" or pid is None or record.get("host") != socket.gethostname():
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX:
        return f"its pid {json.dumps(pid)[:40]} is not a process id (1..{PID_MAX}): no process of this run is running"
    saved_boot, now_boot = record.get("boot_id"), boot_id()
    if isinstance(saved_boot, str) and now_boot and saved_boot != now_boot:
        return f"its process {pid} is gone (the machine restarted since the run started)"
    if unverifiable(record):
        return None  # its pid means another process here, or none: may be running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its process {pid} is gone: it ended without recording how the run ended"
    except PermissionError:
        pass  # a live process of another user: compared by its start time below
    if process_state(pid) in ("Z", "X"):  # kill(pid, 0) succeeds on a zombie: it has ended, only its parent waits
        return f"its process {pid} is gone: it ended (a zombie, not yet reaped) without recording how the run ended"
    saved = record.get("pid_started")
    if isinstance(saved, int) and not isinstance(saved, bool):
        now = process_started(pid)
        if now is not None and now != saved:
            return (
                f"its process {pid} is gone: pid {pid} now belongs to another process (started at tick {now}, "
                f"the run's at tick {saved})"
            )
        return None
    started, wall = record.get("started_utc") or record.get("created_utc"), _started_wall(pid)
    if isinstance(started, str) and wall is not None:
        try:
            since = datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            return None
        if wall > since + START_SLACK_S:
            return (
                f"its process {pid} is gone: pid {pid} now belongs to another process, started "
                f"{wall - since:.0f} s after the run"
            )
    return None


def effective_status(record: Mapping[str, Any]) -> str:
    """A record's status as a reader should see it: ``running`` whose process is gone on this host
    (:func:`process_gone`: ended, a pid reused by another process, no process id at all) is ``interrupted`` (the
    launcher was killed, or the disk filled, before it could say so)."""
    status = record.get("status", "unknown")
    return "interrupted" if status == "running" and process_gone(record) else str(status)
