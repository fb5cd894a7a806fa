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
from pathlib import Path, PurePosixPath
from typing import Any

from trainer.console import table_console
from trainer.errors import UserError
from trainer.image import provenance, referrers
from trainer.image.oci import digest_of, open_image
from trainer.inputs import read_bytes, read_yaml, reading
from trainer.record import attest
from trainer.record.attempts import known_hashes, linked, vouched_by, written_sha256
from trainer.record.attest import count_steps_in
from trainer.record.names import ATTESTATION, METRICS, RECORD, checkpoint_state, checkpoint_state_sha256
from trainer.record.record import sha256_file
from trainer.record.rundir import check_record_types, load_record
from trainer.record.verify import bad_rows, lock_of, lock_path_of, parse_lock, read_lock, verify
from trainer.signing import VerificationFailed, load_public_key, open_envelope


def signed_lock(signed, run_dir: Path, given: Path | None) -> tuple[Path, str]:
    """(the lock's path, its text) for a verdict from the signed run ``signed``: the lock whose sha256 the
    attestation signed, read from where it named it, or ``given`` (``--lock``) when that file has the same
    sha256. Raises :class:`trainer.signing.VerificationFailed` (one line) otherwise."""
    import hashlib

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
    :class:`trainer.signing.VerificationFailed` (exit 1) or :class:`UserError` on failure."""

    public = load_public_key(key)
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
    statement = check_image(path, public)
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
        with reading(args.recipe, unreadable=f"{args.recipe}: cannot read the recipe"):
            data = read_yaml(args.recipe, "recipe file") or {}
        stack = data.get("stack") if isinstance(data, dict) else None
        if not isinstance(stack, dict):
            raise UserError(f"{args.recipe}: expected a mapping with a 'stack' mapping (a recipe file)")
        recipe = {k: str(v) for k, v in stack.items()}
    else:
        recipe = {k: str(v) for k, v in (record.get("stack") or {}).items()}
    rows = verify(record, lock, recipe)
    bad = bad_rows(rows)
    attempts = check_attempts(args.run_dir, record)
    broken = [a for a in attempts if not a["ok"]]
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
                    "attempts": attempts,
                    **({"signature": signed} if signed else {}),
                },
                indent=2,
            )
        )
    else:
        from rich.table import Table

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
        for a in attempts:
            print(a["line"])
        print(
            "ok: nothing the lock pins drifted"
            if not bad
            else f"{len(bad)} locked component(s) drifted or absent: " + ", ".join(r["component"] for r in bad)
        )
        if run is None:
            print(UNSIGNED_NOTE)
    return 0 if not bad and not broken else 1


def _written_mismatch(base: Path, iteration: int, entry: dict[str, Any], known: dict[str, str]) -> str | None:
    """Why the sha256 file that the save of ``iteration`` wrote beside its checkpoint
    (:func:`trainer.record.names.checkpoint_state_sha256`) does not vouch for the checkpoint the attempt ``entry``
    resumed from (its ``checkpoint_sha256``, ``checkpoint_vouched_by`` ``"writer"``), or the hash an earlier
    attempt holds for that checkpoint (``known``, :func:`trainer.record.attempts.known_hashes`) differs; None
    when it does and none differs (the checkpoint's own bytes: :func:`_state_changed`)."""
    sums = checkpoint_state_sha256(iteration)
    if entry.get("checkpoint_vouched_by") != "writer":
        return f"its record holds no checkpoint's hash, yet the attempt says {entry.get('checkpoint_vouched_by')!r}"
    if known.get(checkpoint_state(iteration), entry.get("checkpoint_sha256")) != entry.get("checkpoint_sha256"):
        return f"resumed from a checkpoint of step {iteration} other than the one an earlier attempt recorded"
    written = written_sha256(base, iteration)
    if written is None:
        return f"{sums}: missing, a link or no sha256 line: nothing vouches for the checkpoint of step {iteration}"
    if written != entry.get("checkpoint_sha256"):
        return f"{sums}: does not hold the sha256 of the checkpoint of step {iteration} the attempt resumed from"
    return None


def _state_changed(base: Path, iteration: int, entry: dict[str, Any]) -> str | None:
    """Why the checkpoint of ``iteration`` under ``base``, where it is still there, is not the one the attempt
    ``entry`` resumed from (its ``checkpoint_sha256``): behind a symbolic link, unreadable, other bytes; None
    when it is that one or gone (a state removed since claims nothing)."""
    state = checkpoint_state(iteration)
    if linked(base, state):
        return f"{state}: a symbolic link on its way: not the checkpoint the attempt resumed from"
    try:
        digest = sha256_file(base / state)
    except OSError as err:
        return f"{state}: not readable ({err.strerror or err})"
    except UserError as err:  # a FIFO or device in its place
        return str(err)
    if digest is not None and digest != entry.get("checkpoint_sha256"):
        return f"{state}: changed since the attempt resumed from it (its sha256 is not the one the attempt holds)"
    return None


def check_attempts(run_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The earlier attempts a ``--resume`` linked into ``record`` (``attempts``, oldest first), each checked: its
    record file (``attempts/N/record.json``) present and of the sha256 the entry holds, and the checkpoint it was
    resumed from the one that record vouched for (where that record ended unsealed and holds no checkpoint's
    hash, :func:`trainer.record.attempts.vouched_by`: the one the sha256 file its save wrote beside it holds),
    the entry's ``checkpoint_vouched_by`` saying which (absent in entries written before it: ``"record"``), and
    that checkpoint, where it is still there, of the sha256 the entry holds (:func:`_state_changed`).
    One ``{"attempt", "record", "ok", "line"}`` per attempt (a record without ``attempts``: none); ``line``
    says what was found, ``ok`` False when anything differs. A record file is read only where it lies in the
    run directory: its path resolved (every link followed) must be the run directory's own ``attempts/...`` (a
    link to elsewhere, of ``attempts`` or of any folder under it, fails)."""
    import hashlib

    out = []
    base = Path(run_dir).resolve()
    for i, entry in enumerate(record.get("attempts") or [], 1):
        entry = entry if isinstance(entry, dict) else {}
        rel = entry.get("record")
        parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
        path = base.joinpath(*parts) if parts[:1] == ("attempts",) and ".." not in parts else None
        problem: str | None = None
        writer = False
        resolved = data = None
        try:
            resolved = path.resolve() if path is not None else None
            data = path.read_bytes() if path is not None and resolved == path and path.is_file() else None
        except (OSError, RuntimeError) as err:  # a loop of links (RuntimeError before Python 3.13), unreadable
            problem = f"{rel}: not readable ({getattr(err, 'strerror', None) or err})"
        if problem is not None:
            data = None
        elif path is not None and resolved is not None and resolved != path and resolved.exists():
            problem = f"{rel}: a symbolic link on its way (to {resolved}): not a file of the run directory"
        elif data is None:
            problem = f"{rel}: missing"
        elif hashlib.sha256(data).hexdigest() != entry.get("record_sha256"):
            problem = f"{rel}: its sha256 is not the one the record links"
        else:
            try:
                earlier = json.loads(data)
            except ValueError:
                earlier = None
            iteration = entry.get("resumed_from_iteration")
            vouched = (earlier or {}).get("files_sha256", {}) if isinstance(earlier, dict) else {}
            wanted = (
                vouched.get(checkpoint_state(iteration))
                if (isinstance(iteration, int) and iteration > 0 and isinstance(vouched, dict))
                else None
            )
            step = iteration if type(iteration) is int and iteration > 0 else None
            writer = step is not None and isinstance(earlier, dict) and vouched_by(earlier) == "writer"
            if writer and step is not None:  # its record hashed no checkpoint: the save's own sha256 file
                before = {
                    "attempts": (record.get("attempts") or [])[: i - 1],
                    "resumed_from": earlier.get("resumed_from"),
                }
                try:
                    problem = _written_mismatch(base, step, entry, known_hashes(base, before))
                except UserError as err:  # an attempt before it: its record is not the one linked
                    problem = str(err)
            elif iteration and wanted != entry.get("checkpoint_sha256"):
                problem = f"{rel}: does not vouch for the checkpoint of step {iteration} the attempt resumed from"
            elif iteration and entry.get("checkpoint_vouched_by", "record") != "record":  # absent: before the key
                problem = (
                    f"{rel}: its record holds the checkpoint's hash, yet the attempt says it was vouched for by "
                    f"{entry.get('checkpoint_vouched_by')!r}"
                )
            if problem is None and step is not None:  # either voucher: the checkpoint itself, where still there
                problem = _state_changed(base, step, entry)
        status = entry.get("status")
        line = (
            f"attempt {i}: {status}, resumed from step {entry.get('resumed_from_iteration')}; {rel} linked by sha256"
            + (" (its checkpoint vouched for by the sha256 file its save wrote)" if writer else "")
            if problem is None
            else f"attempt {i}: {problem}"
        )
        out.append({"attempt": i, "record": rel, "ok": problem is None, "line": line})
    return out


def check_image(image_path: Path, key) -> dict[str, Any]:
    """Verify an image's signed provenance with the public ``key``: the layout's referrers bind
    (:func:`trainer.image.referrers.bound`: each reads back, one per artifactType, one provenance), the
    signature, subject = the image's manifest digest, predicateType SLSA provenance; then every byproduct it
    names with a document media type (the SBOMs) is the referrer attached with that sha256, every attached
    referrer is named, and every layer it names (by diff_id) is one of the image's. Returns the statement;
    raises :class:`VerificationFailed` (exit 1, one line) for a layout that fails any of these and
    :class:`UserError` for one that cannot be read (a docker-archive, a corrupt image blob)."""

    image = open_image(Path(image_path))
    if image.index is None:
        raise UserError(f"{image_path}: a docker-archive cannot carry referrers; verify the OCI layout or oci-archive")
    try:
        attached = referrers.bound(image)
    except UserError as err:
        raise VerificationFailed(str(err)) from None
    kinds = [kind for kind in referrers.PROVENANCE_TYPES if kind in attached]
    if not kinds:
        raise VerificationFailed(
            f"{image_path}: no provenance referrer ({' or '.join(referrers.PROVENANCE_TYPES)}) is "
            f"attached to {image.manifest_digest}"
        )
    where = f"{image_path} provenance"
    statement = open_envelope(attached[kinds[0]].data, key, where)
    digests = [s["digest"].get("sha256") for s in statement["subject"]]
    if (image.manifest_digest or "")[7:] not in digests:  # an image without a manifest digest matches none
        raise VerificationFailed(
            f"{where}: subject sha256 {', '.join(map(str, digests))} is not this image's manifest "
            f"{image.manifest_digest}"
        )
    if statement.get("predicateType") != provenance.SLSA_PROVENANCE:
        raise VerificationFailed(
            f"{where}: predicateType {statement.get('predicateType')!r}, not {provenance.SLSA_PROVENANCE}"
        )
    byproducts = ((statement.get("predicate") or {}).get("runDetails") or {}).get("byproducts") or []
    if not isinstance(byproducts, list) or not all(isinstance(b, dict) for b in byproducts):
        raise VerificationFailed(f"{where}: runDetails.byproducts is not a list of resource descriptors")
    layers = {layer.diff_id[7:] for layer in image.layers}
    named = set()
    for item in byproducts:
        media, sha = item.get("mediaType"), (item.get("digest") or {}).get("sha256")
        if str(media).startswith(("application/vnd.oci.image.layer.", "application/vnd.docker.image.rootfs.")):
            if sha not in layers:  # the layers the build made, by diff_id (= digest: they are uncompressed)
                raise VerificationFailed(
                    f"{where}: the signed provenance names {item.get('name', 'a layer')} "
                    f"sha256 {sha}; the image {image.manifest_digest} has no such layer"
                )
            continue
        named.add(media)
        if media not in attached:
            raise VerificationFailed(f"{where}: the signed provenance names {media} sha256 {sha}; none is attached")
        if digest_of(attached[media].data)[7:] != sha:
            raise VerificationFailed(
                f"{where}: the attached {media} has sha256 {digest_of(attached[media].data)[7:]}, "
                f"the signed provenance names {sha}"
            )
    for media, found in attached.items():
        if media not in named and media not in referrers.PROVENANCE_TYPES:
            raise VerificationFailed(
                f"{where}: a {media} referrer {found.descriptor.get('digest')} (document sha256 "
                f"{digest_of(found.data)[7:]}) is attached; the signed provenance names none"
            )
    return statement
