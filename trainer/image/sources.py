"""Git sources: an archive (tar, optionally compressed) of one commit, checked against the lock's git tree id.

The archive must hold one top-level directory (as ``git archive --prefix=NAME/`` and GitHub's tarballs do);
it is stripped, and the remaining files are hashed the way git hashes a tree (blob = sha1("blob <size>\\0" +
bytes); tree entries "<mode> <name>\\0<20-byte id>" sorted with directories compared as "name/"; modes
100644, 100755, 120000 and 40000 — Git's object format, Documentation/technical/ in git's sources). The
result must equal the lock's ``tree``: the archive then holds exactly that commit's files, whatever tool
made the tar. Empty directories are not part of a git tree and are dropped from the layer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Tuple

from trainer.errors import UserError
from trainer.image.layer import DIR, FILE, SYMLINK, Entry, entries_from_tar


def _blob_id(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def git_tree_id(files: Dict[str, Tuple[str, bytes]]) -> str:
    """The git tree id (40 hex) of ``files``: relative path -> (mode "100644"/"100755"/"120000", content
    or symlink target bytes)."""
    root: Dict[str, Any] = {}
    for path, (mode, data) in files.items():
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (mode, _blob_id(data))

    def tree(node: Dict[str, Any]) -> bytes:
        items = []
        for name, value in node.items():
            if isinstance(value, dict):
                items.append((name + "/", b"40000 " + name.encode() + b"\0" + tree(value)))
            else:
                items.append((name, value[0].encode() + b" " + name.encode() + b"\0" + value[1]))
        body = b"".join(entry for _, entry in sorted(items, key=lambda x: x[0].encode()))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    return tree(root).hex()


def source_entries(archive: Path, source: Dict[str, Any]) -> List[Entry]:
    """Layer entries of the git ``source`` (a lock ``sources[]`` item) from its ``archive``, under its ``dest``.

    Raises :class:`UserError` when the archive's files do not hash to the locked tree, when it does not
    have a single top-level directory, or for refused members (see :func:`entries_from_tar`).
    """
    label = f"source {source['name']} ({source['archive']['filename']})"
    with open(archive, "rb") as handle:
        raw = entries_from_tar(handle, "", strip_components=0)
    tops = {e.path.split("/")[0] for e in raw}
    if len(tops) != 1 or any(e.path == next(iter(tops)) and e.type != DIR for e in raw):
        raise UserError(f"{label}: expected one top-level directory in the archive, found {len(tops)} entries")
    top = next(iter(tops))
    files: Dict[str, Tuple[str, bytes]] = {}
    entries: List[Entry] = []
    dest = source["dest"].strip("/")
    for entry in raw:
        rel = entry.path[len(top) + 1:]
        if not rel:
            continue
        if entry.type == FILE:
            files[rel] = ("100755" if entry.executable else "100644", entry.data)
        elif entry.type == SYMLINK:
            files[rel] = ("120000", entry.target.encode())
        else:
            continue  # directories follow from files; empty ones are not in a git tree
        entries.append(Entry(f"{dest}/{rel}", entry.type, data=entry.data, executable=entry.executable,
                             target=entry.target))
    tree = git_tree_id(files)
    if tree != source["tree"]:
        raise UserError(f"{label}: archive files hash to git tree {tree}, lock says {source['tree']} (refused)")
    return entries
