"""The stack pins (``lockfiles/stack.json``, the recipe's versions) and their agreement with ``conf/stack/``.

Not to be confused with the image locks (:mod:`trainer.lock.imagelock`, ``lockfiles/*.lock.json``) and the
launcher's lock (``lockfiles/launcher.lock``, written by ``bin/lock-launcher``).

``conf/stack/<option>.yaml`` restates the pins a run is composed with; the lockfile is the source of
truth. :func:`verify_stack` refuses a composition whose pins differ from the lockfile it names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer import REPO_ROOT
from trainer.compose.schema import StackConfig
from trainer.errors import UserError
from trainer.inputs import read_json, reading

# conf field -> (component, key) in lockfiles/stack.json
STACK_FIELDS = {
    "miles_commit": ("miles", "commit"),
    "megatron_lm_commit": ("megatron_lm", "commit"),
    "megatron_core": ("megatron_lm", "version"),
    "transformer_engine": ("transformer_engine", "version"),
    "torch": ("torch", "version"),
    "cuda": ("cuda", "version"),
    "nccl": ("nccl", "version"),
    "deepep": ("deepep", "version"),
    "aws_ofi_nccl": ("aws_ofi_nccl", "version"),
    "python": ("python", "version"),
}


def load_stack_lock(path: Path) -> dict[str, Any]:
    """Read a stack lockfile (JSON, ``{"schema_version": 1, "components": {...}}``).

    Raises :class:`UserError` naming the file when it is missing, not JSON, or lacks ``components``.
    """
    with reading(path, missing=f"{path}: stack lockfile not found", unreadable=f"{path}: not readable"):
        data = read_json(path, "stack lockfile")
    if not isinstance(data, dict) or not isinstance(data.get("components"), dict):
        raise UserError(f"{path}: expected an object with a 'components' object")
    return data


def verify_stack(stack: StackConfig, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Check every pin of ``stack`` against the lockfile it names (``stack.lockfile``, relative to ``root``).

    Returns the lockfile's data. Raises :class:`UserError` with the field and both values on a mismatch.
    """
    path = root / stack.lockfile
    data = load_stack_lock(path)
    for name, (component, key) in STACK_FIELDS.items():
        locked = data["components"].get(component, {}).get(key)
        wanted = getattr(stack, name)
        if str(locked) != str(wanted):
            raise UserError(f"stack.{name} {wanted} != {stack.lockfile} components.{component}.{key} {locked}")
    return data
