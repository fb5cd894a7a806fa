"""Git tree ids computed without git, and the checks a source tree must pass before it enters a layer.

A git tree id is what ``git rev-parse COMMIT^{tree}`` prints. It is computed here from the files alone
(Git's object format, ``Documentation/gitformat-*`` / "Git Internals - Git Objects" in the Pro Git book):

- a blob's id is ``sha1(b"blob <size>\\0" + content)``; a symlink is a blob of its target's bytes;
- a tree is ``sha1(b"tree <size>\\0" + entries)``, each entry ``b"<mode> <name>\\0" + <20-byte id>``, modes
  ``100644`` (file), ``100755`` (executable file), ``120000`` (symlink), ``40000`` (tree), ``160000`` (a
  submodule: a gitlink, whose 20-byte id is the submodule's commit, not a blob), entries sorted by name bytes
  with a directory compared as ``name + "/"``;
- empty directories are not part of a tree.

Two archives of any format that unpack to files with the same tree id hold exactly the same commit's files:
that is why a lock pins a git source by its tree and never needs an archive's own bytes to be stable.

This module imports only the standard library, so the version probe can use it inside a training process.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.errors import UserError

FILE_MODE, EXEC_MODE, LINK_MODE, GITLINK_MODE = "100644", "100755", "120000", "160000"
MAX_LINK_HOPS = 40  # Linux's MAXSYMLINKS: a longer chain is a loop


def blob_id(data: bytes) -> bytes:
    """The 20-byte git blob id of ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def git_tree_id(files: dict[str, tuple[str, bytes]], gitlinks: dict[str, str] | None = None) -> str:
    """The git tree id (40 hex) of ``files``: relative POSIX path -> (mode "100644"/"100755"/"120000",
    content bytes, or a symlink's target bytes), plus ``gitlinks``: submodule path -> its commit (40 hex), the
    entries a tree holds for its submodules (an archive of the tree has none of their files, so a lock states
    them). Raises :class:`UserError` for an empty ``files`` or a path that is both a file and a submodule (or
    under one)."""
    if not files:
        raise UserError("a git tree needs at least one file (empty directories are not part of a tree)")
    blobs = {path: (mode, blob_id(data)) for path, (mode, data) in files.items()}
    for path, commit in (gitlinks or {}).items():
        if path in blobs:
            raise UserError(f"{path} is both a file and a submodule (refused)")
        blobs[path] = (GITLINK_MODE, bytes.fromhex(commit))
    return tree_id_of_blobs(blobs)


def tree_id_of_blobs(blobs: dict[str, tuple[str, bytes]]) -> str:
    """The git tree id (40 hex) of ``blobs``: relative path -> (mode, 20-byte blob id). Raises
    :class:`UserError` when a path is both a file and a directory (no git tree can hold that)."""
    root: dict[str, Any] = {}
    for path, value in blobs.items():
        node = root
        parts = path.split("/")
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"{'/'.join(parts[: i + 1])} is both a file and a directory (refused)")
        if isinstance(node.get(parts[-1]), dict):
            raise UserError(f"{path} is both a file and a directory (refused)")
        node[parts[-1]] = value

    def tree(node: dict[str, Any]) -> bytes:
        items = []
        for name, value in node.items():
            raw = os.fsencode(name)
            if isinstance(value, dict):
                items.append((raw + b"/", b"40000 " + raw + b"\0" + tree(value)))
            else:
                items.append((raw, value[0].encode() + b" " + raw + b"\0" + value[1]))
        body = b"".join(entry for _, entry in sorted(items, key=lambda item: item[0]))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    return tree(root).hex()


def directory_tree_id(root: Path, skip_dirs: Iterable[str] = ("__pycache__", ".git"), max_bytes: int = 1 << 30) -> str:
    """The git tree id of the files under directory ``root`` as they are on disk now (a source installed
    from an archive or a checkout), leaving out directories named in ``skip_dirs`` (byte-code caches and a
    checkout's own ``.git``) and ``*.egg-info`` directories an editable install adds, at any depth (an
    upstream tree that commits such a directory therefore shows as changed). Files are read one at a time
    (about 0.1 s for Megatron-LM's 36 MB). Raises :class:`OSError` when ``root`` cannot be read or holds
    more than ``max_bytes`` bytes of files (not a source checkout; default 1 GiB)."""
    skip = set(skip_dirs)
    total = 0
    blobs: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if d in skip or d.endswith(".egg-info"):
                continue
            if os.path.islink(full):
                filenames.append(d)  # a symlink to a directory is a blob in git, not a tree
            else:
                keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                blobs[rel] = (LINK_MODE, blob_id(os.fsencode(os.readlink(full))))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise OSError(f"{root}: more than {max_bytes:,} bytes of files (not a source checkout)")
                with open(full, "rb") as handle:
                    data = handle.read()
                blobs[rel] = (EXEC_MODE if st.st_mode & 0o100 else FILE_MODE, blob_id(data))  # git: owner x bit
    if not blobs:
        raise OSError(f"{root}: no files")
    return tree_id_of_blobs(blobs)


class SymlinkError(UserError):
    """A symlink that does not stay inside its tree; ``kind``: ``outside``, ``absolute`` or ``loop``; ``through``:
    the link of the chain that made it so (the link itself, or one it resolves through)."""

    def __init__(self, kind: str, path: str, target: str, through: str = "") -> None:
        self.kind, self.path, self.target, self.through = kind, path, target, through
        super().__init__(f"symlink {path} -> {target}: {kind}")


def resolve_in_tree(path: str, links: dict[str, str], allow_absolute: bool = False) -> str:
    """Resolve the symlink at ``path`` through the whole tree, hop by hop as the kernel would after extraction:
    every component of its target that is itself a symlink of ``links`` (normalized relative path -> target) is
    followed. Returns the resolved path, relative to the root (components absent from the tree kept lexically).

    Raises :class:`SymlinkError` when a step climbs above the root (``top/up -> ../../..`` with
    ``top/esc -> up/../../../../etc/shadow``), for an absolute target without ``allow_absolute`` (with it, an
    absolute target restarts at the root), and after more than :data:`MAX_LINK_HOPS` links (a loop).
    """
    hops = 0
    target = links[path]
    if target.startswith("/") and not allow_absolute:
        raise SymlinkError("absolute", path, target)
    resolved = [] if target.startswith("/") else [p for p in posixpath.dirname(path).split("/") if p]
    pending = target.split("/")
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                raise SymlinkError("outside", path, target)
            resolved.pop()
            continue
        candidate = "/".join(resolved + [part])
        if candidate in links:
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise SymlinkError("loop", path, target)
            inner = links[candidate]
            if inner.startswith("/"):
                if not allow_absolute:
                    raise SymlinkError("absolute", path, target, candidate)
                resolved = []
            pending = inner.split("/") + pending
            continue
        resolved.append(part)
    return "/".join(resolved)


def check_links_stay_inside(links: dict[str, str], label: str) -> None:
    """Refuse any symlink of a source tree that resolves outside the tree, following chains through the
    whole tree (``a -> ../..`` used by ``b -> a/x`` is resolved as the kernel would, hop by hop).

    ``links``: relative path -> target, for every symlink of the tree. Raises :class:`UserError` naming
    ``label`` and the link for an absolute target, a target above the tree's root, or a loop."""
    for path in sorted(links):
        try:
            resolve_in_tree(path, links)
        except SymlinkError as err:
            head = f"{label}: symlink {path} -> {err.target}"
            if err.kind == "outside":
                raise UserError(f"{head} resolves outside the source tree (refused)") from None
            if err.kind == "loop":
                raise UserError(f"{head}: more than {MAX_LINK_HOPS} links (a loop)") from None
            if err.through:
                raise UserError(
                    f"{head} goes through {err.through} -> {links[err.through]}, an absolute target (refused)"
                ) from None
            raise UserError(f"{head}: absolute target refused") from None
