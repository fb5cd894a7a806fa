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
every subject file's sha256), or, given an image instead of a run directory, the image's signed provenance;
a failed check is one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional


from trainer import REPO_ROOT
from trainer.errors import UserError
from trainer.inputs import parse_json, read_text, read_yaml

# component -> (observed path in the probe, requirements name in a pip lock, stack.json component, recipe stack key)
COMPONENTS = {
    "torch": (("torch", "version"), "torch", "torch", "torch"),
    "nccl": (("torch", "nccl"), "nvidia-nccl-cu13", "nccl", "nccl"),
    "cuda": (("torch", "cuda"), None, "cuda", "cuda"),
    "transformer_engine": (("components", "transformer_engine"), "transformer-engine", "transformer_engine", "transformer_engine"),
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


def _dig(data: Any, path) -> Optional[str]:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return None if data is None else str(data)


def read_lock(path: Path) -> Dict[str, str]:
    """Pins of a lock as ``component -> version``; raises :class:`UserError` for a missing or unreadable lock."""
    try:
        text = read_text(path, "lock")
    except FileNotFoundError:
        raise UserError(f"{path}: lock not found") from None
    except OSError as ex:
        raise UserError(f"{path}: not readable ({ex.strerror})") from None
    pins: Dict[str, str] = {}
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


def verify(record: Dict[str, Any], lock: Dict[str, str], recipe: Dict[str, str]) -> List[Dict[str, Optional[str]]]:
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
        rows.append({"component": name, "locked": locked, "recipe": recipe.get(name), "observed": observed, "verdict": verdict})
    for key in sorted(k for k in lock if k.startswith("dist:")):  # an image stamp's distributions
        name = key[len("dist:"):]
        seen = {(p.get("distributions") or {}).get(name) for p in observed_all} if observed_all else {None}
        observed = " / ".join(sorted(str(s) for s in seen)) if len(seen) > 1 else next(iter(seen))
        verdict = "drift" if len(seen) > 1 else ("absent" if observed is None else
                                                ("ok" if _same(observed, lock[key]) else "drift"))
        rows.append({"component": name, "locked": lock[key], "recipe": None, "observed": observed, "verdict": verdict})
    return rows


def lock_of(record: Dict[str, Any], lock: Optional[Path] = None) -> Path:
    """The lock a run is verified against: ``lock`` when given, else the one its record names."""
    return lock or (REPO_ROOT / record.get("lock", {}).get("path", "lockfiles/launcher.lock"))


def verdict(record: Dict[str, Any], lock: Optional[Path] = None) -> Dict[str, Any]:
    """The verify verdict of a run ``record`` (with ``probe``) against its lock (or ``lock``) and the
    recipe's stack as composed: ``{"lock", "ok", "rows"}`` (``ok``: nothing locked drifted or is absent)."""
    lock_path = lock_of(record, lock)
    rows = verify(record, read_lock(lock_path), {k: str(v) for k, v in (record.get("stack") or {}).items()})
    try:
        label = lock_path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        label = str(lock_path)
    return {"lock": label, "ok": not [r for r in rows if r["verdict"] in ("drift", "absent")], "rows": rows}


def check_signed(path: Path, key: Path) -> str:
    """``--key``: verify the signed attestation of a run directory, or the signed provenance of an image
    (an OCI layout or oci-archive), with the public key; return the one-line verdict. Raises
    :class:`trainer.record.attest.VerificationFailed` (exit 1) or :class:`UserError` on failure."""
    from trainer.record import attest
    from trainer.record.rundir import RECORD

    public = attest.load_public_key(key)
    if (path / RECORD).is_file() or (path / attest.ATTESTATION).is_file():
        statement = attest.check_run(path, public)
        return (f"attestation ok: {path / attest.ATTESTATION} signed by {public.keyid}; "
                f"{len(statement['subject'])} subjects match ({', '.join(s['name'] for s in statement['subject'])})")
    statement = attest.check_image(path, public)
    return f"provenance ok: {path} signed by {public.keyid}; subject sha256:{statement['subject'][0]['digest']['sha256']}"


def main(argv: List[str]) -> int:
    """``trainer verify RUN_DIR [--lock L] [--recipe R] [--json] [--key PUB]``; exit 0 when nothing locked
    drifted (and, with ``--key``, the attestation verifies); ``trainer verify IMAGE --key PUB`` checks an
    image's signed provenance only."""
    parser = argparse.ArgumentParser(prog="trainer verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="run directory (or, with --key, an image: OCI layout or oci-archive)")
    parser.add_argument("--lock", type=Path, help="lock to verify against (default: the run's own)")
    parser.add_argument("--recipe", type=Path, help="recipe YAML whose stack block gives the recipe column")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--key", type=Path, help="public key (KEY.pub from `trainer keygen`): first verify the run's "
                        "signed attestation.json (signature and every subject's sha256) or an image's signed provenance")
    args = parser.parse_args(argv)
    from trainer.record.rundir import RECORD, load_record

    signed = check_signed(args.run_dir, args.key) if args.key is not None else None
    if signed and not args.json:
        print(signed)
    if signed and not (args.run_dir / RECORD).is_file():
        if args.json:
            print(json.dumps({"signature": signed}, indent=2))
        return 0

    record_path = args.run_dir / RECORD
    record = load_record(args.run_dir)
    if record is None:
        raise UserError(f"{record_path}: no run record (is {args.run_dir} a run directory?)")
    if not record.get("probe"):
        raise UserError(f"{record_path}: no probe (a plan, or a run that stopped before its processes started)")
    lock_path = lock_of(record, args.lock)
    lock = read_lock(lock_path)
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
    bad = [r for r in rows if r["verdict"] in ("drift", "absent")]
    if args.json:
        print(json.dumps({"lock": str(lock_path), "rows": rows, "ok": not bad,
                          **({"signature": signed} if signed else {})}, indent=2))
    else:
        from rich.table import Table

        from trainer.console import table_console

        table = Table(title=f"verify {args.run_dir} against {lock_path.name}")
        for col in ("component", "locked", "recipe", "observed", "verdict"):
            table.add_column(col)
        colours = {"ok": "green", "drift": "red", "absent": "red", "not locked": "yellow", "-": "dim"}
        for r in rows:
            table.add_row(*(str(r[c] or "") for c in ("component", "locked", "recipe", "observed")),
                          f"[{colours[r['verdict']]}]{r['verdict']}")
        table_console().print(table)
        print("ok: nothing the lock pins drifted" if not bad else f"{len(bad)} locked component(s) drifted or absent: "
              + ", ".join(r["component"] for r in bad))
    return 0 if not bad else 1
