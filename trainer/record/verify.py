"""The verify verdict of a run: did it use what the lock pins? Observed (the probe) against locked and recipe.

For each component the table (:func:`verify`) gives the version the lock pins, the recipe's pin (the composed
``stack``), what the probe saw inside the training process, and a verdict:

``ok``          observed == locked
``drift``       observed != locked
``absent``      locked, but not present in the running environment (not a pass)
``not locked``  observed, but the lock does not pin it (informational)

A lock is a requirements-style lock with ``name==version`` lines (``lockfiles/launcher.lock``), a JSON stack lock
(``lockfiles/stack.json``) or an image's stamped lock (:func:`parse_lock`). :func:`verdict` is what a run's
attestation carries (:mod:`trainer.record.attest`, which imports this module; it imports no other module of
:mod:`trainer.record` but :mod:`trainer.record.record`); the command ``trainer verify``, the signatures included, is
:mod:`trainer.record.verify_cli`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from trainer import REPO_ROOT
from trainer.errors import UserError
from trainer.inputs import parse_json, read_text, reading
from trainer.record.record import sha256_file

# component -> (observed path in the probe, requirements name in a pip lock, stack.json component, recipe stack key)
COMPONENTS = {
    "torch": (("torch", "version"), "torch", "torch", "torch"),
    "nccl": (("torch", "nccl"), "nvidia-nccl-cu13", "nccl", "nccl"),
    "cuda": (("torch", "cuda"), None, "cuda", "cuda"),
    "transformer_engine": (
        ("components", "transformer_engine"),
        "transformer-engine",
        "transformer_engine",
        "transformer_engine",
    ),
    "megatron_core": (("components", "megatron_core"), "megatron-core", "megatron_lm", "megatron_core"),
    "megatron_lm_commit": (("megatron_lm_commit",), None, "megatron_lm.commit", "megatron_lm_commit"),
    "megatron_lm_tree": (("megatron_lm_tree",), None, "megatron_lm.tree", None),
    "miles_commit": (("miles_commit",), None, "miles.commit", "miles_commit"),
    "miles_tree": (("miles_tree",), None, "miles.tree", None),
    "deepep": (("components", "deepep"), "deep-ep", "deepep", "deepep"),
    "tilelang": (("components", "tilelang"), "tilelang", None, None),
    "triton": (("components", "triton"), "triton", None, None),
    "transformers": (("components", "transformers"), "transformers", None, None),
    "tokenizers": (("components", "tokenizers"), "tokenizers", None, None),
    "python": (("python",), None, "python", "python"),
}


def _dig(data: Any, path) -> str | None:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return None if data is None else str(data)


def read_lock(path: Path) -> dict[str, str]:
    """Pins of a lock as ``component -> version`` (:func:`parse_lock`); raises :class:`UserError` for a missing or
    unreadable lock, or one that pins nothing."""
    with reading(path, missing=f"{path}: lock not found", unreadable=f"{path}: not readable"):
        text = read_text(path, "lock")
    return parse_lock(text, path)


def parse_lock(text: str, path: Path) -> dict[str, str]:
    """Pins of the lock ``text`` read from ``path`` (its suffix tells the format: ``.json`` a stack lock or an
    image's stamped lock, else requirements ``name==version`` lines). Raises :class:`UserError` when it pins
    none of the components verify knows: a verdict against an empty lock would say ok about anything."""
    pins = _parse_lock(text, path)
    if not pins:
        raise UserError(
            f"{path}: the lock pins none of the components verify compares ({', '.join(COMPONENTS)}); "
            "expected a requirements lock (NAME==VERSION lines), a stack lock or an image's stamp"
        )
    return pins


def _parse_lock(text: str, path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    if path.suffix == ".json":
        data = parse_json(text, str(path))
        if isinstance(data, dict) and "distributions" in data and "lock" in data:
            # the lock an image was built from, as stamped into it (/etc/recipe-bundle/lock.json)
            pins["python"] = str((data.get("python") or {}).get("version"))
            pins.update({f"dist:{n.lower().replace('_', '-')}": str(v) for n, v in data["distributions"].items()})
            sources = data.get("sources")
            if not isinstance(sources, dict):
                sources = {}
            for name in ("megatron_lm", "miles"):  # git sources installed in the image
                src = sources.get(name)
                if isinstance(src, dict):
                    pins[f"{name}_commit"] = str(src.get("commit"))
                    pins[f"{name}_tree"] = str(src.get("tree"))
            return pins
        comps = data.get("components", {}) if isinstance(data, dict) else {}
        for name, (_, _, stack_key, _) in COMPONENTS.items():
            if stack_key:
                comp, _, field = stack_key.partition(".")
                value = comps.get(comp, {}).get(field or "version") if isinstance(comps.get(comp), dict) else None
                if value is not None:
                    pins[name] = str(value)
        return pins
    versions = {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", text, re.M)}
    for name, (_, req, _, _) in COMPONENTS.items():
        if req and req in versions:
            pins[name] = versions[req]
    return pins


def _same(observed: str, locked: str) -> bool:
    """Versions agree: equal; equal up to a local label (``+cu130``) that the lock does not pin (the lock's
    ``2.11.0`` accepts ``2.11.0+cu130``, the lock's ``2.11.0+cu130`` refuses ``2.11.0`` and ``2.11.0+cpu``);
    a release series the lock pins (``3.11``) and a release in it (``3.11.2``, not ``3.110``);
    or one commit a prefix of the other (7 hex digits at least)."""
    if observed == locked:
        return True
    if "+" not in locked and observed.split("+")[0] == locked:
        return True
    if re.match(r"^\d+(\.\d+)*$", locked) and re.match(r"^" + re.escape(locked) + r"\.\d", observed):
        return True  # a lock pinning a release series (Python "3.11") accepts its patch releases ("3.11.2")
    commit = re.compile(r"^[0-9a-f]{7,40}$")
    return bool(commit.match(locked) and commit.match(observed)) and (
        observed.startswith(locked) or locked.startswith(observed)
    )


def _distributions(probe: Any) -> dict[str, str]:
    """A probe's installed distributions, name -> version: its ``[[name, version], ...]``
    (:func:`trainer.probe.distribution_pairs`) or an older probe's ``{name: version}``. Anything else (a record
    edited by hand, a probe cut short) gives none, so every distribution the lock pins is ``absent`` for it."""
    given = probe.get("distributions") if isinstance(probe, dict) else None
    if isinstance(given, dict):
        pairs = list(given.items())
    elif isinstance(given, list) and all(isinstance(p, list) and len(p) == 2 for p in given):
        pairs = [(p[0], p[1]) for p in given]
    else:
        return {}
    return {str(n): str(v) for n, v in pairs if isinstance(n, str) and isinstance(v, str)}


class VerifyRow(TypedDict):
    """One row of the verify table: a ``component``'s ``locked``, ``recipe`` and ``observed`` versions (None where
    there is none) and its ``verdict``: ``ok``, ``drift``, ``absent``, ``not locked`` or ``-``."""

    component: str
    locked: str | None
    recipe: str | None
    observed: str | None
    verdict: str


def verify(record: Mapping[str, Any], lock: dict[str, str], recipe: dict[str, str]) -> list[VerifyRow]:
    """Rows of the verify table for a run ``record`` (with ``probe``: one, or ``ranks``, every rank's), lock pins
    and recipe pins; a component any two ranks report differently is ``drift``. When the record names the image
    it ran in (``image.digest``), a row ``image digest``: every rank's probe must report that digest."""
    probes = record.get("probe") or {}
    observed_all = probes.get("ranks", [probes]) if isinstance(probes, dict) else probes
    first = observed_all[0] if observed_all else {}
    rows: list[VerifyRow] = []
    for name, (path, _, _, _) in COMPONENTS.items():
        seen = {_dig(p, path) for p in observed_all} if observed_all else {None}
        observed = _dig(first, path)
        locked = lock.get(name)
        if len(seen) > 1:
            verdict = "drift"
            observed = " / ".join(sorted(str(s) for s in seen))
        elif locked is None:
            verdict = "not locked" if observed is not None else "-"
        elif observed is None:
            verdict = "absent"
        else:
            verdict = "ok" if _same(observed, locked) else "drift"
        rows.append(
            {"component": name, "locked": locked, "recipe": recipe.get(name), "observed": observed, "verdict": verdict}
        )
    for key in sorted(k for k in lock if k.startswith("dist:")):  # an image stamp's distributions
        name = key[len("dist:") :]
        seen = {_distributions(p).get(name) for p in observed_all} if observed_all else {None}
        observed = " / ".join(sorted(str(s) for s in seen)) if len(seen) > 1 else next(iter(seen))
        verdict = (
            "drift"
            if len(seen) > 1
            else ("absent" if observed is None else ("ok" if _same(observed, lock[key]) else "drift"))
        )
        rows.append({"component": name, "locked": lock[key], "recipe": None, "observed": observed, "verdict": verdict})
    digest = (record.get("image") or {}).get("digest")
    if digest:  # the image the run asked for, by digest: every rank's probe must report that one
        seen = {_dig(p, ("image", "digest")) for p in observed_all} if observed_all else {None}
        observed = " / ".join(sorted(str(s) for s in seen)) if len(seen) > 1 else next(iter(seen))
        verdict = "absent" if observed is None else ("ok" if observed == digest else "drift")
        rows.append(
            {"component": "image digest", "locked": digest, "recipe": None, "observed": observed, "verdict": verdict}
        )
    return rows


def lock_of(record: Mapping[str, Any], lock: Path | None = None) -> Path:
    """The lock a run is verified against: ``lock`` when given, else the one its record names."""
    return lock or (REPO_ROOT / ((record.get("lock") or {}).get("path") or "lockfiles/launcher.lock"))


class LockSubject(TypedDict):
    """How a statement names a lock (:func:`lock_subject`): ``path`` relative to ``base`` (``run``, ``bundle`` or
    ``absolute``) and the file's ``sha256`` (hex)."""

    path: str
    base: str
    sha256: str


def lock_subject(lock_path: Path, run_dir: Path) -> LockSubject:
    """How a statement names the lock a run was verified against: ``{"path", "base", "sha256"}``, ``base``
    ``run`` (a path inside the run directory: an image's stamped lock), ``bundle`` (inside this bundle's tree,
    ``lockfiles/launcher.lock``) or ``absolute``. Raises :class:`UserError` when the lock cannot be read."""
    try:
        digest = sha256_file(lock_path)
    except OSError as ex:
        raise UserError(f"{lock_path}: lock not readable ({ex.strerror})") from None
    if digest is None:
        raise UserError(f"{lock_path}: lock not readable ({os.strerror(errno.ENOENT)})")
    resolved = lock_path.resolve()
    for base, root in (("run", run_dir.resolve()), ("bundle", REPO_ROOT.resolve())):
        try:
            return {"path": resolved.relative_to(root).as_posix(), "base": base, "sha256": digest}
        except ValueError:
            continue
    return {"path": str(resolved), "base": "absolute", "sha256": digest}


def lock_path_of(lock: dict[str, Any], run_dir: Path) -> Path:
    """The file a statement's lock (:func:`lock_subject`) names, for the run directory ``run_dir``."""
    root = {"run": run_dir, "bundle": REPO_ROOT}.get(str(lock.get("base")))
    return root / str(lock.get("path")) if root is not None else Path(str(lock.get("path")))


class RunVerdict(TypedDict):
    """The verify verdict of a run (:func:`verdict`): the ``lock`` verified against, ``ok`` (nothing locked drifted
    or is absent) and the table's ``rows``."""

    lock: LockSubject
    ok: bool
    rows: list[VerifyRow]


def verdict(record: Mapping[str, Any], lock: Path | None = None, run_dir: Path | None = None) -> RunVerdict:
    """The verify verdict of a run ``record`` (with ``probe``) against its lock (or ``lock``) and the
    recipe's stack as composed: ``{"lock": {"path", "base", "sha256"}, "ok", "rows"}`` (``ok``: nothing locked
    drifted or is absent; ``lock`` as :func:`lock_subject` names it, relative to ``run_dir``
    when it lies there)."""
    lock_path = lock_of(record, lock)
    rows = verify(record, read_lock(lock_path), {k: str(v) for k, v in (record.get("stack") or {}).items()})
    return {"lock": lock_subject(lock_path, Path(run_dir or lock_path.parent)), "ok": not bad_rows(rows), "rows": rows}


def bad_rows(rows: list[VerifyRow]) -> list[VerifyRow]:
    """The rows whose component drifted or is absent: what makes a verdict fail."""
    return [r for r in rows if r["verdict"] in ("drift", "absent")]
