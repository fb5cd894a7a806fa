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
import re
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from trainer import REPO_ROOT, __version__

LAUNCHER_PACKAGES = ("hydra-core", "omegaconf", "rich", "pyyaml", "packaging")


def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``; other threads may be writing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # no /proc: the classic read, not thread-safe
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and ``os.replace``.

    ``mode`` is applied less the process umask (as ``open()`` would); a failure leaves no file behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = _umask()
    try:
        os.fchmod(fd, mode & ~umask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys, two-space indent and a final newline (stable bytes for hashing)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> str:
    """Write ``obj`` as canonical JSON atomically; return the sha256 of the bytes written."""
    data = canonical_json(obj)
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


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


SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDS", "AUTH", "PRIVATE", "COOKIE")
REDACTED = "<redacted>"
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def is_secret_name(name: str) -> bool:
    """True when a variable's name contains TOKEN, KEY, SECRET, PASSWORD, PASSWD, CREDENTIAL, CREDS, AUTH,
    PRIVATE or COOKIE (case-insensitive): its value is never recorded."""
    return any(marker in name.upper() for marker in SECRET_MARKERS)


def redact_value(value: str) -> str:
    """``value`` with the user:password part of any URL in it replaced (``https://<redacted>@host/...``)."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", value)


def redact_env(env: Dict[str, str]) -> Dict[str, str]:
    """A copy of ``env`` (sorted by name): values of secret-named variables (:func:`is_secret_name`) become
    ``<redacted>``, and credentials inside URLs in the other values are removed (:func:`redact_value`)."""
    return {name: (REDACTED if is_secret_name(name) else redact_value(value)) for name, value in sorted(env.items())}


def redact_argv(argv: List[str]) -> List[str]:
    """A command line with ``NAME=VALUE`` words of secret-named keys (Hydra overrides such as
    ``+env.HF_TOKEN=...``) and URL credentials redacted."""
    out = []
    for word in argv:
        key, sep, _ = word.partition("=")
        out.append(f"{key}={REDACTED}" if sep and is_secret_name(key) else redact_value(word))
    return out


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
