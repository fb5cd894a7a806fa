"""``trainer verify RUN_DIR``: did the run use what the lock pins? Observed (the probe) against locked and recipe.

For each component the table gives the version the lock pins, the recipe's pin (the composed ``stack``), what
the probe saw inside the training process, and a verdict:

``ok``          observed == locked
``drift``       observed != locked
``absent``      locked, but not present in the running environment (not a pass)
``not locked``  observed, but the lock does not pin it (informational)

Exit code 0 only when no locked component drifted or is absent; 1 otherwise; 2 on bad input.
The lock is the run's own (``record.json`` names it) unless ``--lock`` gives another: a requirements-style
lock with ``name==version`` lines (``lockfiles/launcher.lock``) or a JSON stack lock (``lockfiles/stack.json``).
``--recipe`` compares against a recipe YAML's ``stack`` block instead of the composed one.

``--key KEY.pub`` first checks the run's signed ``attestation.json`` (:mod:`trainer.record.attest`: the signature, then
that the run directory holds exactly the files it names, each with its sha256) and then takes every answer from
what was signed: the record's bytes as hashed, the probes, the lock by its signed sha256 (``--lock`` must be that
same file), the status and the steps. Given an image instead of a run directory, it checks the image's signed
provenance. A failed check is one line on stderr and exit 1. Without ``--key`` the answer is computed from the
files as they are, and the output says that nothing was checked against a signature.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from trainer import REPO_ROOT
from trainer.errors import UserError
from trainer.inputs import parse_json, read_bytes, read_text, read_yaml

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
    try:
        text = read_text(path, "lock")
    except FileNotFoundError:
        raise UserError(f"{path}: lock not found") from None
    except OSError as ex:
        raise UserError(f"{path}: not readable ({ex.strerror})") from None
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
            sources = data.get("sources") if isinstance(data.get("sources"), dict) else {}
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


def verify(record: dict[str, Any], lock: dict[str, str], recipe: dict[str, str]) -> list[dict[str, str | None]]:
    """Rows of the verify table for a run ``record`` (with ``probe``), lock pins and recipe pins."""
    probes = record.get("probe") or {}
    observed_all = probes.get("ranks", [probes]) if isinstance(probes, dict) else probes
    first = observed_all[0] if observed_all else {}
    rows = []
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
        seen = {(p.get("distributions") or {}).get(name) for p in observed_all} if observed_all else {None}
        observed = " / ".join(sorted(str(s) for s in seen)) if len(seen) > 1 else next(iter(seen))
        verdict = (
            "drift"
            if len(seen) > 1
            else ("absent" if observed is None else ("ok" if _same(observed, lock[key]) else "drift"))
        )
        rows.append({"component": name, "locked": lock[key], "recipe": None, "observed": observed, "verdict": verdict})
    return rows


def lock_of(record: dict[str, Any], lock: Path | None = None) -> Path:
    """The lock a run is verified against: ``lock`` when given, else the one its record names."""
    return lock or (REPO_ROOT / record.get("lock", {}).get("path", "lockfiles/launcher.lock"))


def verdict(record: dict[str, Any], lock: Path | None = None, run_dir: Path | None = None) -> dict[str, Any]:
    """The verify verdict of a run ``record`` (with ``probe``) against its lock (or ``lock``) and the
    recipe's stack as composed: ``{"lock": {"path", "base", "sha256"}, "ok", "rows"}`` (``ok``: nothing locked
    drifted or is absent; ``lock`` as :func:`trainer.record.attest.lock_subject` names it, relative to ``run_dir``
    when it lies there)."""
    from trainer.record.attest import lock_subject

    lock_path = lock_of(record, lock)
    rows = verify(record, read_lock(lock_path), {k: str(v) for k, v in (record.get("stack") or {}).items()})
    return {"lock": lock_subject(lock_path, Path(run_dir or lock_path.parent)), "ok": not bad_rows(rows), "rows": rows}


def bad_rows(rows: list[dict[str, str | None]]) -> list[dict[str, str | None]]:
    """The rows whose component drifted or is absent: what makes a verdict fail."""
    return [r for r in rows if r["verdict"] in ("drift", "absent")]


def signed_lock(signed, run_dir: Path, given: Path | None) -> tuple[Path, str]:
    """(the lock's path, its text) for a verdict from the signed run ``signed``: the lock whose sha256 the
    attestation signed, read from where it named it, or ``given`` (``--lock``) when that file has the same
    sha256. Raises :class:`trainer.record.attest.VerificationFailed` (one line) otherwise."""
    import hashlib

    from trainer.record.attest import ATTESTATION, VerificationFailed, lock_path_of

    where = run_dir / ATTESTATION
    lock = (signed.predicate.get("verify") or {}).get("lock")
    if not isinstance(lock, dict) or not isinstance(lock.get("sha256"), str):
        raise VerificationFailed(
            f"{where}: the attestation signed no lock (the run had no probe to verify: "
            f"{(signed.predicate.get('verify') or {}).get('reason', 'unknown')})"
        )
    path = given or lock_path_of(lock, run_dir)
    try:
        data = read_bytes(path, "lock")  # a FIFO refused without blocking, 64 MiB at most
    except OSError as ex:
        raise VerificationFailed(f"{where}: the signed lock {path} is not readable ({ex.strerror})") from None
    have = hashlib.sha256(data).hexdigest()
    if have != lock["sha256"]:
        what = f"--lock {path}" if given else f"the lock {path}"
        raise VerificationFailed(
            f"{where}: {what} has sha256 {have}; the attestation signed the lock "
            f"{lock.get('path')} with sha256 {lock['sha256']}"
        )
    return path, data.decode("utf-8", "replace")


def check_signed(path: Path, key: Path):
    """``--key``: verify the signed attestation of a run directory, or the signed provenance of an image
    (an OCI layout or oci-archive), with the public key. Returns (the one-line verdict, the
    :class:`trainer.record.attest.SignedRun` of a run or None for an image). Raises
    :class:`trainer.record.attest.VerificationFailed` (exit 1) or :class:`UserError` on failure."""
    from trainer.record import attest
    from trainer.record.rundir import RECORD

    public = attest.load_public_key(key)
    if (path / RECORD).is_file() or (path / attest.ATTESTATION).is_file():
        signed = attest.check_run(path, public)
        subjects = signed.statement["subject"]
        files = sum(1 for s in subjects if not Path(s["name"]).is_absolute() and s["name"] != attest.IMAGE_SUBJECT)
        rows = sum(1 for s in subjects if Path(s["name"]).is_absolute())
        image = [s for s in subjects if s["name"] == attest.IMAGE_SUBJECT]
        return (
            f"attestation ok: {path / attest.ATTESTATION} signed by {public.keyid}; {files} files of the run "
            f"directory match, none added or removed"
            + (f", {rows} files of its rows" if rows else "")
            + (f", image sha256:{image[0]['digest']['sha256']}" if image else "")
        ), signed
    statement = attest.check_image(path, public)
    return (
        f"provenance ok: {path} signed by {public.keyid}; subject sha256:{statement['subject'][0]['digest']['sha256']}",
        None,
    )


UNSIGNED_NOTE = (
    "unsigned: nothing above was checked against a signature; record.json and the lock were read as "
    "they are (--key KEY.pub verifies the run's attestation and takes every answer from it)"
)


def main(argv: list[str]) -> int:
    """``trainer verify RUN_DIR [--lock L] [--recipe R] [--json] [--key PUB]``; exit 0 when nothing locked
    drifted (and, with ``--key``, the attestation verifies); ``trainer verify IMAGE --key PUB`` checks an
    image's signed provenance only."""
    parser = argparse.ArgumentParser(
        prog="trainer verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "run_dir", type=Path, help="run directory (or, with --key, an image: OCI layout or oci-archive)"
    )
    parser.add_argument(
        "--lock",
        type=Path,
        help="lock to verify against (default: the run's own; with --key it must be the lock the attestation signed)",
    )
    parser.add_argument("--recipe", type=Path, help="recipe YAML whose stack block gives the recipe column")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--key",
        type=Path,
        help="public key (KEY.pub from `trainer keygen`): verify the run's signed "
        "attestation.json (the signature, every file of the run directory, the lock by digest) and "
        "take the verdict from it; or an image's signed provenance",
    )
    args = parser.parse_args(argv)
    from trainer.record.attest import count_steps_in
    from trainer.record.rundir import METRICS, RECORD, check_record_types, load_record

    signed, run = check_signed(args.run_dir, args.key) if args.key is not None else (None, None)
    if signed and not args.json:
        print(signed)
    if signed and run is None:
        if args.json:
            print(json.dumps({"signature": signed}, indent=2))
        return 0

    record_path = args.run_dir / RECORD
    if run is not None:  # every answer from what was signed: the record's bytes as hashed, the lock by digest
        record = run.record
        check_record_types(record, f"{record_path} (signed)")
        lock_path, lock_text = signed_lock(run, args.run_dir, args.lock)
        lock = parse_lock(lock_text, lock_path)
        status = run.predicate.get("run", {}).get("status")
        steps = run.steps  # counted from the bytes as hashed
    else:
        record = load_record(args.run_dir)
        if record is None:
            raise UserError(f"{record_path}: no run record (is {args.run_dir} a run directory?)")
        lock_path = lock_of(record, args.lock)
        lock = read_lock(lock_path)
        status = record.get("status")
        metrics = args.run_dir / METRICS
        steps = count_steps_in(metrics) if metrics.is_file() else 0  # streamed; a FIFO refused
    if not record.get("probe"):
        raise UserError(f"{record_path}: no probe (a plan, or a run that stopped before its processes started)")
    if args.recipe:
        try:
            data = read_yaml(args.recipe, "recipe file") or {}
        except OSError as ex:
            raise UserError(f"{args.recipe}: cannot read the recipe ({ex.strerror})") from None
        stack = data.get("stack") if isinstance(data, dict) else None
        if not isinstance(stack, dict):
            raise UserError(f"{args.recipe}: expected a mapping with a 'stack' mapping (a recipe file)")
        recipe = {k: str(v) for k, v in stack.items()}
    else:
        recipe = {k: str(v) for k, v in (record.get("stack") or {}).items()}
    rows = verify(record, lock, recipe)
    bad = bad_rows(rows)
    if args.json:
        print(
            json.dumps(
                {
                    "lock": str(lock_path),
                    "rows": rows,
                    "ok": not bad,
                    "signed": run is not None,
                    "status": status,
                    "steps": steps,
                    **({"signature": signed} if signed else {}),
                },
                indent=2,
            )
        )
    else:
        from rich.table import Table

        from trainer.console import table_console

        table = Table(title=f"verify {args.run_dir} against {lock_path.name}")
        for col in ("component", "locked", "recipe", "observed", "verdict"):
            table.add_column(col)
        colours = {"ok": "green", "drift": "red", "absent": "red", "not locked": "yellow", "-": "dim"}
        for r in rows:
            table.add_row(
                *(str(r[c] or "") for c in ("component", "locked", "recipe", "observed")),
                f"[{colours[r['verdict']]}]{r['verdict']}",
            )
        table_console().print(table)
        print(f"run {status}, {steps} steps in {METRICS}" + (" (as signed)" if run is not None else ""))
        print(
            "ok: nothing the lock pins drifted"
            if not bad
            else f"{len(bad)} locked component(s) drifted or absent: " + ", ".join(r["component"] for r in bad)
        )
        if run is None:
            print(UNSIGNED_NOTE)
    return 0 if not bad else 1
