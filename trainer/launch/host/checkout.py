"""Source checkouts of the locked Megatron-LM and miles commits, verified by git tree hash before use.

Where they come from, in order: ``launcher.megatron_lm_path`` / ``launcher.miles_path``, ``$MEGATRON_LM_PATH`` /
``$MILES_PATH``, else the bundle's cache (the canonical archive of the locked tree that ``trainer cache add-git``
or ``trainer cache fetch`` stored), unpacked once into ``CACHE/checkouts/<tree>``.

A checkout is a directory holding exactly one commit's files (a ``git archive`` export or a clean clone). Its
files are hashed the way git hashes a tree (:func:`trainer.image.gittree.directory_tree_id`: ``.git`` and
byte-code caches left out) and the result must equal the ``tree`` that ``lockfiles/stack.json`` pins next to the
commit; the commit is then known from the lock. The probe inside the training process hashes the checkout it
imports from again (:func:`trainer.probe.source_of`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.errors import CheckError
from trainer.image.cas import Cache
from trainer.image.gittree import EXEC_MODE, LINK_MODE, directory_tree_id
from trainer.image.sources import cached_archive, verified_files

# component of lockfiles/stack.json -> (launcher field, environment variable, top-level package it provides)
CHECKOUTS = {
    "megatron_lm": ("megatron_lm_path", "MEGATRON_LM_PATH", "megatron"),
    "miles": ("miles_path", "MILES_PATH", "miles"),
}


def unpack_from_cache(component: str, locked: dict[str, str], cache=None) -> Path:
    """A checkout of the locked ``component`` (``{"commit", "tree", "source"}`` from ``lockfiles/stack.json``)
    unpacked from the bundle's cache (:class:`trainer.image.cas.Cache`; seeded by ``trainer cache add-git`` or
    ``trainer cache fetch``) into ``CACHE/checkouts/<tree>``, once: the archive's files are checked against the
    tree when unpacked (:func:`trainer.image.sources.verified_files`) and written to a temporary directory that
    is renamed in. Raises :class:`~trainer.errors.UserError` (one line, with the seeding commands) when the
    cache does not hold the tree."""
    import shutil
    import tempfile

    cache = cache or Cache()
    dest = cache.root / "checkouts" / locked["tree"]
    if dest.is_dir():
        return dest
    source = {"name": component, "commit": locked["commit"], "tree": locked["tree"], "url": locked.get("source", "")}
    files = verified_files(cached_archive(cache, source), source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{locked['tree'][:12]}-", dir=dest.parent))
    try:
        for rel, (mode, data) in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if mode == LINK_MODE:
                path.symlink_to(data.decode("utf-8", "surrogateescape"))
            else:
                path.write_bytes(data)
                path.chmod(0o755 if mode == EXEC_MODE else 0o644)
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():  # another run did not just unpack it
            raise
    return dest


def verify_checkouts(launcher, lock_path: Path, cache=None) -> dict[str, dict[str, str]]:
    """Each checkout of :data:`CHECKOUTS` verified against the lock: ``launcher.<field>``, else ``$<ENV VAR>``,
    else unpacked from the cache (:func:`unpack_from_cache`).

    Returns ``{component: {"path", "commit", "tree"}}``. Raises :class:`CheckError` (one line) when a given
    path is not a directory holding the package or its files hash to another tree than the lock's, and
    :class:`~trainer.errors.UserError` when nothing is given and the cache lacks the tree.
    """
    try:
        components = json.loads(lock_path.read_text())["components"]
    except (OSError, ValueError, KeyError) as ex:
        raise CheckError(f"{lock_path}: cannot read the stack lock's components ({ex})") from None
    out: dict[str, dict[str, str]] = {}
    for component, (field, var, package) in CHECKOUTS.items():
        locked = components[component]
        given = getattr(launcher, field) or os.environ.get(var)
        root = Path(given).absolute() if given else unpack_from_cache(component, locked, cache)
        label = f"launcher.{field} {given}" if given else f"cached {component} checkout {root}"
        if not (root / package).is_dir():
            raise CheckError(f"{label}: not a {component} checkout (no {package}/ in it)")
        tree = directory_tree_id(root)
        if tree != locked["tree"]:
            raise CheckError(
                f"{label}: files hash to git tree {tree}, {lock_path.name} pins "
                f"{locked['tree']} (commit {locked['commit'][:12]}): refused"
            )
        out[component] = {"path": str(root), "commit": locked["commit"], "tree": tree}
    return out
