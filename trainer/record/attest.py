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
an in-toto Statement v1 that names every file of the run directory, so that it vouches for the whole record::

    subject:   every regular file under the run directory but attestation.json itself (record.json, config.yaml,
               argv.json, env.json, job.json, plan.json, command.sh, metrics.jsonl, probes/, logs/, .hydra/, the
               rows data/rows/ built for the run, ...), by relative path; the rows a run read from outside it
               (paths.prompt_data: manifest.json and the files beside it), by absolute path; and "oci-image" (the
               image's manifest digest) when the run happened inside a bundle image; digests sha256
    predicateType: https://github.com/recipe-bundle/recipe-bundle/attestation/run/v2   (RUN_PREDICATE)
    predicate: {"run":   {"status", "reason", "launcher", "created_utc", "finished_utc", "host", "bundle", "steps"},
                "probes": {"ranks": [the probe of every rank, record.json's probe.ranks],
                           "nodes": {NODE: the probe of each node, probes/NODE.json}},
                "verify": {"lock": {"path", "base": "bundle" | "run" | "absolute", "sha256"}, "ok": bool,
                           "rows": [trainer verify's rows]},
                "unsigned": ["attestation.json"]}

A run directory is sealed in one order (:meth:`trainer.record.rundir.RunDir.seal`): the files others wrote are
scrubbed of secrets, ``record.json`` gets the sha256 of every other file and the attestation's path and key id,
and is saved; then the statement is made from the files as they stay and written. Nothing is written after it; a
later change (a Slurm job's late log) fails verification until the run is attested again.

With a signing key (``train ... --sign-key KEY``) the file is the DSSE envelope of that statement; without
one, the bare statement (``trainer attest RUN_DIR [--sign-key KEY]`` writes it for a run that ended outside
``train``, a Slurm job). ``trainer verify RUN_DIR --key KEY.pub`` checks the signature with the public key, that
the directory holds exactly the files named (none added, removed, changed or made a link) and the outside rows,
and then computes its verdict from what was signed (:func:`check_run`, :mod:`trainer.record.verify`);
``trainer verify IMAGE --key KEY.pub`` checks an image's signed provenance (subject = the image's manifest
digest) and that its SBOM referrers are the byproducts it names.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import PROJECT_URL
from trainer.errors import UserError
from trainer.inputs import (
    MAX_ATTESTATION_BYTES,
    MAX_KEY_BYTES,
    MAX_TEXT_BYTES,
    line_blocks,
    open_regular,
    read_bytes,
    read_json,
    read_text,
)

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
RUN_PREDICATE = f"{PROJECT_URL}/attestation/run/v2"
ATTESTATION = "attestation.json"
UNSIGNED = (ATTESTATION,)  # the files of a run directory its attestation does not name: only itself
IMAGE_SUBJECT = "oci-image"
KEY_TYPES = ("ed25519", "ecdsa")


class VerificationFailed(UserError):
    """A signature or subject that does not verify: a negative answer (exit 1), one line."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------------------
# keys


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
    try:
        with open_regular(path, "PEM private key", MAX_KEY_BYTES) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = handle.read(MAX_KEY_BYTES + 1)
    except FileNotFoundError:
        raise UserError(
            f"--sign-key {path}: no such file (make a key pair with `trainer keygen --out {path}`)"
        ) from None
    except UserError as err:
        text = str(err)
        raise UserError(text if text.startswith("--sign-key") else f"--sign-key {text}") from None
    except OSError as ex:
        raise UserError(f"--sign-key {path}: cannot read ({ex.strerror or ex})") from None
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
    try:
        data = read_bytes(path, "PEM public key", MAX_KEY_BYTES)  # a FIFO or device refused without blocking
    except FileNotFoundError:
        raise UserError(
            f"--key {path}: no such file (the public key is KEY.pub, written by `trainer keygen`)"
        ) from None
    except UserError as err:
        raise UserError(f"--key {err}") from None
    except OSError as ex:
        raise UserError(f"--key {path}: cannot read ({ex.strerror or ex})") from None
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


# ---------------------------------------------------------------------------------------------------------
# the run attestation


def _sha256(path: Path) -> str:
    """sha256 (hex) of the file ``path``, streamed; a FIFO or device is refused without blocking (:class:`UserError`)."""
    digest = hashlib.sha256()
    with open_regular(path, "file", None) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def data_manifest(run_dir: Path) -> Path | None:
    """The rows manifest the run trained on: ``data/rows/manifest.json`` in the run directory (rows built
    for the run), else ``paths.prompt_data``/manifest.json from its ``config.yaml``; None when neither exists."""
    local = run_dir / "data" / "rows" / "manifest.json"
    if local.is_file():
        return local
    try:
        import yaml

        from trainer.record.rundir import CONFIG

        cfg = yaml.safe_load(read_text(run_dir / CONFIG, "config.yaml")) or {}
        rows = (cfg.get("paths") or {}).get("prompt_data")
    except (OSError, ValueError, AttributeError, UserError):
        return None
    if isinstance(rows, str) and rows and "$" not in rows:
        path = Path(rows) if Path(rows).is_absolute() else run_dir / rows
        if (path / "manifest.json").is_file():
            return path / "manifest.json"
    return None


def walk(root: Path) -> tuple[list[str], list[str]]:
    """(the regular files under ``root``, every other entry that is not a directory: symbolic links, fifos,
    sockets, devices), each as a POSIX path relative to ``root``, sorted; links are not followed. Raises
    ``OSError`` for a directory that cannot be listed (``os.walk`` would skip it, and what it holds, silently)."""
    files: list[str] = []
    odd: list[str] = []

    def unreadable(err: OSError) -> None:
        raise err

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        base = Path(dirpath)
        for name in list(dirnames):
            if (base / name).is_symlink():
                dirnames.remove(name)
                odd.append((base / name).relative_to(root).as_posix())
        for name in filenames:
            path = base / name
            rel = path.relative_to(root).as_posix()
            (files if stat.S_ISREG(os.lstat(path).st_mode) else odd).append(rel)
    return sorted(files), sorted(odd)


def run_files(run_dir: Path) -> list[str]:
    """The files of ``run_dir`` its attestation names: every regular file under it but ``attestation.json``
    (:data:`UNSIGNED`), as relative POSIX paths, sorted. Raises :class:`UserError` for a symbolic link or another
    entry that is neither a file nor a directory: a signed run directory holds regular files only."""
    try:
        files, odd = walk(run_dir)
    except OSError as ex:
        raise UserError(
            f"{ex.filename}: cannot be read ({ex.strerror}); every file of a run directory is attested"
        ) from None
    if odd:
        raise UserError(
            f"{run_dir / odd[0]}: a symbolic link or special file; a run directory holds regular files only"
        )
    return [name for name in files if name not in UNSIGNED]


def external_rows(run_dir: Path) -> list[Path]:
    """The files of the rows directory a run read from outside its run directory (``paths.prompt_data``: its
    ``manifest.json`` and every regular file beside it, the parquet rows among them), absolute, sorted; [] when
    the rows are the run's own (``data/rows/``, named with the run directory's files) or there are none."""
    manifest = data_manifest(run_dir)
    if manifest is None:
        return []
    rows_dir = manifest.parent.resolve()
    try:
        rows_dir.relative_to(run_dir.resolve())
        return []
    except ValueError:
        pass
    try:
        files, _ = walk(rows_dir)
    except OSError as ex:
        raise UserError(f"{ex.filename}: cannot be read ({ex.strerror}); the rows a run read are attested") from None
    return [rows_dir / name for name in files]


def lock_subject(lock_path: Path, run_dir: Path) -> dict[str, Any]:
    """How a statement names the lock a run was verified against: ``{"path", "base", "sha256"}``, ``base``
    ``run`` (a path inside the run directory: an image's stamped lock), ``bundle`` (inside this bundle's tree,
    ``lockfiles/launcher.lock``) or ``absolute``. Raises :class:`UserError` when the lock cannot be read."""
    from trainer import REPO_ROOT

    try:
        digest = _sha256(lock_path)
    except OSError as ex:
        raise UserError(f"{lock_path}: lock not readable ({ex.strerror})") from None
    resolved = lock_path.resolve()
    for base, root in (("run", run_dir.resolve()), ("bundle", REPO_ROOT.resolve())):
        try:
            return {"path": resolved.relative_to(root).as_posix(), "base": base, "sha256": digest}
        except ValueError:
            continue
    return {"path": str(resolved), "base": "absolute", "sha256": digest}


def lock_path_of(lock: dict[str, Any], run_dir: Path) -> Path:
    """The file a statement's lock (:func:`lock_subject`) names, for the run directory ``run_dir``."""
    from trainer import REPO_ROOT

    root = {"run": run_dir, "bundle": REPO_ROOT}.get(str(lock.get("base")))
    return root / str(lock.get("path")) if root is not None else Path(str(lock.get("path")))


def run_probes(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """What the probe saw: ``{"ranks": record.json's probe ranks, "nodes": {NODE: probes/NODE.json}}``."""
    probe = record.get("probe")
    ranks = probe.get("ranks", [probe]) if isinstance(probe, dict) else probe if isinstance(probe, list) else []
    nodes: dict[str, Any] = {}
    for path in sorted((run_dir / "probes").glob("*.json")) if (run_dir / "probes").is_dir() else []:
        try:
            nodes[path.stem] = read_json(path, "probe")
        except (OSError, ValueError, UserError):
            nodes[path.stem] = {"unreadable": True}
    return {"ranks": ranks, "nodes": nodes}


def count_steps(data: bytes) -> int:
    """The number of steps in ``metrics.jsonl`` bytes: its non-empty lines."""
    return sum(1 for line in data.splitlines() if line.strip())


class StepCounter:
    """:func:`count_steps` over a stream of blocks (``feed``), in memory bounded by a block: lines end at ``\n``
    or ``\r``, and a line of only whitespace is no step."""

    def __init__(self) -> None:
        self.steps = 0
        self._partial = False  # the line the last block ended inside has a non-blank byte

    def feed(self, block: bytes) -> None:
        """Count the lines ``block`` completes."""
        pieces = block.replace(b"\r", b"\n").split(b"\n")
        for piece in pieces[:-1]:
            if self._partial or piece.strip():
                self.steps += 1
            self._partial = False
        self._partial = self._partial or bool(pieces[-1].strip())

    def total(self) -> int:
        """The steps, the last line counted also without a newline."""
        return self.steps + int(self._partial)


def count_steps_in(path: Path) -> int:
    """:func:`count_steps` of the file ``path``, streamed (bounded memory, and no time in the holes of a sparse file:
    :func:`trainer.inputs.line_blocks`; a FIFO refused without blocking)."""
    counter = StepCounter()
    with open_regular(path, "metrics.jsonl", None) as handle:
        for block in line_blocks(handle):
            counter.feed(block)
    return counter.total()


def hash_subject(path: Path, keep: int | None = None, count: bool = False) -> tuple[str, bytes | None, int]:
    """``(sha256 hex, the bytes when keep, steps when count)`` of the file ``path`` in one streamed pass, so that what
    is kept or counted is what was hashed. ``keep``: the most bytes kept (more is refused: :class:`UserError`);
    ``count``: count :func:`count_steps` on the way. A FIFO or device is refused without blocking."""
    digest, counter, kept, size = hashlib.sha256(), StepCounter(), [], 0
    with open_regular(path, "file", None) as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
            size += len(block)
            if count:
                counter.feed(block)
            if keep is not None:
                if size > keep:
                    raise UserError(f"{path}: more than the {keep:,} bytes this file may have")
                kept.append(block)
    return digest.hexdigest(), (b"".join(kept) if keep is not None else None), counter.total()


def run_statement(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The run attestation statement of ``run_dir`` (see the module docstring) from its files and ``record``
    (which must be saved as ``record.json`` already: it is one of the subjects). Raises :class:`UserError` when
    the directory holds a link or special file, or its lock cannot be read."""
    from trainer.image.diff import record_image
    from trainer.record.rundir import METRICS
    from trainer.record.verify import verdict

    subjects = [{"name": name, "digest": {"sha256": _sha256(run_dir / name)}} for name in run_files(run_dir)]
    subjects += [{"name": str(path), "digest": {"sha256": _sha256(path)}} for path in external_rows(run_dir)]
    image = record_image(record).get("digest")
    if isinstance(image, str) and image.startswith("sha256:"):
        subjects.append({"name": IMAGE_SUBJECT, "digest": {"sha256": image[7:]}})
    if not subjects:
        raise UserError(f"{run_dir}: nothing to attest (an empty run directory)")
    try:
        checked = verdict(record, None, run_dir) if record.get("probe") else {"ok": None, "reason": "no probe"}
    except UserError as err:
        checked = {"ok": None, "reason": str(err)}
    run = {
        k: record.get(k)
        for k in ("status", "reason", "launcher", "created_utc", "finished_utc", "host", "bundle")
        if record.get(k) is not None
    }
    metrics = run_dir / METRICS
    run["steps"] = count_steps_in(metrics) if metrics.is_file() else 0
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": RUN_PREDICATE,
        "predicate": {"run": run, "probes": run_probes(run_dir, record), "verify": checked, "unsigned": list(UNSIGNED)},
    }


def take_sign_key(argv: list[str]) -> tuple[list[str], Any]:
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


def write_run_attestation(run_dir: Path, record: dict[str, Any], signer=None) -> dict[str, Any]:
    """Write ``run_dir/attestation.json`` (the statement, or its DSSE envelope when ``signer`` is given),
    atomically, from the files as they are now (``record`` must be saved as ``record.json`` already: the sealing
    order is :meth:`trainer.record.rundir.RunDir.seal`'s). The statement passes through the run directory's
    redactor before it is signed, every string of it (:func:`trainer.redact.scrub_data`: the predicate's
    ``run.reason`` too; outside ``train``, the rule's patterns), so no secret reaches the signed payload either.
    Returns ``{"path", "sha256", "signed_by"}``."""
    from trainer.publish import atomic_write
    from trainer.redact import Redactor, redactor_for, scrub_data

    redactor = redactor_for(run_dir) or Redactor().freeze()
    statement = scrub_data(run_statement(run_dir, record), redactor)
    data = (json.dumps(statement, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    if signer is not None:
        data = sign(data, signer)
    atomic_write(run_dir / ATTESTATION, data, verbatim=True)  # scrubbed before signing: a DSSE "sig" stays as signed
    return {
        "path": ATTESTATION,
        "sha256": hashlib.sha256(data).hexdigest(),
        "signed_by": signer.public_key.keyid if signer is not None else None,
    }


@dataclass
class SignedRun:
    """A run directory whose attestation verified: the signed ``statement`` and the bytes of the files a verdict
    reads (``record.json``, ``metrics.jsonl`` where present), as they were hashed."""

    statement: dict[str, Any]
    files: dict[str, bytes]
    steps: int = 0  # the steps of metrics.jsonl as hashed (:func:`count_steps`), 0 without one

    @property
    def record(self) -> dict[str, Any]:
        """The signed ``record.json``, parsed."""
        return json.loads(self.files[RECORD_NAME])

    @property
    def predicate(self) -> dict[str, Any]:
        """The statement's predicate (run, probes, verify)."""
        return self.statement.get("predicate") or {}


READ_BACK = ("record.json", "metrics.jsonl")  # the subjects check_run keeps the bytes of
RECORD_NAME = READ_BACK[0]


def check_run(run_dir: Path, key) -> SignedRun:
    """Verify ``run_dir/attestation.json`` with the public ``key``: the signature, then that the run directory holds
    exactly the files the statement names (one added, removed, changed, or turned into a link fails; only
    ``attestation.json`` itself is unsigned) and that the outside rows it names are intact. Returns the
    :class:`SignedRun`; raises :class:`VerificationFailed` (one line)."""
    path = run_dir / ATTESTATION
    try:
        data = read_bytes(path, "run attestation", MAX_ATTESTATION_BYTES)  # a FIFO refused, 64 MiB at most
    except FileNotFoundError:
        raise UserError(
            f"{path}: no attestation (runs write one when they end; this run predates it or did not end)"
        ) from None
    statement = open_envelope(data, key, str(path))
    if statement.get("predicateType") != RUN_PREDICATE:
        raise VerificationFailed(
            f"{path}: predicateType {statement.get('predicateType')!r}, expected {RUN_PREDICATE} "
            "(an attestation of an older bundle names only some files; attest the run again)"
        )
    inside: dict[str, str] = {}
    outside: dict[str, str] = {}
    for subject in statement["subject"]:
        name, want = str(subject["name"]), subject["digest"].get("sha256")
        if name == IMAGE_SUBJECT:
            continue
        if Path(name).is_absolute():
            outside[name] = want
        elif name in UNSIGNED or ".." in Path(name).parts or name != Path(name).as_posix() or name in ("", "."):
            raise VerificationFailed(f"{path}: subject {name!r} is not a file path inside the run directory")
        else:
            inside[name] = want
    if RECORD_NAME not in inside:
        raise VerificationFailed(f"{path}: the statement does not name {RECORD_NAME}")
    try:
        files, odd = walk(run_dir)
    except OSError as ex:
        raise VerificationFailed(
            f"{path}: {ex.filename} cannot be read ({ex.strerror}); a run directory is verified "
            "only when every file in it can be read"
        ) from None
    if odd:
        raise VerificationFailed(
            f"{path}: {odd[0]} is a symbolic link or special file; the attestation names regular files only"
        )
    present = set(files) - set(UNSIGNED)
    added = sorted(present - set(inside))
    if added:
        raise VerificationFailed(
            f"{path}: {added[0]} is not named by the attestation (added after signing"
            + (f"; {len(added) - 1} more)" if len(added) > 1 else ")")
        )
    kept: dict[str, bytes] = {}
    steps = 0
    for name, want in sorted(inside.items()):
        target = run_dir / name
        if name not in present:
            raise VerificationFailed(f"{path}: subject {name} is missing ({target})")
        try:  # streamed: a run's checkpoint costs no memory; record.json kept (64 MiB at most), metrics counted
            have, content, counted = hash_subject(
                target, MAX_TEXT_BYTES if name == RECORD_NAME else None, count=name == READ_BACK[1]
            )
        except OSError as ex:
            raise VerificationFailed(f"{path}: subject {name} cannot be read ({ex.strerror})") from None
        except UserError as err:
            raise VerificationFailed(f"{path}: subject {err}") from None
        if have != want:
            raise VerificationFailed(
                f"{path}: subject {name} has sha256 {have}, the attestation says {want} "
                "(the file changed after the run; a late log is attested again with "
                "`trainer attest RUN_DIR --again --sign-key KEY`)"
            )
        if content is not None:
            kept[name] = content
        if name == READ_BACK[1]:
            steps = counted
    for rows_dir in sorted({Path(name).parent for name in outside if Path(name).name == "manifest.json"}):
        try:  # the outside rows directory holds exactly the files named: one added beside them fails too
            listed, odd = walk(rows_dir)
        except OSError as ex:
            raise VerificationFailed(f"{path}: {ex.filename} cannot be read ({ex.strerror})") from None
        extra = sorted(str(rows_dir / n) for n in listed + odd if str(rows_dir / n) not in outside)
        if extra:
            raise VerificationFailed(
                f"{path}: {extra[0]} is not named by the attestation (added to the rows after signing)"
            )
    for name, want in sorted(outside.items()):
        target = Path(name)
        if target.is_symlink() or not target.is_file():
            raise VerificationFailed(f"{path}: subject {name} is missing or not a regular file")
        try:
            have = _sha256(target)
        except OSError as ex:
            raise VerificationFailed(f"{path}: subject {name} cannot be read ({ex.strerror})") from None
        if have != want:
            raise VerificationFailed(
                f"{path}: subject {name} has sha256 {have}, the attestation says {want} "
                "(the rows changed after the run)"
            )
    try:
        record = json.loads(kept[RECORD_NAME])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise VerificationFailed(f"{path}: the signed {RECORD_NAME} is not valid JSON") from None
    if not isinstance(record, dict) or record.get("status") != (statement.get("predicate") or {}).get("run", {}).get(
        "status"
    ):
        raise VerificationFailed(f"{path}: the signed {RECORD_NAME} and the statement disagree on the run's status")
    return SignedRun(statement, kept, steps)


def check_image(image_path: Path, key) -> dict[str, Any]:
    """Verify an image's signed provenance with the public ``key``: the layout's referrers bind
    (:func:`trainer.image.referrers.bound`: each reads back, one per artifactType, one provenance), the
    signature, subject = the image's manifest digest, predicateType SLSA provenance; then every byproduct it
    names with a document media type (the SBOMs) is the referrer attached with that sha256, every attached
    referrer is named, and every layer it names (by diff_id) is one of the image's. Returns the statement;
    raises :class:`VerificationFailed` (exit 1, one line) for a layout that fails any of these and
    :class:`UserError` for one that cannot be read (a docker-archive, a corrupt image blob)."""
    from trainer.image import provenance, referrers
    from trainer.image.oci import digest_of, open_image

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
    if image.manifest_digest[7:] not in digests:
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


def main(argv: list[str]) -> int:
    """``trainer attest RUN_DIR [--sign-key KEY] [--again]``: write the attestation of a run that ended outside
    ``train`` (a Slurm job: after ``trainer status --wait``); refuses a run that has not ended, or one that has an
    attestation already unless ``--again`` (a file written after the seal, Slurm's last log lines: the record's
    hashes and the attestation are made anew from the files as they are now)."""
    import argparse

    from trainer.record.record import effective_status
    from trainer.record.rundir import FINAL, RunDir

    parser = argparse.ArgumentParser(prog="trainer attest", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sign-key", type=Path, help="private key (`trainer keygen`): write a signed DSSE envelope")
    parser.add_argument(
        "--again",
        action="store_true",
        help="replace an existing attestation (after a late log: "
        "what the files are now is what the new one vouches for)",
    )
    args = parser.parse_args(argv)
    signer = load_signer(args.sign_key) if args.sign_key else None
    rundir = RunDir(args.run_dir)
    record = rundir.load_record()
    if record is None:
        raise UserError(f"{args.run_dir / 'record.json'}: no run record (is {args.run_dir} a run directory?)")
    status = effective_status(record)
    if status not in FINAL:
        raise UserError(
            f"{args.run_dir}: status {status!r}; a run is attested once it has ended (`trainer status --wait`)"
        )
    if (args.run_dir / ATTESTATION).exists() and not args.again:
        raise UserError(
            f"{args.run_dir / ATTESTATION}: exists (an attestation is written once; --again replaces it "
            "with one of the files as they are now)"
        )
    record = rundir.seal(record, signer)
    if "error" in record["attestation"]:
        raise UserError(f"{args.run_dir}: not attested: {record['attestation']['error']}")
    print(f"{args.run_dir / ATTESTATION}: " + (f"signed by {signer.public_key.keyid}" if signer else "unsigned"))
    return 0
