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
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

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


def sha256_file(path: Path) -> Optional[str]:
    """sha256 of a file's bytes, or None if it does not exist."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def git_revision(root: Path = REPO_ROOT) -> Dict[str, Any]:
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
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.strip()
        )
        return {"revision": rev, "dirty": dirty, "from": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None, "from": "unknown"}


def package_versions(names: Iterable[str] = LAUNCHER_PACKAGES) -> Dict[str, Optional[str]]:
    """Installed versions of ``names`` in the running interpreter (None where absent)."""
    out: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def launcher_record(status: str, **fields: Any) -> Dict[str, Any]:
    """The common part of ``record.json``: status, time, host, bundle revision, launcher environment, locks.

    ``fields`` are merged in (e.g. hashes of the files of the run directory).
    """
    record = {
        "schema_version": 1,
        "status": status,
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
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


def effective_status(record: Dict[str, Any]) -> str:
    """A record's status as a reader should see it: ``running`` whose process is gone on this host is
    ``interrupted`` (the launcher was killed before it could say so)."""
    status = record.get("status", "unknown")
    pid = record.get("pid")
    if status == "running" and pid and record.get("host") == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return "interrupted"
        except PermissionError:
            pass
    return status
