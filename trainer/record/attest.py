"""Signed attestations: offline key pairs, DSSE envelopes, the run attestation, and their verification.

Keys (``trainer keygen --out KEY``): ``KEY``, the private key as unencrypted PKCS#8 PEM (mode 0600), and
``KEY.pub``, the public key as SubjectPublicKeyInfo PEM; Ed25519 (default; its signatures are
deterministic, RFC 8032, so a signed provenance built twice is byte-identical) or ECDSA P-256 with SHA-256
(``--type ecdsa``; randomized signatures). The key id is securesystemslib's default (sha256 of the
canonical public key), which is also what ``in-toto-sign --verify -k KEY.pub`` computes.

Envelopes: DSSE v1 (github.com/secure-systems-lab/dsse, envelope.md, protocol.md: the signature is over
``PAE("application/vnd.in-toto+json", statement bytes)``), made and checked with securesystemslib's
``dsse.Envelope`` and ``CryptoSigner``; the payload is an in-toto Statement v1.

The run attestation (``attestation.json`` in a run directory, written at the end of every executed run):
an in-toto Statement v1 whose subjects are the files that say what the run did and the image it ran in::

    subject:   metrics.jsonl, config.yaml, the data manifest (data/rows/manifest.json, or the rows directory's
               manifest.json named by paths.prompt_data), and "oci-image" (the image's manifest digest) when
               the run happened inside a bundle image; names are paths relative to the run directory
               (absolute for a data manifest outside it), digests sha256
    predicateType: https://github.com/recipe-bundle/recipe-bundle/attestation/run/v1   (RUN_PREDICATE)
    predicate: {"run":   {"status", "reason", "launcher", "created_utc", "finished_utc", "host", "bundle"},
                "probes": {"ranks": [the probe of every rank, record.json's probe.ranks],
                           "nodes": {NODE: the probe of each node, probes/NODE.json}},
                "verify": {"lock": the lock verified against, "ok": bool, "rows": [trainer verify's rows]}}

With a signing key (``train ... --sign-key KEY``) the file is the DSSE envelope of that statement; without
one, the bare statement (``trainer attest RUN_DIR [--sign-key KEY]`` writes it for a run that ended outside
``train``, a Slurm job). ``trainer verify RUN_DIR --key KEY.pub`` checks the signature with the public key
and every file subject's sha256; ``trainer verify IMAGE --key KEY.pub`` checks an image's signed provenance
(subject = the image's manifest digest) and that its SBOM referrers are the byproducts it names.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from trainer import PROJECT_URL
from trainer.errors import UserError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
RUN_PREDICATE = f"{PROJECT_URL}/attestation/run/v1"
ATTESTATION = "attestation.json"
IMAGE_SUBJECT = "oci-image"
KEY_TYPES = ("ed25519", "ecdsa")


class VerificationFailed(UserError):
    """A signature or subject that does not verify: a negative answer (exit 1), one line."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------------------
# keys


def keygen(out: Path, key_type: str = "ed25519") -> Tuple[Path, Path, str]:
    """Write a new key pair: ``out`` (private, PKCS#8 PEM, 0600) and ``out.pub`` (SubjectPublicKeyInfo PEM).

    Returns (private path, public path, key id). Raises :class:`UserError` when either file exists (keys
    are never overwritten) or ``key_type`` is not ``ed25519`` / ``ecdsa`` (P-256)."""
    from cryptography.hazmat.primitives import serialization
    from securesystemslib.signer import CryptoSigner

    if key_type not in KEY_TYPES:
        raise UserError(f"--type {key_type!r}: expected one of {', '.join(KEY_TYPES)}")
    out = Path(out)
    pub = out.with_name(out.name + ".pub")
    for path in (out, pub):
        if path.exists() or path.is_symlink():
            raise UserError(f"{path}: exists (keys are never overwritten; choose another --out)")
    signer = CryptoSigner.generate_ed25519() if key_type == "ed25519" else CryptoSigner.generate_ecdsa()
    public_pem = signer._private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                serialization.PublicFormat.SubjectPublicKeyInfo)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_new(out, signer.private_bytes, 0o600)
    try:
        _write_new(pub, public_pem, 0o644)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out, pub, signer.public_key.keyid


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively with ``mode`` via a temporary name, so a reader never sees half a key."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # fails if path appeared meanwhile
    finally:
        tmp.unlink(missing_ok=True)


def load_signer(path: Path):
    """A securesystemslib ``CryptoSigner`` from the PKCS#8 PEM private key at ``path`` (Ed25519 or ECDSA
    P-256). Raises :class:`UserError` for a missing, encrypted or unsupported key."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"--sign-key {path}: no such file (make a key pair with `trainer keygen --out {path}`)") from None
    except IsADirectoryError:
        raise UserError(f"--sign-key {path}: is a directory, expected a PEM private key") from None
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as ex:
        raise UserError(f"--sign-key {path}: not an unencrypted PKCS#8 PEM private key ({ex})") from None
    if not (isinstance(key, ed25519.Ed25519PrivateKey) or
            (isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1")):
        raise UserError(f"--sign-key {path}: a {type(key).__name__}; expected Ed25519 or ECDSA P-256")
    return CryptoSigner(key)


def load_public_key(path: Path):
    """A securesystemslib ``SSlibKey`` from the SubjectPublicKeyInfo PEM at ``path``. Raises :class:`UserError`."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    from securesystemslib.signer import SSlibKey

    path = Path(path)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        raise UserError(f"--key {path}: no such file (the public key is KEY.pub, written by `trainer keygen`)") from None
    try:
        return SSlibKey.from_crypto(load_pem_public_key(data))
    except (ValueError, TypeError) as ex:
        raise UserError(f"--key {path}: not a PEM public key ({' '.join(str(ex).split())[:200]})") from None


# ---------------------------------------------------------------------------------------------------------
# envelopes


def sign(statement_bytes: bytes, signer) -> bytes:
    """The DSSE envelope (JSON bytes: sorted keys, two-space indent, final newline) of ``statement_bytes``
    signed by ``signer``."""
    from securesystemslib.dsse import Envelope

    envelope = Envelope(statement_bytes, PAYLOAD_TYPE, {})
    envelope.sign(signer)
    return (json.dumps(envelope.to_dict(), indent=2, sort_keys=True) + "\n").encode()


def _json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as ex:
        raise VerificationFailed(f"{where}: not valid JSON ({ex}); truncated or altered") from None


def parse_statement(payload: bytes, where: str) -> Dict[str, Any]:
    """An in-toto Statement v1 from ``payload``; raises :class:`VerificationFailed` when it is not one."""
    statement = _json(payload, where)
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise VerificationFailed(f"{where}: not an in-toto Statement v1 (_type {STATEMENT_TYPE})")
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects or not all(
            isinstance(s, dict) and isinstance(s.get("digest"), dict) and s.get("name") for s in subjects):
        raise VerificationFailed(f"{where}: statement subject: expected a non-empty list of {{name, digest}}")
    if not isinstance(statement.get("predicateType"), str):
        raise VerificationFailed(f"{where}: statement has no predicateType")
    return statement


def open_envelope(data: bytes, key, where: str) -> Dict[str, Any]:
    """Check the DSSE envelope ``data`` with the public ``key`` (securesystemslib ``Key``) and return its
    statement. Raises :class:`VerificationFailed` (one line) for an envelope that is malformed or
    truncated, not signed by ``key``, or whose signature does not verify (payload or signature altered)."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    doc = _json(data, where)
    if not isinstance(doc, dict) or "payload" not in doc or "signatures" not in doc:
        if isinstance(doc, dict) and doc.get("_type") == STATEMENT_TYPE:
            raise VerificationFailed(f"{where}: an unsigned statement (no DSSE envelope); sign it with --sign-key")
        raise VerificationFailed(f"{where}: not a DSSE envelope (payload, payloadType, signatures)")
    if doc.get("payloadType") != PAYLOAD_TYPE:
        raise VerificationFailed(f"{where}: payloadType {doc.get('payloadType')!r}, expected {PAYLOAD_TYPE!r}")
    try:
        envelope = Envelope.from_dict(doc)
    except (KeyError, ValueError, TypeError, binascii.Error) as ex:
        raise VerificationFailed(f"{where}: malformed DSSE envelope ({' '.join(str(ex).split())[:200]})") from None
    except Exception as ex:  # noqa: BLE001 - securesystemslib's FormatError and kin
        raise VerificationFailed(f"{where}: malformed DSSE envelope ({type(ex).__name__}: {ex})") from None
    if key.keyid not in envelope.signatures:
        ids = ", ".join(sorted(envelope.signatures)) or "none"
        raise VerificationFailed(f"{where}: signed by key id {ids}, not by the given key ({key.keyid})")
    try:
        envelope.verify([key], 1)
    except VerificationError:
        raise VerificationFailed(f"{where}: the signature by key {key.keyid} does not verify: the statement or "
                                 "its signature was altered after signing") from None
    return parse_statement(envelope.payload, f"{where} (payload)")


# ---------------------------------------------------------------------------------------------------------
# the run attestation


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def data_manifest(run_dir: Path) -> Optional[Path]:
    """The rows manifest the run trained on: ``data/rows/manifest.json`` in the run directory (rows built
    for the run), else ``paths.prompt_data``/manifest.json from its ``config.yaml``; None when neither exists."""
    local = run_dir / "data" / "rows" / "manifest.json"
    if local.is_file():
        return local
    try:
        import yaml

        from trainer.record.rundir import CONFIG

        cfg = yaml.safe_load((run_dir / CONFIG).read_text()) or {}
        rows = (cfg.get("paths") or {}).get("prompt_data")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(rows, str) and rows and "$" not in rows:
        path = Path(rows) if Path(rows).is_absolute() else run_dir / rows
        if (path / "manifest.json").is_file():
            return path / "manifest.json"
    return None


def _subject_name(run_dir: Path, path: Path) -> str:
    try:
        return path.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def run_probes(run_dir: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """What the probe saw: ``{"ranks": record.json's probe ranks, "nodes": {NODE: probes/NODE.json}}``."""
    probe = record.get("probe")
    ranks = probe.get("ranks", [probe]) if isinstance(probe, dict) else probe if isinstance(probe, list) else []
    nodes: Dict[str, Any] = {}
    for path in sorted((run_dir / "probes").glob("*.json")) if (run_dir / "probes").is_dir() else []:
        try:
            nodes[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            nodes[path.stem] = {"unreadable": True}
    return {"ranks": ranks, "nodes": nodes}


def run_statement(run_dir: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """The run attestation statement of ``run_dir`` (see the module docstring) from its files and ``record``."""
    from trainer.image.diff import record_image
    from trainer.record.rundir import CONFIG, METRICS
    from trainer.record.verify import verdict

    subjects = []
    files = [run_dir / METRICS, run_dir / CONFIG, data_manifest(run_dir)]
    for path in files:
        if path is not None and path.is_file():
            subjects.append({"name": _subject_name(run_dir, path), "digest": {"sha256": _sha256(path)}})
    image = record_image(record).get("digest")
    if isinstance(image, str) and image.startswith("sha256:"):
        subjects.append({"name": IMAGE_SUBJECT, "digest": {"sha256": image[7:]}})
    if not subjects:
        raise UserError(f"{run_dir}: nothing to attest (no metrics.jsonl, config.yaml or data manifest)")
    try:
        checked = verdict(record, None) if record.get("probe") else {"ok": None, "reason": "no probe"}
    except UserError as err:
        checked = {"ok": None, "reason": str(err)}
    run = {k: record.get(k) for k in ("status", "reason", "launcher", "created_utc", "finished_utc", "host", "bundle")
           if record.get(k) is not None}
    return {"_type": STATEMENT_TYPE, "subject": subjects, "predicateType": RUN_PREDICATE,
            "predicate": {"run": run, "probes": run_probes(run_dir, record), "verify": checked}}


def take_sign_key(argv: List[str]) -> Tuple[List[str], Any]:
    """``argv`` without ``--sign-key KEY`` / ``--sign-key=KEY`` (not a Hydra override), and the signer of that key
    (:func:`load_signer`) or None. Raises :class:`UserError` for a missing value or a key that cannot sign."""
    out, key, i = [], None, 0
    while i < len(argv):
        word = argv[i]
        if word == "--sign-key":
            if i + 1 >= len(argv):
                raise UserError("--sign-key: expected the path of a private key (`trainer keygen --out KEY`)")
            key, i = argv[i + 1], i + 2
            continue
        if word.startswith("--sign-key="):
            key = word.split("=", 1)[1]
        else:
            out.append(word)
        i += 1
    return out, (load_signer(Path(key)) if key is not None else None)


def attest_run(run_dir: Path, record: Dict[str, Any], signer=None) -> None:
    """Write the run's ``attestation.json`` (:func:`write_run_attestation`, signed by ``signer`` when given) and name
    it in ``record``; a failure to attest is recorded there, never fatal. The files under a guarded run directory
    are redacted first (:func:`trainer.redact.resweep`): the attestation hashes them as they stay."""
    from trainer.redact import resweep

    resweep(run_dir)
    try:
        record["attestation"] = write_run_attestation(run_dir, record, signer)
    except (UserError, OSError, ValueError) as err:
        record["attestation"] = {"error": " ".join(str(err).split())}


def write_run_attestation(run_dir: Path, record: Dict[str, Any], signer=None) -> Dict[str, Any]:
    """Write ``run_dir/attestation.json`` (the statement, or its DSSE envelope when ``signer`` is given),
    atomically; return ``{"path", "sha256", "signed_by"}`` for the run record."""
    from trainer.publish import atomic_write

    data = (json.dumps(run_statement(run_dir, record), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    if signer is not None:
        data = sign(data, signer)
    atomic_write(run_dir / ATTESTATION, data)
    return {"path": ATTESTATION, "sha256": hashlib.sha256(data).hexdigest(),
            "signed_by": signer.public_key.keyid if signer is not None else None}


def check_run(run_dir: Path, key) -> Dict[str, Any]:
    """Verify ``run_dir/attestation.json`` with the public ``key``: the signature, then every file subject's
    sha256 against the file now. Returns the statement; raises :class:`VerificationFailed` (one line)."""
    path = run_dir / ATTESTATION
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no attestation (runs write one when they end; this run predates it or did not end)") from None
    statement = open_envelope(data, key, str(path))
    if statement.get("predicateType") != RUN_PREDICATE:
        raise VerificationFailed(f"{path}: predicateType {statement.get('predicateType')!r}, expected {RUN_PREDICATE}")
    for subject in statement["subject"]:
        name, want = subject["name"], subject["digest"].get("sha256")
        if name == IMAGE_SUBJECT:
            continue
        target = Path(name) if Path(name).is_absolute() else run_dir / name
        if not target.is_file():
            raise VerificationFailed(f"{path}: subject {name} is missing ({target})")
        have = _sha256(target)
        if have != want:
            raise VerificationFailed(f"{path}: subject {name} has sha256 {have}, the attestation says {want} "
                                     "(the file changed after the run)")
    return statement


def check_image(image_path: Path, key) -> Dict[str, Any]:
    """Verify an image's signed provenance with the public ``key``: the signature, subject = the image's
    manifest digest, and each SBOM referrer's sha256 = the byproduct the provenance names. Returns the
    statement; raises :class:`VerificationFailed` / :class:`UserError` (one line)."""
    from trainer.image import provenance, referrers
    from trainer.image.oci import digest_of, open_image

    image = open_image(Path(image_path))
    if image.index is None:
        raise UserError(f"{image_path}: a docker-archive cannot carry referrers; verify the OCI layout or oci-archive")
    _, data = referrers.find(image, (referrers.MT_DSSE, provenance.INTOTO_MEDIA_TYPE), provenance.SLSA_PROVENANCE)
    where = f"{image_path} provenance"
    statement = open_envelope(data, key, where)
    digests = [s["digest"].get("sha256") for s in statement["subject"]]
    if image.manifest_digest[7:] not in digests:
        raise VerificationFailed(f"{where}: subject sha256 {', '.join(map(str, digests))} is not this image's manifest "
                                 f"{image.manifest_digest}")
    attached = {}
    for descriptor in referrers.listed(image):
        if descriptor["artifactType"] in (referrers.MT_DSSE, provenance.INTOTO_MEDIA_TYPE):
            continue
        _, doc = referrers.read(image, descriptor)
        attached[descriptor["artifactType"]] = digest_of(doc)[7:]
    for item in statement["predicate"].get("runDetails", {}).get("byproducts", []):
        media = item.get("mediaType")
        if media in attached and attached[media] != item.get("digest", {}).get("sha256"):
            raise VerificationFailed(f"{where}: the attached {media} has sha256 {attached[media]}, the signed provenance "
                                     f"names {item['digest'].get('sha256')}")
    return statement


def main(argv: List[str]) -> int:
    """``trainer attest RUN_DIR [--sign-key KEY]``: write the attestation of a run that ended outside ``train``
    (a Slurm job: after ``trainer status --wait``); refuses a run that has not ended or already has one."""
    import argparse

    from trainer.record.record import effective_status
    from trainer.record.rundir import FINAL, RunDir

    parser = argparse.ArgumentParser(prog="trainer attest", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sign-key", type=Path, help="private key (`trainer keygen`): write a signed DSSE envelope")
    args = parser.parse_args(argv)
    signer = load_signer(args.sign_key) if args.sign_key else None
    rundir = RunDir(args.run_dir)
    record = rundir.load_record()
    if record is None:
        raise UserError(f"{args.run_dir / 'record.json'}: no run record (is {args.run_dir} a run directory?)")
    status = effective_status(record)
    if status not in FINAL:
        raise UserError(f"{args.run_dir}: status {status!r}; a run is attested once it has ended (`trainer status --wait`)")
    if (args.run_dir / ATTESTATION).exists():
        raise UserError(f"{args.run_dir / ATTESTATION}: exists (an attestation is written once)")
    record["attestation"] = write_run_attestation(args.run_dir, record, signer)
    rundir.save_record(record)
    print(f"{args.run_dir / ATTESTATION}: " + (f"signed by {signer.public_key.keyid}" if signer else "unsigned"))
    return 0
