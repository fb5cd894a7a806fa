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
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.cas import Cache, hash_file
from trainer.image.oci import MT_LAYER, MT_MANIFEST, compact_json, digest_of
from trainer.inputs import read_bytes
from trainer.signing import STATEMENT_TYPE, VerificationFailed, load_public_key, open_envelope, sign

ARTIFACT_TYPE = "application/vnd.recipe-bundle.layer-cache-entry.v1"
PREDICATE_TYPE = "https://recipe-bundle.dev/layer-cache-entry/v1"
MT_EMPTY = "application/vnd.oci.empty.v1+json"
MT_DSSE = "application/vnd.dsse.envelope.v1+json"
EMPTY = b"{}"
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

    def _skopeo(self, args: list[str], what: str) -> None:
        if self.unreachable:
            raise Refused(f"{what}: skipped ({self.location} {self.unreachable} earlier in this command)")
        try:
            skopeo_copy(args, what, self.tls_verify, self.timeout)
        except Refused as err:
            if "no answer from" in str(err):
                self.unreachable = "did not answer"
            elif "pinging container registry" in str(err) or "connection refused" in str(err):
                self.unreachable = "was unreachable"
            raise

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
                self._skopeo([f"oci:{work}:{ENTRY_TAG}", self.ref(key)], f"push of layer {layer}")
            else:
                root = Path(self.location)
                root.mkdir(parents=True, exist_ok=True)
                part = Path(tempfile.mkdtemp(prefix=f".part-{key[:16]}-", dir=root))
                try:
                    self._skopeo([f"oci:{work}:{ENTRY_TAG}", f"oci:{part}:{ENTRY_TAG}"], f"push of layer {layer}")
                    final = root / key
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(part, final)
                finally:
                    shutil.rmtree(part, ignore_errors=True)
            return digest
        finally:
            shutil.rmtree(work, ignore_errors=True)

    # pulling
    def fetch(self, cache: Cache, key: str, layer: str) -> dict[str, Any]:
        """Download, verify and add to ``cache`` the entry of key ``key`` (layer ``layer``); return the layer record
        now in the cache (``{"diff_id", "size", "layer"}``). Raises :class:`Refused` (one line) for an entry that
        is missing, unsigned, signed by no trusted key, made for another key, or whose bytes do not match."""
        what = f"layer {layer} (key {key[:16]}) from {self.location}"
        if not self.trusted:
            raise Refused(f"{what}: no trusted key configured (--trusted-key KEY.pub); not used")
        work = Path(tempfile.mkdtemp(prefix="spool-pull-", dir=cache.tmp_dir()))
        try:
            self._skopeo([self.ref(key), f"oci:{work}:{ENTRY_TAG}"], what)
            diff_id, size, blob = verify_entry(work, key, self.trusted, what)
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


def skopeo_copy(args: list[str], what: str, tls_verify: bool = True, timeout: float = DEFAULT_TIMEOUT) -> None:
    """``skopeo copy -q --preserve-digests ARGS`` (manifests and blobs byte for byte; skopeo checks each blob's
    digest as it copies), cut off after ``timeout`` seconds. Raises :class:`Refused` naming ``what`` with skopeo's
    last line when it fails or hangs."""
    if shutil.which("skopeo") is None:
        raise Refused(f"{what}: needs skopeo (Debian package skopeo)")
    tls = [] if tls_verify else ["--src-tls-verify=false", "--dest-tls-verify=false"]
    argv = ["skopeo", "--command-timeout", f"{max(1, int(timeout))}s", "copy", "-q", "--preserve-digests", *tls]
    try:
        proc = subprocess.run(
            argv + args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout + 10
        )
    except subprocess.TimeoutExpired:
        raise Refused(f"{what}: no answer from the remote within {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or [f"exit {proc.returncode}"]
        message = lines[-1].strip()
        if 'msg="' in message:
            message = message.split('msg="', 1)[1].rstrip('"').replace('\\"', '"')
        if "context deadline exceeded" in message or "timeout" in message.lower():
            message = f"no answer from the remote within {timeout:.0f} s ({message[-120:]})"
        raise Refused(f"{what}: {message[:300]}")


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
    (layout / "oci-layout").write_bytes(b'{"imageLayoutVersion":"1.0.0"}')
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
        data = read_bytes(layout / "blobs" / "sha256" / hexdigest, what, limit)
    except (OSError, UserError) as ex:
        raise Refused(f"{what}: {ex}") from None
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
    try:
        manifest = json.loads(_blob(layout, desc, f"{what}: manifest", MAX_MANIFEST_BYTES))
    except ValueError:
        raise Refused(f"{what}: the manifest is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("artifactType") != ARTIFACT_TYPE:
        raise Refused(f"{what}: not a layer cache entry (artifactType {ARTIFACT_TYPE})")
    layers = manifest.get("layers")
    if not isinstance(layers, list) or [d.get("mediaType") if isinstance(d, dict) else None for d in layers] != [
        MT_LAYER,
        MT_DSSE,
    ]:
        raise Refused(f"{what}: expected a layer tar and a DSSE envelope")
    tar, env_desc = layers
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
