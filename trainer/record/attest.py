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
one, the bare statement (``trainer attest RUN_DIR [--sign-key KEY]``, :mod:`trainer.record.attest_cli`, writes it
for a run that ended outside ``train``, a Slurm job). ``trainer verify RUN_DIR --key KEY.pub`` checks the signature
with the public key, that the directory holds exactly the files named (none added, removed, changed or made a link)
and the outside rows, and then computes its verdict from what was signed (:func:`check_run`,
:mod:`trainer.record.verify_cli`); ``trainer verify IMAGE --key KEY.pub`` checks an image's signed provenance
(subject = the image's manifest digest) and that its SBOM referrers are the byproducts it names.

In :mod:`trainer.record`, this module sits above the verdict it signs (:mod:`trainer.record.verify`) and the file
names (:mod:`trainer.record.names`), and below the run directory that writes it (:mod:`trainer.record.rundir`) and
the commands (:mod:`trainer.record.attest_cli`, :mod:`trainer.record.verify_cli`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import PROJECT_URL
from trainer.errors import UserError
from trainer.image.recorded import record_image
from trainer.inputs import (
    MAX_ATTESTATION_BYTES,
    MAX_TEXT_BYTES,
    line_blocks,
    open_regular,
    read_bytes,
    read_json,
    read_text,
    reading,
)
from trainer.publish import atomic_write
from trainer.record.names import ATTESTATION, CONFIG, METRICS, RECORD
from trainer.record.verify import RunVerdict, verdict
from trainer.redact import Redactor, redactor_for, scrub_data
from trainer.signing import STATEMENT_TYPE, VerificationFailed, load_signer, open_envelope, sign

RUN_PREDICATE = f"{PROJECT_URL}/attestation/run/v2"
UNSIGNED = (ATTESTATION,)  # the files of a run directory its attestation does not name: only itself
IMAGE_SUBJECT = "oci-image"


def _sha256(path: Path) -> str:
    """sha256 (hex) of the file ``path``, streamed; a FIFO or device is refused without blocking
    (:class:`UserError`)."""
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
    subjects = [{"name": name, "digest": {"sha256": _sha256(run_dir / name)}} for name in run_files(run_dir)]
    subjects += [{"name": str(path), "digest": {"sha256": _sha256(path)}} for path in external_rows(run_dir)]
    image = record_image(record).get("digest")
    if isinstance(image, str) and image.startswith("sha256:"):
        subjects.append({"name": IMAGE_SUBJECT, "digest": {"sha256": image[7:]}})
    if not subjects:
        raise UserError(f"{run_dir}: nothing to attest (an empty run directory)")
    try:
        checked: RunVerdict | dict[str, Any] = (
            verdict(record, None, run_dir) if record.get("probe") else {"ok": None, "reason": "no probe"}
        )
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


READ_BACK = (RECORD, METRICS)  # the subjects check_run keeps the bytes of
RECORD_NAME = READ_BACK[0]


def check_run(run_dir: Path, key) -> SignedRun:
    """Verify ``run_dir/attestation.json`` with the public ``key``: the signature, then that the run directory holds
    exactly the files the statement names (one added, removed, changed, or turned into a link fails; only
    ``attestation.json`` itself is unsigned) and that the outside rows it names are intact. Returns the
    :class:`SignedRun`; raises :class:`VerificationFailed` (one line)."""
    path = run_dir / ATTESTATION
    with reading(
        path, missing=f"{path}: no attestation (runs write one when they end; this run predates it or did not end)"
    ):
        data = read_bytes(path, "run attestation", MAX_ATTESTATION_BYTES)  # a FIFO refused, 64 MiB at most
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
