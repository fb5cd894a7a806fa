"""Signing: the offline key pairs (``trainer keygen``), DSSE envelopes of in-toto Statements v1, and their
verification; shared by the image's provenance (:mod:`trainer.image.referrers`, ``trainer image build
--sign-key``) and a run's attestation (:mod:`trainer.record.attest`). Keys are securesystemslib's
``CryptoSigner`` (private) and ``SSlibKey`` (public): Ed25519 or ECDSA P-256, PEM files.
"""

from __future__ import annotations

import binascii
import json
import os
import stat
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.inputs import MAX_KEY_BYTES, open_regular, read_bytes, reading

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
KEY_TYPES = ("ed25519", "ecdsa")


class VerificationFailed(UserError):
    """A signature or subject that does not verify: a negative answer (exit 1), one line."""

    exit_code = 1


def keygen(out: Path, key_type: str = "ed25519") -> tuple[Path, Path, str]:
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
    public_pem = signer._private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
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


def read_private_key(path: Path) -> tuple[bytes, int]:
    """``(bytes, st_mode)`` of the private key file ``path``: a regular file (a FIFO or device is refused without
    blocking) of at most :data:`~trainer.inputs.MAX_KEY_BYTES`. Raises :class:`UserError`, one line, naming
    ``--sign-key`` and the file: missing, a directory or special file, too large."""
    path = Path(path)
    with reading(
        path,
        missing=f"--sign-key {path}: no such file (make a key pair with `trainer keygen --out {path}`)",
        unreadable=f"--sign-key {path}: cannot read",
        prefix="--sign-key ",
    ):
        with open_regular(path, "PEM private key", MAX_KEY_BYTES) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = handle.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise UserError(f"--sign-key {path}: more than the {MAX_KEY_BYTES:,} bytes a PEM private key may have")
    return data, mode


def load_signer(path: Path):
    """A securesystemslib ``CryptoSigner`` from the PKCS#8 PEM private key at ``path`` (Ed25519 or ECDSA
    P-256; read by :func:`read_private_key`: a regular file of at most 16 KiB). Raises :class:`UserError` for a
    missing, special, oversized, encrypted or unsupported key, and for a key the group or others may read or write
    (mode 0600 or stricter, as ssh refuses one: "permissions 0644 for KEY are too open")."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    path = Path(path)
    data, mode = read_private_key(path)
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as ex:
        raise UserError(f"--sign-key {path}: not an unencrypted PKCS#8 PEM private key ({ex})") from None
    if not (
        isinstance(key, ed25519.Ed25519PrivateKey)
        or (isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1")
    ):
        raise UserError(f"--sign-key {path}: a {type(key).__name__}; expected Ed25519 or ECDSA P-256")
    if mode & 0o077:
        raise UserError(
            f"--sign-key {path}: permissions {stat.S_IMODE(mode):04o} for {path} are too open (a private "
            f"key must be readable by its owner only: chmod 600 {path}); nothing signed"
        )
    return CryptoSigner(key)


def load_public_key(path: Path):
    """A securesystemslib ``SSlibKey`` from the SubjectPublicKeyInfo PEM at ``path``. Raises :class:`UserError`."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    from securesystemslib.signer import SSlibKey

    path = Path(path)
    with reading(
        path,
        missing=f"--key {path}: no such file (the public key is KEY.pub, written by `trainer keygen`)",
        unreadable=f"--key {path}: cannot read",
        prefix="--key ",
    ):
        data = read_bytes(path, "PEM public key", MAX_KEY_BYTES)  # a FIFO or device refused without blocking
    try:
        return SSlibKey.from_crypto(load_pem_public_key(data))
    except (ValueError, TypeError) as ex:
        raise UserError(f"--key {path}: not a PEM public key ({' '.join(str(ex).split())[:200]})") from None


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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as ex:
        raise VerificationFailed(f"{where}: not valid JSON ({ex}); truncated or altered") from None


def parse_statement(payload: bytes, where: str) -> dict[str, Any]:
    """An in-toto Statement v1 from ``payload``; raises :class:`VerificationFailed` when it is not one."""
    statement = _json(payload, where)
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise VerificationFailed(f"{where}: not an in-toto Statement v1 (_type {STATEMENT_TYPE})")
    subjects = statement.get("subject")
    if (
        not isinstance(subjects, list)
        or not subjects
        or not all(isinstance(s, dict) and isinstance(s.get("digest"), dict) and s.get("name") for s in subjects)
    ):
        raise VerificationFailed(f"{where}: statement subject: expected a non-empty list of {{name, digest}}")
    if not isinstance(statement.get("predicateType"), str):
        raise VerificationFailed(f"{where}: statement has no predicateType")
    return statement


def open_envelope(data: bytes, key, where: str) -> dict[str, Any]:
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
        raise VerificationFailed(
            f"{where}: the signature by key {key.keyid} does not verify: the statement or "
            "its signature was altered after signing"
        ) from None
    return parse_statement(envelope.payload, f"{where} (payload)")
