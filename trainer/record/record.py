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
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from trainer import REPO_ROOT, __version__
from trainer.publish import atomic_write
from trainer.redact import redact_argv

LAUNCHER_PACKAGES = ("hydra-core", "omegaconf", "rich", "pyyaml", "packaging")


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys, two-space indent and a final newline (stable bytes for hashing)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> str:
    """Write ``obj`` as canonical JSON atomically; return the sha256 of the bytes written."""
    return atomic_write(path, canonical_json(obj))


def sha256_file(path: Path) -> str | None:
    """sha256 of a file's bytes, read as a stream (a FIFO or device is refused without blocking:
    :func:`trainer.inputs.open_regular`), or None if it does not exist."""
    from trainer.inputs import open_regular

    digest = hashlib.sha256()
    try:
        with open_regular(path, "file", None) as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def git_revision(root: Path = REPO_ROOT) -> dict[str, Any]:
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


def launcher_record(status: str, **fields: Any) -> dict[str, Any]:
    """The common part of ``record.json``: status, time, host, bundle revision, launcher environment, locks.

    ``fields`` are merged in (e.g. hashes of the files of the run directory).
    """
    record = {
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
    }
    record.update(fields)
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


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """What names process ``pid`` (default: this one) across pid reuse, as a running record saves it: ``pid``,
    ``pid_started`` (:func:`process_started`, clock ticks after boot), ``boot_id`` (:func:`boot_id`) and
    ``pid_ns`` (:func:`pid_namespace` of this process: the namespace in which the number ``pid`` names it)."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "pid_started": process_started(pid), "boot_id": boot_id(), "pid_ns": pid_namespace()}


def unverifiable(record: dict[str, Any]) -> str | None:
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


def process_gone(record: dict[str, Any]) -> str | None:
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


def effective_status(record: dict[str, Any]) -> str:
    """A record's status as a reader should see it: ``running`` whose process is gone on this host
    (:func:`process_gone`: ended, a pid reused by another process, no process id at all) is ``interrupted`` (the
    launcher was killed, or the disk filled, before it could say so)."""
    status = record.get("status", "unknown")
    return "interrupted" if status == "running" and process_gone(record) else str(status)
