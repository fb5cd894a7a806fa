"""Unpacked image root file systems, cached by manifest digest outside every run directory (``launcher=local-image``).

A run directory holds records, not images: the root file system of an image is unpacked once per manifest digest
into this cache and shown to each run read-only (:func:`readonly_view`). Layout::

    ROOT/                       0700, this user's own
      <manifest hex>/
        bundle/                 umoci's runtime bundle: config.json, rootfs/, umoci.json, sha256_<hex>.mtree
        files.json              the bundle as unpacked: {"digest", "files": {PATH: ["f", mode, size, sha256] |
                                ["d", mode] | ["l", link target] | ["o", mode]}}

``ROOT`` is ``$TRAINER_ROOTFS_CACHE``, else ``$XDG_CACHE_HOME/recipe-bundle/rootfs`` (``~/.cache`` without
XDG_CACHE_HOME). An entry is made in a temporary directory beside its place (``umoci unpack`` checks every layer
blob against its digest), hashed into ``files.json`` and renamed into place, so a reader never sees half an
entry. Every use re-hashes the whole bundle against ``files.json`` first; an entry that differs in any file,
mode or link is moved aside and unpacked anew, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainer.errors import UserError

FILES = "files.json"


def default_root() -> Path:
    """``$TRAINER_ROOTFS_CACHE``, else ``$XDG_CACHE_HOME/recipe-bundle/rootfs`` (``~/.cache`` when unset)."""
    explicit = os.environ.get("TRAINER_ROOTFS_CACHE")
    if explicit:
        return Path(explicit).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recipe-bundle" / "rootfs"


def _own_dir(root: Path) -> Path:
    """``root``, created 0700 if missing; refused (:class:`UserError`) unless it is a directory of this user that
    no other account may write."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise UserError(
            f"{root}: the root file system cache must be a directory of this user that no one else may "
            "write (TRAINER_ROOTFS_CACHE)"
        )
    return root


def tree(bundle: Path) -> dict[str, list[Any]]:
    """What :data:`FILES` records of the tree ``bundle``: every entry by relative POSIX path, regular files with
    mode, size (bytes) and sha256, directories with mode, links with their target, anything else with its mode.
    Raises ``OSError`` for an entry that cannot be read (a directory ``os.walk`` would otherwise skip)."""
    out: dict[str, list[Any]] = {}

    def unreadable(err: OSError) -> None:
        raise err

    for dirpath, dirnames, filenames in os.walk(bundle, onerror=unreadable):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            path = base / name
            rel = path.relative_to(bundle).as_posix()
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ["l", os.readlink(path)]
            elif stat.S_ISDIR(info.st_mode):
                out[rel] = ["d", mode]
            elif stat.S_ISREG(info.st_mode):
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
                out[rel] = ["f", mode, info.st_size, digest.hexdigest()]
            else:
                out[rel] = ["o", mode]
        dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]
    return out


@dataclass
class Rootfs:
    """An entry of the cache, verified: ``bundle`` (umoci's runtime bundle; the tree is ``bundle/rootfs``), the
    sha256 of its :data:`FILES` record, its file count and size (bytes), and whether this call unpacked it."""

    bundle: Path
    files_sha256: str
    files: int
    bytes: int
    unpacked: bool
    log: str

    def as_record(self) -> dict[str, Any]:
        """The record's ``image.rootfs`` block."""
        return {
            "cache": str(self.bundle.parent),
            "files_sha256": self.files_sha256,
            "files": self.files,
            "bytes": self.bytes,
            "unpacked": self.unpacked,
        }


def _verified(entry: Path, digest: str) -> Rootfs:
    """The entry at ``entry`` when its bundle is exactly what its :data:`FILES` says (raises ``ValueError``)."""
    data = (entry / FILES).read_bytes()
    recorded = json.loads(data)
    if recorded.get("digest") != digest:
        raise ValueError(f"{FILES} names {recorded.get('digest')}")
    now = tree(entry / "bundle")
    if now != recorded.get("files"):
        changed = sorted(set(now) ^ set(recorded["files"])) or sorted(k for k in now if now[k] != recorded["files"][k])
        raise ValueError(f"bundle/{changed[0] if changed else '?'} differs from {FILES}")
    size = sum(v[2] for v in now.values() if v[0] == "f")
    return Rootfs(entry / "bundle", hashlib.sha256(data).hexdigest(), len(now), size, False, "")


def unpacked(layout: Path, tag: str, digest: str, root: Path | None = None) -> Rootfs:
    """The root file system of image ``digest`` (named ``tag`` in the OCI layout ``layout``), from the cache at
    ``root`` (:func:`default_root`): verified when cached, else unpacked with ``umoci unpack`` (rootless when not
    root), hashed and put in place atomically. Raises :class:`UserError` (one line) when umoci fails or the cache
    directory is not this user's own."""
    root = _own_dir(Path(root) if root is not None else default_root())
    hex_ = digest.split(":", 1)[1]
    entry = root / hex_
    note = ""
    if entry.exists():
        try:
            return _verified(entry, digest)
        except (OSError, ValueError, KeyError, TypeError) as ex:
            aside = Path(tempfile.mkdtemp(prefix=f".damaged-{hex_[:12]}-", dir=root))
            entry.rename(aside / "entry")
            shutil.rmtree(aside, ignore_errors=True)
            note = f"cached root file system of {digest} was damaged ({ex}); unpacked anew\n"
    work = Path(tempfile.mkdtemp(prefix=f".unpack-{hex_[:12]}-", dir=root))
    try:
        command = (
            ["umoci", "unpack"]
            + (["--rootless"] if os.geteuid() != 0 else [])
            + ["--image", f"{layout}:{tag}", str(work / "bundle")]
        )
        out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            raise UserError(f"umoci unpack {layout}:{tag} failed: {lines[-1] if lines else f'exit {out.returncode}'}")
        files = tree(work / "bundle")
        data = (json.dumps({"digest": digest, "files": files}, sort_keys=True) + "\n").encode()
        (work / FILES).write_bytes(data)
        try:
            work.rename(entry)
        except OSError:  # another run put the same image in place meanwhile: use that one, verified
            shutil.rmtree(work, ignore_errors=True)
            return _verified(entry, digest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    size = sum(v[2] for v in files.values() if v[0] == "f")
    return Rootfs(
        entry / "bundle", hashlib.sha256(data).hexdigest(), len(files), size, True, note + out.stdout + out.stderr
    )


def image_path(rootfs: Path, path: str) -> Path:
    """The host path of ``path`` as the image sees it: each link inside the tree ``rootfs`` followed the way a
    process whose root is ``rootfs`` would (an absolute target starts again at ``rootfs``, ``..`` stops there),
    so the result is always under ``rootfs`` and holds no link; its last part may not exist. Read what the
    launcher takes from an image (its stamped lock, ``.pth`` files, its interpreter) through this, never through
    the host's own resolution, which would follow an image's link to a file of this machine. Raises
    :class:`UserError` after 40 links (a loop)."""
    parts: list[str] = [p for p in PurePosixPath(path).parts if p != "/"]
    current: list[str] = []
    links = 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if current:
                current.pop()
            continue
        candidate = Path(rootfs).joinpath(*current, name)
        if candidate.is_symlink():
            links += 1
            if links > 40:
                raise UserError(f"the image's {path}: more than 40 links to follow (a loop)")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
        else:
            current.append(name)
    return Path(rootfs).joinpath(*current)


def readonly_view(rootfs: Path, mounts: Sequence[str]) -> list[str]:
    """bubblewrap arguments that show the tree ``rootfs`` at ``/``, read-only, leaving room for ``mounts`` (the
    absolute paths the sandbox mounts on top: ``/proc``, ``/dev``, ``/tmp``, the launcher's binds).

    bubblewrap's own root is a fresh tmpfs: each entry of ``rootfs`` is bound there read-only (``--ro-bind``) or
    recreated as a link (``--symlink``), except the directories on the way to a mount point, which are made
    afresh (``--dir``) with their entries bound one by one, and the mount points themselves. Nothing in
    ``rootfs`` is ever written. Raises :class:`UserError` when a mount point lies under a link of the image."""
    wanted = [PurePosixPath(m) for m in mounts]
    args: list[str] = []

    def visit(inside: PurePosixPath, host: Path) -> None:
        for name in sorted(os.listdir(host)):
            child, source = inside / name, host / name
            if child in wanted:
                continue
            if any(child in m.parents for m in wanted):
                if source.is_symlink() or not source.is_dir():
                    raise UserError(f"the image's {child} is not a directory, and the sandbox mounts below it")
                args.extend(["--dir", str(child)])
                visit(child, source)
            elif source.is_symlink():
                args.extend(["--symlink", os.readlink(source), str(child)])
            else:
                args.extend(["--ro-bind", str(source), str(child)])

    visit(PurePosixPath("/"), Path(rootfs))
    return args
