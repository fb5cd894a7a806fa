"""Source checkouts of the locked Megatron-LM and miles commits, verified by git tree hash before use.

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
from typing import Dict

from trainer.errors import CheckError
from trainer.image.gittree import directory_tree_id

# component of lockfiles/stack.json -> (launcher field, environment variable, top-level package it provides)
CHECKOUTS = {
    "megatron_lm": ("megatron_lm_path", "MEGATRON_LM_PATH", "megatron"),
    "miles": ("miles_path", "MILES_PATH", "miles"),
}


def verify_checkouts(launcher, lock_path: Path) -> Dict[str, Dict[str, str]]:
    """Each checkout of :data:`CHECKOUTS` (``launcher.<field>``, else ``$<ENV VAR>``) verified against the lock.

    Returns ``{component: {"path", "commit", "tree"}}``. Raises :class:`CheckError` (one line) when a path is
    not given, is not a directory, or its files hash to another tree than the lock's.
    """
    try:
        components = json.loads(lock_path.read_text())["components"]
    except (OSError, ValueError, KeyError) as ex:
        raise CheckError(f"{lock_path}: cannot read the stack lock's components ({ex})") from None
    out: Dict[str, Dict[str, str]] = {}
    for component, (field, var, package) in CHECKOUTS.items():
        given = getattr(launcher, field) or os.environ.get(var)
        if not given:
            raise CheckError(f"launcher.{field} (or ${var}) is not set: launcher local-megatron needs a {component} "
                             f"checkout of commit {components[component]['commit'][:12]}")
        root = Path(given).absolute()
        if not (root / package).is_dir():
            raise CheckError(f"launcher.{field} {given}: not a {component} checkout (no {package}/ in it)")
        tree = directory_tree_id(root)
        locked = components[component]
        if tree != locked["tree"]:
            raise CheckError(f"launcher.{field} {given}: files hash to git tree {tree}, {lock_path.name} pins "
                             f"{locked['tree']} (commit {locked['commit'][:12]}): refused")
        out[component] = {"path": str(root), "commit": locked["commit"], "tree": tree}
    return out
