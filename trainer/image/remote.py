"""A shared, signed binary cache of built layers (build-step outputs included): ``trainer cache push|pull`` and the
substituters ``trainer image build --substituter`` reads, as Nix reads its binary caches.

An entry is one OCI artifact per layer key (:func:`trainer.image.layerplan.layer_key`, the hash of the layer's
inputs): an image manifest (OCI image-spec v1.1, manifest.md "Guidelines for Artifact Usage") with
``artifactType`` :data:`ARTIFACT_TYPE`, the empty config, and two layers: the layer tar itself (its digest is its
diff_id: layers are uncompressed) and a DSSE envelope of an in-toto Statement v1 whose subject is that digest and
whose predicate names the key, the layer and its size, signed with a ``trainer keygen`` key.

Remotes, both moved by skopeo (``--preserve-digests``: manifests and blobs byte for byte):

- a registry, ``docker://HOST[:PORT]/REPOSITORY``: the entry of key K is the tag K (64 hex digits);
- a directory on a shared file system, any other path: the entry of key K is the OCI layout ``DIR/K/`` (tag
  ``entry``), written under a temporary name and renamed into place.

A pull trusts nothing it is served: the manifest, the envelope and the layer are re-hashed against their
descriptors, the envelope must verify under one of the trusted public keys, its statement must name the wanted
key and the layer's digest and size. Any failure is :class:`Refused` (one line); a substituter then builds the
layer locally. A remote that is down or hangs fails the same way, within ``timeout`` seconds per entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.cas import Cache, hash_file
from trainer.image.oci import MT_LAYER, MT_MANIFEST, OCI_LAYOUT, compact_json, digest_of
from trainer.image.referrers import EMPTY, MT_DSSE, MT_EMPTY
from trainer.inputs import read_bytes
from trainer.signing import STATEMENT_TYPE, VerificationFailed, load_public_key, open_envelope, sign

ARTIFACT_TYPE = "application/vnd.recipe-bundle.layer-cache-entry.v1"
PREDICATE_TYPE = "https://recipe-bundle.dev/layer-cache-entry/v1"
KEY_ANNOTATION = "dev.recipe-bundle.cache.key"
LAYER_ANNOTATION = "dev.recipe-bundle.cache.layer"
ENTRY_TAG = "entry"
MAX_ENVELOPE_BYTES = 64 << 10
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec lets registries refuse manifests above 4 MiB
DEFAULT_TIMEOUT = 900.0  # seconds per entry: a 2.9 GB layer at 10 MB/s fits


class Refused(UserError):
    """An entry a remote does not have, cannot serve, or serves untrusted or altered: one line (exit 1 from
    ``cache pull``; a substituter builds the layer locally instead)."""

    exit_code = 1


@dataclass
class Remote:
    """A binary cache at ``location`` (``docker://HOST/REPO`` or a directory), read and written with skopeo.

    ``trusted``: public keys (securesystemslib keys) an entry's signature must verify under to be used;
    ``tls_verify``: False for a plain-HTTP registry (a test registry on loopback); ``timeout``: seconds one entry's
    transfer may take (a hanging remote is cut off then)."""

    location: str
    trusted: list[Any] = field(default_factory=list)
    tls_verify: bool = True
    timeout: float = DEFAULT_TIMEOUT
    unreachable: str = ""  # set once the remote is down or hangs: later entries skip it, as Nix disables a cache

    @property
    def is_registry(self) -> bool:
        """Whether this remote is a registry (``docker://``) rather than a directory."""
        return self.location.startswith("docker://")

    def ref(self, key: str) -> str:
        """skopeo's reference of key ``key``'s entry (64 hex digits)."""
        if self.is_registry:
            return f"{self.location.rstrip('/')}:{key}"
        return f"oci:{Path(self.location) / key}:{ENTRY_TAG}"

    def _skopeo(self, args: list[str], what: str) -> bytes:
        """skopeo ``args`` (:func:`run_skopeo`) unless this remote was found down or hanging earlier; a failure
        that says so marks it (:attr:`unreachable`). Returns skopeo's stdout; raises :class:`Refused`."""
        if self.unreachable:
            raise Refused(f"{what}: skipped ({self.location} {self.unreachable} earlier in this command)")
        try:
            return run_skopeo(args, what, self.timeout)
        except Refused as err:
            if "no answer from" in str(err):
                self.unreachable = "did not answer"
            elif "pinging container registry" in str(err) or "connection refused" in str(err):
                self.unreachable = "was unreachable"
            raise

    def _copy(self, args: list[str], what: str) -> None:
        self._skopeo([*copy_argv(self.tls_verify), *args], what)

    def _manifest(self, key: str, what: str) -> bytes:
        """The entry's manifest bytes, read before anything else (``skopeo inspect --raw`` from a registry; the
        file from a directory, whose every file must be a regular one of the size its descriptor says), after
        :func:`check_manifest`. Raises :class:`Refused`."""
        if self.is_registry:
            tls = [] if self.tls_verify else ["--tls-verify=false"]
            data = self._skopeo(["inspect", "--raw", *tls, self.ref(key)], what)
            check_manifest(data, what)
            return data
        entry = Path(self.location) / key
        try:
            index = json.loads(read_bytes(entry / "index.json", "entry index", MAX_MANIFEST_BYTES))
            digest = str(index["manifests"][0]["digest"])
            data = read_bytes(entry / "blobs" / "sha256" / digest[7:], "entry manifest", MAX_MANIFEST_BYTES)
            manifest = check_manifest(data, what)
            sizes = {d["digest"][7:]: d["size"] for d in [manifest["config"], *manifest["layers"]]}
            sizes[digest[7:]] = len(data)
            for path in (entry / "blobs" / "sha256").iterdir():
                info = path.lstat()
                if not stat.S_ISREG(info.st_mode) or sizes.get(path.name, info.st_size) != info.st_size:
                    raise Refused(f"{what}: blob {path.name[:16]} is not a regular file of its descriptor's size")
        except FileNotFoundError:
            raise Refused(f"{what}: no entry {entry}") from None
        except (OSError, UserError, ValueError, RecursionError, KeyError, IndexError, TypeError) as ex:
            if isinstance(ex, Refused):
                raise
            raise Refused(f"{what}: no readable entry ({type(ex).__name__}: {str(ex)[:100]})") from None
        return data

    # pushing
    def push(self, cache: Cache, key: str, layer: str, signer: Any) -> str:
        """Upload the cached layer of key ``key`` (named ``layer``) as a signed entry; return its manifest digest.
        Raises :class:`UserError` when the local cache lacks an intact layer for ``key``, :class:`Refused` when the
        remote refuses the upload."""
        record = cache.layer_record(key)
        if record is None or cache.get(record["diff_id"][7:], f"layer {layer}", trust_stamp=True) is None:
            raise UserError(f"layer {layer} (key {key[:16]}): not in the local cache; build the image first")
        work = Path(tempfile.mkdtemp(prefix="spool-push-", dir=cache.tmp_dir()))
        try:
            digest = write_entry(work, cache, key, layer, record["diff_id"], int(record["size"]), signer)
            if self.is_registry:
                self._copy([f"oci:{work}:{ENTRY_TAG}", self.ref(key)], f"push of layer {layer}")
            else:
                try:
                    self._push_to_directory(work, key, layer)
                except OSError as ex:
                    raise Refused(f"push of layer {layer} to {self.location}: {ex}") from None
            return digest
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _push_to_directory(self, work: Path, key: str, layer: str) -> None:
        """Copy the entry layout ``work`` to ``DIR/<key>``: written as ``DIR/.part-*``, made readable by all (a
        shared file system; the umask applies), renamed into place; an entry already there is moved aside first
        and removed after, so a reader sees the old entry or the new one."""
        root = Path(self.location)
        root.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=f".part-{key[:16]}-", dir=root))
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(part, 0o777 & ~umask)
            self._copy([f"oci:{work}:{ENTRY_TAG}", f"oci:{part}:{ENTRY_TAG}"], f"push of layer {layer}")
            final = root / key
            old = None
            if final.is_symlink() or final.exists():
                old = root / f".old-{key[:16]}-{os.getpid()}"
                os.replace(final, old)
            os.replace(part, final)
            if old is not None:
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        finally:
            shutil.rmtree(part, ignore_errors=True)

    # pulling
    def fetch(self, cache: Cache, key: str, layer: str) -> dict[str, Any]:
        """Download, verify and add to ``cache`` the entry of key ``key`` (layer ``layer``); return the layer record
        now in the cache (``{"diff_id", "size", "layer"}``). Raises :class:`Refused` (one line) for an entry that
        is missing, unsigned, signed by no trusted key, made for another key, or whose bytes do not match."""
        what = f"layer {layer} (key {key[:16]}) from {self.location}"
        if not self.trusted:
            raise Refused(f"{what}: no trusted key configured (--trusted-key KEY.pub); not used")
        announced = self._manifest(key, what)  # its shape and sizes checked before any blob is fetched
        work = Path(tempfile.mkdtemp(prefix="spool-pull-", dir=cache.tmp_dir()))
        try:
            self._copy([self.ref(key), f"oci:{work}:{ENTRY_TAG}"], what)
            try:
                diff_id, size, blob = verify_entry(work, key, self.trusted, what)
            except (ValueError, RecursionError, OSError, KeyError, TypeError, AttributeError) as ex:
                raise Refused(f"{what}: a malformed entry ({type(ex).__name__}: {str(ex)[:100]})") from None
            if digest_of(announced) != _entry_manifest_digest(work):
                raise Refused(f"{what}: the manifest copied differs from the one first served")
            os.chmod(blob, 0o444)
            dest = cache.blob_path(diff_id[7:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(blob, dest)
            cache.stamp(diff_id[7:])
            record = {"diff_id": diff_id, "size": size, "layer": layer}
            cache.put_layer_record(key, record)
            return record
        finally:
            shutil.rmtree(work, ignore_errors=True)


def run_skopeo(args: list[str], what: str, timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """``skopeo --command-timeout T ARGS``, cut off after ``timeout`` seconds; returns its stdout (at most
    :data:`MAX_MANIFEST_BYTES` are kept). Raises :class:`Refused` naming ``what`` with skopeo's last line when it
    fails or hangs."""
    if shutil.which("skopeo") is None:
        raise Refused(f"{what}: needs skopeo (Debian package skopeo)")
    argv = ["skopeo", "--command-timeout", f"{max(1, int(timeout))}s", *args]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        raise Refused(f"{what}: no answer from the remote within {timeout:.0f} s") from None
    if proc.returncode != 0:
        text = proc.stderr.decode(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()] or [f"exit {proc.returncode}"]
        message = lines[-1].strip()
        if 'msg="' in message:
            message = message.split('msg="', 1)[1].rstrip('"').replace('\\"', '"')
        if "context deadline exceeded" in message or "timeout" in message.lower():
            message = f"no answer from the remote within {timeout:.0f} s ({message[-120:]})"
        raise Refused(f"{what}: {message[:300]}")
    return proc.stdout[:MAX_MANIFEST_BYTES]


def skopeo_copy(args: list[str], what: str, tls_verify: bool = True, timeout: float = DEFAULT_TIMEOUT) -> None:
    """``skopeo copy -q --preserve-digests ARGS`` (manifests and blobs byte for byte; skopeo checks each blob's
    digest as it copies): :func:`run_skopeo`."""
    run_skopeo([*copy_argv(tls_verify), *args], what, timeout)


def copy_argv(tls_verify: bool) -> list[str]:
    """skopeo's ``copy -q --preserve-digests`` arguments, with ``--src/--dest-tls-verify=false`` when
    ``tls_verify`` is off."""
    tls = [] if tls_verify else ["--src-tls-verify=false", "--dest-tls-verify=false"]
    return ["copy", "-q", "--preserve-digests", *tls]


def check_manifest(data: bytes, what: str) -> dict[str, Any]:
    """The entry manifest ``data`` parsed, when it has an entry's shape: :data:`ARTIFACT_TYPE`, the 2-byte empty
    config, a layer tar and a DSSE envelope of at most :data:`MAX_ENVELOPE_BYTES`. Checked before any blob is
    fetched, so that a remote cannot make a pull download more than the entry declares. Raises :class:`Refused`."""
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise Refused(f"{what}: the manifest is not JSON (or nested too deeply)") from None
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("artifactType") != ARTIFACT_TYPE:
        raise Refused(f"{what}: not a layer cache entry (artifactType {ARTIFACT_TYPE})")
    config = manifest.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != MT_EMPTY or config.get("size") != len(EMPTY):
        raise Refused(f"{what}: the config is not the empty descriptor")
    if not isinstance(layers, list) or [d.get("mediaType") if isinstance(d, dict) else None for d in layers] != [
        MT_LAYER,
        MT_DSSE,
    ]:
        raise Refused(f"{what}: expected a layer tar and a DSSE envelope")
    sizes = [d.get("size") for d in layers]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        raise Refused(f"{what}: a layer size that is not a byte count")
    if sizes[1] > MAX_ENVELOPE_BYTES:
        raise Refused(f"{what}: a signature envelope of {sizes[1]:,} bytes (at most {MAX_ENVELOPE_BYTES:,})")
    if not all(isinstance(d.get("digest"), str) for d in [config, *layers]):
        raise Refused(f"{what}: a descriptor without a digest")
    return manifest


def _entry_manifest_digest(layout: Path) -> str:
    """The manifest digest the index of the pulled entry ``layout`` names ("" when unreadable)."""
    try:
        return str(
            json.loads(read_bytes(layout / "index.json", "entry index", MAX_MANIFEST_BYTES))["manifests"][0]["digest"]
        )
    except (OSError, UserError, ValueError, RecursionError, KeyError, IndexError, TypeError):
        return ""


def statement(key: str, layer: str, diff_id: str, size: int) -> bytes:
    """The in-toto Statement v1 an entry's envelope signs (canonical JSON): subject = the layer blob's sha256,
    predicate = {"key", "layer", "size"}."""
    return compact_json(
        {
            "_type": STATEMENT_TYPE,
            "subject": [{"name": f"layer {layer}", "digest": {"sha256": diff_id[7:]}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {"key": key, "layer": layer, "size": size},
        }
    )


def _put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = digest_of(data)
    path = layout / "blobs" / "sha256" / digest[7:]
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def write_entry(layout: Path, cache: Cache, key: str, layer: str, diff_id: str, size: int, signer: Any) -> str:
    """Write the entry of ``key`` as an OCI layout at ``layout`` (an empty directory; the layer blob hard-linked
    from ``cache``), tagged :data:`ENTRY_TAG`; return the manifest digest."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_bytes(OCI_LAYOUT)
    cache.link_or_copy(diff_id[7:], layout / "blobs" / "sha256" / diff_id[7:])
    envelope = _put_blob(layout, sign(statement(key, layer, diff_id, size), signer))
    config = _put_blob(layout, EMPTY)
    manifest = compact_json(
        {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "artifactType": ARTIFACT_TYPE,
            "config": {"mediaType": MT_EMPTY, **config},
            "layers": [{"mediaType": MT_LAYER, "digest": diff_id, "size": size}, {"mediaType": MT_DSSE, **envelope}],
            "annotations": {KEY_ANNOTATION: key, LAYER_ANNOTATION: layer},
        }
    )
    desc = _put_blob(layout, manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": MT_MANIFEST,
                **desc,
                "artifactType": ARTIFACT_TYPE,
                "annotations": {"org.opencontainers.image.ref.name": ENTRY_TAG},
            }
        ],
    }
    (layout / "index.json").write_bytes(compact_json(index))
    return desc["digest"]


def _blob(layout: Path, desc: Any, what: str, limit: int) -> bytes:
    """The bytes of the small blob ``desc`` in ``layout``, checked against its digest and size."""
    if not isinstance(desc, dict) or not str(desc.get("digest", "")).startswith("sha256:"):
        raise Refused(f"{what}: a descriptor without a sha256 digest")
    hexdigest = desc["digest"][7:]
    if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise Refused(f"{what}: descriptor digest {desc['digest']!r} is not a sha256")
    try:
        data = read_bytes(layout / "blobs" / "sha256" / hexdigest, "entry blob", limit)
    except (OSError, UserError):
        raise Refused(f"{what}: blob {desc['digest'][:19]} unreadable or larger than {limit:,} bytes") from None
    if hashlib.sha256(data).hexdigest() != hexdigest or len(data) != desc.get("size"):
        raise Refused(f"{what}: blob {desc['digest'][:19]} does not match its descriptor (altered or truncated)")
    return data


def verify_entry(layout: Path, key: str, trusted: list[Any], what: str) -> tuple[str, int, Path]:
    """Check the pulled entry at ``layout`` for ``key`` (see the module docstring); return (diff_id, size bytes,
    path of the verified layer blob). Raises :class:`Refused`, one line naming what failed."""
    try:
        index = json.loads(read_bytes(layout / "index.json", f"{what}: index.json", MAX_MANIFEST_BYTES))
        desc = index["manifests"][0]
    except (OSError, UserError, ValueError, KeyError, IndexError, TypeError) as ex:
        raise Refused(f"{what}: no readable entry ({ex})") from None
    manifest = check_manifest(_blob(layout, desc, f"{what}: manifest", MAX_MANIFEST_BYTES), what)
    tar, env_desc = manifest["layers"]
    envelope = _blob(layout, env_desc, f"{what}: signature envelope", MAX_ENVELOPE_BYTES)
    stmt, errors = None, []
    for public in trusted:
        try:
            stmt = open_envelope(envelope, public, f"{what}: signature")
            break
        except VerificationFailed as err:
            errors.append(str(err).rsplit(": ", 1)[-1])
    if stmt is None:
        raise Refused(f"{what}: not signed by a trusted key ({'; '.join(errors)[:300]})")
    predicate = stmt.get("predicate") if stmt.get("predicateType") == PREDICATE_TYPE else None
    if not isinstance(predicate, dict) or predicate.get("key") != key:
        got = predicate.get("key") if isinstance(predicate, dict) else None
        raise Refused(f"{what}: the signed entry is for key {str(got)[:16]}, not {key[:16]} (another layer's inputs)")
    subject = stmt["subject"][0]["digest"].get("sha256")
    size = predicate.get("size")
    if f"sha256:{subject}" != tar.get("digest") or size != tar.get("size") or isinstance(size, bool):
        raise Refused(f"{what}: the manifest's layer {str(tar.get('digest'))[:19]} is not the one signed")
    blob = layout / "blobs" / "sha256" / str(subject)
    try:
        have = blob.stat().st_size
        actual = hash_file(blob, f"verifying layer {predicate.get('layer')}") if have == size else ""
    except (OSError, UserError) as ex:
        raise Refused(f"{what}: layer blob unreadable ({ex})") from None
    if have != size:
        raise Refused(f"{what}: layer blob has {have:,} bytes, the signed entry {size:,} (truncated)")
    if actual != subject:
        raise Refused(f"{what}: layer blob sha256 {actual[:16]} != signed {str(subject)[:16]} (altered)")
    return f"sha256:{subject}", int(size), blob


def load_trusted(paths: list[str]) -> list[Any]:
    """The public keys at ``paths`` (``trainer keygen``'s ``KEY.pub``). Raises :class:`UserError` for a bad one."""
    keys = []
    for path in paths:
        try:
            keys.append(load_public_key(Path(path)))
        except UserError as err:
            raise UserError(str(err).replace("--key ", "--trusted-key ", 1)) from None
    return keys


def add_remote_options(parser: Any) -> None:
    """The options every command that reads or writes a remote shares: ``--trusted-key`` (repeatable),
    ``--no-tls-verify``, ``--remote-timeout``."""
    parser.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="KEY.pub",
        help="a public key (`trainer keygen`) whose signed entries are used (repeatable; none: no entry is used)",
    )
    parser.add_argument(
        "--no-tls-verify",
        dest="tls_verify",
        action="store_false",
        help="plain HTTP / unverified TLS to the registry (a test registry on loopback)",
    )
    parser.add_argument(
        "--remote-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds one entry may take before the remote counts as hanging (default {DEFAULT_TIMEOUT:.0f})",
    )


def remotes_from(args: Any, locations: list[str]) -> tuple[Remote, ...]:
    """The :class:`Remote` of each of ``locations`` with the options of :func:`add_remote_options`. Raises
    :class:`UserError` for a bad key or timeout."""
    if not args.remote_timeout > 0:
        raise UserError(f"--remote-timeout {args.remote_timeout}: expected a positive number of seconds")
    for location in locations:
        if location.startswith("docker://") and (location.count("/") < 3 or "@" in location):
            raise UserError(f"remote {location!r}: expected docker://HOST[:PORT]/REPOSITORY")
    trusted = load_trusted(args.trusted_key)
    return tuple(Remote(loc, trusted, args.tls_verify, args.remote_timeout) for loc in locations)
