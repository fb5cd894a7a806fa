"""The build root: a Debian root file system and Python wheels from the lock, unpacked for bubblewrap.

A build step (:mod:`trainer.image.native`) never sees the host's ``/usr``. It runs in a root made from pinned
inputs only: the lock's ``build_root`` block::

    "build_root": {
      "suite": "bookworm", "variant": "essential",
      "include": ["gcc-12", "g++-12", "make", "libc6-dev", ...],     # + the suite's Essential: yes packages
      "debs": [{"name", "version", "architecture", "url", "sha256", "size"}, ...],   # resolved by apt
      "links": {"usr/bin/aclocal": "aclocal-1.16", ...},   # what update-alternatives would make (no
                                                          # maintainer script runs)
      "python": {"version": "3.11", "prefix": "/usr/local",            # the root's Python (Debian's python3)
                 "site_packages": "/usr/local/lib/python3.11/dist-packages", "interpreter": "/usr/bin/python3.11",
                 "platform": "x86_64-manylinux_2_36"},
      "requirements": ["pip==25.3", "nvidia-cuda-nvcc==13.0.88", ...],  # build-only wheels, exact pins
      "wheels": [{"name", "version", "filename", "url", "sha256"}, ...]   # resolved from PyPI
    }

Two trees are cached under the content-addressed cache (``ROOT/roots/``), each named by the hash of what
went into it and made read-only:

- ``roots/v2-debs-<key>``: the ``.debs`` unpacked exactly as the ``debian-rootfs`` image base is
  (:func:`trainer.image.debian.rootfs_entries`: merged /usr, dpkg database, no maintainer scripts), plus the
  empty mount points ``/build/input``, ``/build/src``, ``/build/out`` and the Python prefix;
- ``roots/v2-wheels-<key>``: one step's wheels (from ``build_root.wheels`` or the image's ``wheels``) installed by
  :func:`trainer.image.wheels.install_wheels` for ``build_root.python``; it is bound at the prefix
  (``/usr/local``), so the root's Python finds them.

Every ``.deb`` and wheel is hash-checked when a tree is made (:meth:`trainer.image.cas.Cache.ensure`); a tree
is written into ``roots/tmp-*`` and renamed into place only when complete, so an interrupted unpack is never
used. A finished tree is trusted by its name (it is derived data; delete ``roots/`` to rebuild it). Every path
in a tree has the modification time :data:`TREE_MTIME`, whenever it was unpacked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.cas import Cache
from trainer.image.debian import deb_inputs, resolve_debs, rootfs_entries
from trainer.image.layer import DIR, SYMLINK, Entry, plan_entries
from trainer.image.oci import compact_json
from trainer.image.wheels import install_wheels
from trainer.lock.imagelock import PYTHON_KEYS
from trainer.lock.pypi import pypi_files, wheel_fits

FORMAT = 1  # bump when the unpacked trees for the same inputs would change
# Every file, directory and symbolic link of a tree (and of a step's input, :func:`trainer.image.native`) gets this
# modification time, 1980-01-01T00:00:00Z, the earliest a ZIP entry can hold (PKWARE APPNOTE 4.4.6: MS-DOS dates),
# so that a tool zipping what it reads never refuses it. Without it a tree held the time it was unpacked, and a
# compiler that records its sources' times saw another root each time: nvcc's -lineinfo line tables hold the mtime
# of every header (fast-hadamard-transform's cubin differed in three such bytes between two builds, 2026-12-06).
TREE_MTIME = 315532800
# The trees' names on disk: ``roots/<TREE_VERSION>debs-<key>``. Version 2 trees have TREE_MTIME; version 1 trees
# (no prefix) held their unpack times and are never reused. The keys (hence the build steps' layer keys) stay: the
# outputs recorded before (TE, DeepEP, aws-ofi-nccl, antlr4) were reproduced from roots unpacked at different times.
TREE_VERSION = "v2-"
MOUNTS = ("build/input", "build/src", "build/out")


def deb_key(block: dict[str, Any]) -> str:
    """sha256 hex naming the unpacked Debian tree of ``block``: the formats and every .deb's name, version,
    architecture and sha256 (the same inputs as the image's ``debian-rootfs`` base layer)."""
    return hashlib.sha256(
        compact_json(
            {"format": FORMAT, "debs": deb_inputs(block), "mounts": mounts(block), "links": block.get("links", {})}
        )
    ).hexdigest()


def mounts(block: dict[str, Any]) -> list[str]:
    """The empty directories the Debian tree gets as mount points: ``build/input``, ``build/src``, ``build/out``
    and the Python prefix where the step's wheels are bound (``usr/local``, which only base-files' postinst would
    create)."""
    return sorted({*MOUNTS, block["python"]["prefix"].strip("/")})


def wheels_key(block: dict[str, Any], items: list[dict[str, Any]]) -> str:
    """sha256 hex naming the tree of ``items`` installed for ``block['python']``."""
    basis = {
        "format": FORMAT,
        "python": {k: block["python"][k] for k in PYTHON_KEYS},
        "wheels": [[w["name"], w["version"], w["filename"], w["sha256"]] for w in items],
    }
    return hashlib.sha256(compact_json(basis)).hexdigest()


def materialize(entries: list[Entry], dest: Path, allow_absolute_symlinks: bool = False) -> None:
    """Write ``entries`` (planned: validated, parents first) as files under the directory ``dest``.

    Files get mode 0755 or 0644 (or their ``mode_bits`` without setuid/setgid), streamed contents are checked
    against their ``sha256`` when one is given; symlinks are created as they are (absolute targets resolve
    inside the sandbox, where ``dest`` is ``/``). Every path written, and ``dest``, then gets the modification
    and access time :data:`TREE_MTIME`, once all are written (setting a path's time does not move its folder's).
    Raises :class:`UserError` for a refused entry or a content mismatch.
    """
    planned = plan_entries(entries, allow_absolute_symlinks)
    _write(planned, dest)
    stamp = (TREE_MTIME * 10**9, TREE_MTIME * 10**9)
    for entry in planned:
        os.utime(dest / entry.path, ns=stamp, follow_symlinks=False)
    os.utime(dest, ns=stamp)


def _write(planned: list[Entry], dest: Path) -> None:
    """:func:`materialize`'s writing of each planned entry under ``dest``."""
    for entry in planned:
        path = dest / entry.path
        if entry.type == DIR:
            path.mkdir(exist_ok=True)
            continue
        if entry.type == SYMLINK:
            os.symlink(entry.target, path)
            continue
        mode = entry.mode & 0o1777
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            if entry.data is not None:
                out.write(entry.data)
            elif entry.source is not None:
                with open(entry.source, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
            elif entry.opener is None:
                raise ValueError(f"build root entry {entry.path}: a file without content (data, source or opener)")
            else:
                digest = hashlib.sha256()
                with entry.opener() as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
                    raise UserError(
                        f"{entry.label or 'build root'}: {entry.path} has sha256 {digest.hexdigest()}, "
                        f"expected {entry.sha256} (refused)"
                    )
        os.chmod(path, mode)


def _tree_path(cache: Cache, name: str) -> Path:
    """Where the tree ``name`` (``debs-<key>``, ``wheels-<key>``) lies: ``ROOT/roots/<TREE_VERSION><name>``."""
    return cache.root / "roots" / f"{TREE_VERSION}{name}"


def _make_tree(cache: Cache, name: str, fill) -> Path:
    """:func:`_tree_path`, made by ``fill(tmp_dir)`` into a temporary directory and renamed in when done."""
    final = _tree_path(cache, name)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=final.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            remove_tree(tmp)
    return final


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it, read-only directories included (nothing when it is absent)."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def debian_tree(cache: Cache, block: dict[str, Any], offline: bool, console=None) -> Path:
    """The unpacked Debian tree of ``block`` (made on first use; every .deb hash-checked)."""

    def fill(tmp: Path) -> None:
        spool = Path(tempfile.mkdtemp(prefix="spool-", dir=cache.tmp_dir()))
        try:
            debs = [
                (cache.ensure(d["sha256"], f"deb {d['name']}_{d['version']}_{d['architecture']}", d["url"], offline), d)
                for d in block["debs"]
            ]
            entries = rootfs_entries(debs, spool)
            entries += [Entry(m, DIR) for m in mounts(block)]
            entries += [Entry(path, SYMLINK, target=target) for path, target in sorted(block.get("links", {}).items())]
            materialize(entries, tmp, allow_absolute_symlinks=True)
        finally:
            shutil.rmtree(spool, ignore_errors=True)

    key = deb_key(block)
    if console is not None and not _tree_path(cache, f"debs-{key}").is_dir():
        console.print(f"build root: unpacking {len(block['debs'])} .debs", soft_wrap=True)
    return _make_tree(cache, f"debs-{key}", fill)


def wheel_tree(
    cache: Cache, block: dict[str, Any], items: list[dict[str, Any]], offline: bool, console=None
) -> Path | None:
    """The tree of ``items`` installed under ``block['python']['prefix']`` (paths relative to the prefix), or
    None when ``items`` is empty. Every wheel is hash-checked and its contents checked against RECORD."""
    if not items:
        return None
    python = block["python"]
    prefix = python["prefix"].strip("/")

    def fill(tmp: Path) -> None:
        spool = Path(tempfile.mkdtemp(prefix="spool-", dir=cache.tmp_dir()))
        handles: list[Any] = []
        try:
            wheels = [
                (
                    cache.ensure(w["sha256"], f"wheel {w['filename']}", w["url"], offline),
                    w["filename"],
                    f"wheel {w['filename']}",
                )
                for w in items
            ]
            entries = install_wheels(wheels, python, spool, handles)
            local = []
            for e in entries:
                path = e.path.strip("/")
                if not path.startswith(prefix + "/"):
                    raise UserError(f"build root: {e.path} is outside python.prefix /{prefix}")
                local.append(
                    Entry(
                        path[len(prefix) + 1 :],
                        e.type,
                        data=e.data,
                        source=e.source,
                        opener=e.opener,
                        length=e.length,
                        sha256=e.sha256,
                        label=e.label,
                        executable=e.executable,
                        target=e.target,
                    )
                )
            materialize(local, tmp)
        finally:
            for h in handles:
                h.close()
            shutil.rmtree(spool, ignore_errors=True)

    key = wheels_key(block, items)
    if console is not None and not _tree_path(cache, f"wheels-{key}").is_dir():
        console.print(f"build root: installing {len(items)} wheels", soft_wrap=True)
    return _make_tree(cache, f"wheels-{key}", fill)


def resolve_build_root(block: dict[str, Any]) -> dict[str, Any]:
    """``block`` with ``debs`` (apt, :func:`trainer.image.debian.resolve_debs`) and ``wheels`` (each exact pin
    of ``requirements``: the best fitting wheel for ``python`` from PyPI) resolved. Network. Raises
    :class:`UserError` for a requirement that is not ``name==version`` or has no fitting wheel."""
    import re

    python = block["python"]
    cp = "cp" + "".join(python["version"].split(".")[:2])
    target = re.match(r"^x86_64-manylinux_(\d+)_(\d+)$", python.get("platform", ""))
    glibc = (int(target.group(1)), int(target.group(2))) if target else (9, 99)
    wheels = []
    for spec in block.get("requirements", []):
        name, sep, version = spec.partition("==")
        if not sep or not name or not version:
            raise UserError(f"build_root.requirements: {spec!r} is not an exact pin name==version")
        from packaging.utils import parse_wheel_filename

        fitting = [
            f
            for f in pypi_files(name, version)
            if f["packagetype"] == "bdist_wheel"
            and f["sha256"]
            and str(parse_wheel_filename(f["filename"])[1]) == version
            and wheel_fits(f["filename"], cp, glibc=glibc)
        ]
        if not fitting:
            raise UserError(f"build_root.requirements: {spec}: no wheel on PyPI fits {cp} x86_64 glibc {glibc}")
        best = sorted(fitting, key=lambda f: f["filename"])[-1]
        wheels.append(
            {
                "name": name,
                "version": version,
                "filename": best["filename"],
                "url": best["url"],
                "sha256": best["sha256"],
            }
        )
    base = {"suite": block["suite"], "variant": block.get("variant", "essential"), "include": block.get("include", [])}
    if block.get("sources"):
        base["sources"] = block["sources"]
    return {**block, "debs": resolve_debs(base), "wheels": wheels}
