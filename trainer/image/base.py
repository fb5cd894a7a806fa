"""``oci`` bases: seeding a registry image into the content-addressed cache, and reading it back for a build.

Builds never contact a registry. A user copies the base image once, on a machine that can reach the
registry, in a form that keeps the registry's bytes (so its manifest digest is unchanged)::

    skopeo copy docker://lmsysorg/sglang:v0.5.16@sha256:7b6a... dir:sglang-base          # any manifest type
    skopeo copy docker://REF@sha256:... oci-archive:base.tar   # or an OCI layout; only for images already in
                                                               # OCI format (skopeo converts Docker manifests)

and seeds the cache with ``trainer cache add-image SEED --lock L`` (:func:`add_image`): the manifest whose
sha256 is the lock's ``base.digest`` (for a multi-platform index, the index and the lock platform's
manifest), the config and every layer blob, each hashed while it is copied and refused on a mismatch;
gzip and uncompressed layers are also decompressed and checked against the config's ``rootfs.diff_ids``.

A docker-archive (``docker save``, ``skopeo copy ... docker-archive:``) is refused: it holds no registry
manifest and its layers are decompressed, so the manifest digest the lock pins cannot be checked.

The build (:func:`load_base`) re-hashes the manifest, config and every layer blob from the cache and
reuses the layer blobs unchanged (compressed layers stay compressed; their digests are fixed by the base).
Docker media types are written under their OCI names (same bytes): ``...docker.image.rootfs.diff.tar.gzip``
is ``application/vnd.oci.image.layer.v1.tar+gzip`` (OCI image-spec media-types.md, "Compatibility Matrix").
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, BinaryIO

from trainer.errors import UserError
from trainer.image.cas import CHUNK, Cache, _progress, parse_sha256
from trainer.image.tarread import member_name

MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
INDEX_TYPES = (MT_OCI_INDEX, MT_DOCKER_LIST)
MANIFEST_TYPES = (MT_OCI_MANIFEST, MT_DOCKER_MANIFEST)
# layer media type as written in our manifest (same bytes), and how its diff_id is computed from the blob
LAYER_TYPES: dict[str, tuple[str, str]] = {
    "application/vnd.oci.image.layer.v1.tar": ("application/vnd.oci.image.layer.v1.tar", "none"),
    "application/vnd.oci.image.layer.v1.tar+gzip": ("application/vnd.oci.image.layer.v1.tar+gzip", "gzip"),
    "application/vnd.oci.image.layer.v1.tar+zstd": ("application/vnd.oci.image.layer.v1.tar+zstd", "zstd"),
    "application/vnd.docker.image.rootfs.diff.tar": ("application/vnd.oci.image.layer.v1.tar", "none"),
    "application/vnd.docker.image.rootfs.diff.tar.gzip": ("application/vnd.oci.image.layer.v1.tar+gzip", "gzip"),
}
SEED_HINT = (
    "seed it on a machine with registry access: `skopeo copy docker://{ref} dir:base-image`, bring the "
    "directory here and run `trainer cache add-image base-image --lock {lock}`"
)


def _media_type(doc: dict[str, Any]) -> str:
    """A manifest's media type: its ``mediaType`` field, else an index when it lists ``manifests``."""
    if doc.get("mediaType"):
        return doc["mediaType"]
    return MT_OCI_INDEX if "manifests" in doc else MT_OCI_MANIFEST


def _parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as ex:
        raise UserError(f"{what}: not valid JSON ({ex})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{what}: expected a JSON object")
    return doc


def select_platform(index: dict[str, Any], os_name: str, architecture: str, what: str) -> dict[str, Any]:
    """The descriptor of ``index`` (an image index / Docker manifest list) for ``os_name``/``architecture``
    (the lock's ``platform``). Raises :class:`UserError` naming ``what`` and the platforms it has."""
    found = [
        d
        for d in index.get("manifests", [])
        if (d.get("platform") or {}).get("os") == os_name
        and (d.get("platform") or {}).get("architecture") == architecture
        and _media_type(d) in MANIFEST_TYPES
    ]
    if not found:
        have = sorted(
            {
                f"{(d.get('platform') or {}).get('os')}/{(d.get('platform') or {}).get('architecture')}"
                for d in index.get("manifests", [])
            }
        )
        raise UserError(f"{what}: the index has no {os_name}/{architecture} image (it has {', '.join(have) or 'none'})")
    return found[0]


class DiffIdHasher:
    """sha256 of a layer's uncompressed tar, fed the blob's bytes in order: the layer's diff_id
    (OCI image-spec config.md, "Layer DiffID"). ``compression``: "none", "gzip" (several members allowed,
    RFC 1952) or "zstd" (not decompressed here: :meth:`hexdigest` returns None)."""

    def __init__(self, compression: str) -> None:
        self.compression = compression
        self._hash = hashlib.sha256()
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if compression == "gzip" else None

    def feed(self, chunk: bytes) -> None:
        """Add the next ``chunk`` of the blob."""
        if self.compression == "none":
            self._hash.update(chunk)
        elif self._inflate is not None:
            while chunk:
                self._hash.update(self._inflate.decompress(chunk, CHUNK * 4))
                chunk = self._inflate.unconsumed_tail
                if self._inflate.eof:  # the next gzip member, unless only zero padding follows
                    chunk = self._inflate.unused_data + chunk
                    self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    if not chunk.strip(b"\0"):
                        break

    def hexdigest(self) -> str | None:
        """The diff_id's hex digits, or None when the compression is not decompressed here."""
        if self.compression == "zstd":
            return None
        if self._inflate is not None:
            self._hash.update(self._inflate.flush())
        return self._hash.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# seeds: where add-image reads a base from


class Seed:
    """A base image on disk, as a user brought it: ``top`` is [(digest or None, manifest bytes loader)]
    of the manifests the seed names at its top, ``manifest(digest)`` the bytes of another manifest (an
    index's child) or None, ``blob(digest)`` an open binary stream of a config or layer blob or None."""

    def __init__(
        self,
        path: Path,
        kind: str,
        top: Sequence[tuple[str | None, Callable[[], bytes | None]]],
        manifest: Callable[[str], bytes | None],
        blob: Callable[[str], IO[bytes] | None],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.path, self.kind, self.top, self.manifest, self.blob, self.close = path, kind, top, manifest, blob, close


def _open_file(path: Path) -> BinaryIO | None:
    try:
        return open(path, "rb")
    except (FileNotFoundError, IsADirectoryError):
        return None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


def open_seed(path: Path) -> Seed:
    """Open ``path``: an OCI layout directory, an oci-archive, or a ``dir:`` directory written by skopeo
    (``manifest.json``, blobs named by their hex digest). Raises :class:`UserError` for anything else,
    including a docker-archive (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        if (path / "oci-layout").is_file():
            index = _parse_json(_read(path / "index.json") or b"", f"{path}/index.json")

            def blob_path(digest: str) -> Path:
                return path / "blobs" / "sha256" / parse_sha256(digest, f"{path}: descriptor digest")

            def load_blob(digest: str) -> bytes | None:
                return _read(blob_path(digest))

            def load_listed(entry: dict[str, Any]) -> bytes | None:
                return load_blob(entry["digest"])

            top = [(d.get("digest"), partial(load_listed, d)) for d in index.get("manifests", [])]
            return Seed(path, "oci-layout", top, load_blob, lambda d: _open_file(blob_path(d)))
        if (path / "manifest.json").is_file():

            def dir_blob(d: str) -> BinaryIO | None:
                hexd = parse_sha256(d, f"{path}: descriptor digest")
                return _open_file(path / hexd) or _open_file(path / f"{hexd}.tar")

            return Seed(
                path,
                "dir",
                [(None, lambda: _read(path / "manifest.json"))],
                lambda d: _read(path / f"{parse_sha256(d, str(path))}.manifest.json"),
                dir_blob,
            )
        raise UserError(
            f"{path}: neither an OCI image layout (oci-layout, index.json) nor a skopeo dir: copy (manifest.json)"
        )
    if not path.is_file():
        raise UserError(
            f"{path}: no such file or directory (expected an OCI layout, an oci-archive or a skopeo dir: copy)"
        )
    try:
        tar = tarfile.open(path, mode="r:")
        members = {member_name(m.name): m for m in tar.getmembers() if m.isreg()}
    except tarfile.TarError as ex:
        raise UserError(f"{path}: not a tar archive ({ex})") from None
    if "oci-layout" not in members:
        tar.close()
        if "manifest.json" in members:
            raise UserError(
                f"{path}: a docker-archive has no registry manifest and decompressed layers, so the base's "
                "manifest digest cannot be checked; copy the image with `skopeo copy docker://REF@sha256:... "
                "dir:base-image` instead"
            )
        raise UserError(f"{path}: a tar without oci-layout (not an oci-archive)")

    def member(name: str) -> IO[bytes] | None:
        m = members.get(name)
        return tar.extractfile(m) if m is not None else None  # streams from the archive file

    def read(name: str) -> bytes | None:
        handle = member(name)
        return handle.read() if handle is not None else None

    index = _parse_json(read("index.json") or b"", f"{path}: index.json")

    def blob_name(digest: str) -> str:
        return f"blobs/sha256/{parse_sha256(digest, f'{path}: descriptor digest')}"

    def read_blob(digest: str) -> bytes | None:
        return read(blob_name(digest))

    def read_listed(entry: dict[str, Any]) -> bytes | None:
        return read_blob(entry["digest"])

    top = [(d.get("digest"), partial(read_listed, d)) for d in index.get("manifests", [])]
    return Seed(path, "oci-archive", top, read_blob, lambda d: member(blob_name(d)), tar.close)


def _stream_into_cache(
    cache: Cache,
    stream: IO[bytes],
    hexdigest: str,
    what: str,
    diff: DiffIdHasher | None = None,
    expected_size: int = 0,
    diff_id: str | None = None,
) -> int:
    """Copy ``stream`` into the cache, refusing it unless its sha256 is ``hexdigest`` (and, with ``diff``,
    its uncompressed sha256 is ``diff_id``); return its size in bytes."""
    tmp = cache.new_temp()
    bar = _progress(expected_size, f"adding {what}")
    try:
        digest, size = hashlib.sha256(), 0
        with open(tmp, "wb") as out:
            if bar:
                bar[0].start()
            try:
                while chunk := stream.read(CHUNK):
                    digest.update(chunk)
                    if diff is not None:
                        diff.feed(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    if bar:
                        bar[0].advance(bar[1], len(chunk))
            finally:
                if bar:
                    bar[0].stop()
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != hexdigest:
            raise UserError(
                f"{what}: sha256 {digest.hexdigest()} != sha256:{hexdigest} named by the manifest (not added)"
            )
        got = diff.hexdigest() if diff is not None else None
        if got is not None and diff_id is not None and "sha256:" + got != diff_id:
            raise UserError(f"{what}: uncompressed sha256:{got} != the config's diff_id {diff_id} (not added)")
        cache.commit(tmp, hexdigest)
        return size
    finally:
        tmp.unlink(missing_ok=True)


def add_image(
    cache: Cache,
    seed_path: Path,
    digest: str | None = None,
    platform: tuple[str, str] = ("linux", "amd64"),
    reference: str | None = None,
    console=None,
) -> dict[str, Any]:
    """Seed ``cache`` with the image at ``seed_path`` whose manifest digest is ``digest`` (``"sha256:<hex>"``;
    None: the seed's only image). An index is followed to the ``platform`` (os, architecture) manifest.

    Stores the manifest(s), the config and every layer blob, each checked by sha256 (gzip and uncompressed
    layers also against their diff_id) before it is renamed in; nothing unchecked enters the cache.
    Returns the lock's resolved ``base`` block: ``{"type": "oci", "reference", "digest", "config_digest",
    "layers": [{"digest", "mediaType", "size", "diff_id"}]}`` (``platform_manifest`` when ``digest`` is an
    index). Raises :class:`UserError` (one line) for a digest mismatch, a missing blob or a bad seed.
    """
    seed = open_seed(Path(seed_path))
    try:
        return _add_image(cache, seed, digest, platform, reference, console)
    finally:
        seed.close()


def _verified(data: bytes | None, want: str, what: str) -> bytes:
    if data is None:
        raise UserError(f"{what} {want} is not in the seed")
    have = "sha256:" + hashlib.sha256(data).hexdigest()
    if have != want:
        raise UserError(f"{what}: sha256 {have} != {want} (refused; nothing added)")
    return data


def _add_image(
    cache: Cache, seed: Seed, digest: str | None, platform: tuple[str, str], reference: str | None, console
) -> dict[str, Any]:
    where = str(seed.path)
    if digest is not None:
        parse_sha256(digest, "--digest")
    top: bytes | None = None
    if seed.kind == "dir":
        top = seed.top[0][1]()
        have = "sha256:" + hashlib.sha256(top or b"").hexdigest()
        if digest is not None and have != digest:
            child = seed.manifest(digest)
            raise UserError(
                f"{where}: manifest.json is {have}, not the base digest {digest}"
                + (
                    " (that digest is present only as a child manifest; lock the index's digest or copy by that digest)"
                    if child is not None
                    else " (if the lock's digest is a multi-platform index, copy with "
                    "`skopeo copy --multi-arch all ...`)"
                )
            )
        digest = have
    else:
        listed = [d for d, _ in seed.top]
        if digest is None:
            if len(listed) != 1:
                raise UserError(f"{where}: index.json lists {len(listed)} manifests; name one with --digest or --lock")
            digest = listed[0]
            if digest is None:
                raise UserError(f"{where}: index.json lists a manifest without a digest")
        matching = [load for d, load in seed.top if d == digest]
        if not matching:
            raise UserError(
                f"{where}: index.json does not list manifest {digest} "
                f"(it lists {', '.join(map(str, listed)) or 'none'}); "
                "skopeo converts Docker manifests when writing oci: or oci-archive:, which changes the digest - "
                "copy with `dir:` instead"
            )
        top = matching[0]()
    top = _verified(top, digest, f"{where}: manifest")
    doc = _parse_json(top, f"{where}: manifest {digest}")
    blobs: list[tuple[str, bytes]] = [(digest, top)]
    block: dict[str, Any] = {"type": "oci", "reference": reference or digest, "digest": digest}
    manifest_digest = digest
    if _media_type(doc) in INDEX_TYPES:
        desc = select_platform(doc, platform[0], platform[1], f"{where}: {digest}")
        manifest_digest = desc["digest"]
        data = _verified(
            seed.manifest(manifest_digest), manifest_digest, f"{where}: {platform[0]}/{platform[1]} manifest"
        )
        blobs.append((manifest_digest, data))
        doc = _parse_json(data, f"{where}: manifest {manifest_digest}")
        block["platform_manifest"] = manifest_digest
    if _media_type(doc) not in MANIFEST_TYPES:
        raise UserError(
            f"{where}: manifest {manifest_digest} has media type {_media_type(doc)!r} (expected an image manifest)"
        )
    cdesc = doc.get("config") or {}
    config_digest = str(cdesc.get("digest", ""))
    handle = seed.blob(config_digest)
    config_bytes = _verified(handle.read() if handle is not None else None, config_digest, f"{where}: config")
    config = _parse_json(config_bytes, f"{where}: config {config_digest}")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    layers = doc.get("layers") or []
    if len(diff_ids) != len(layers):
        raise UserError(f"{where}: manifest has {len(layers)} layers but the config {len(diff_ids)} rootfs.diff_ids")
    resolved = []
    for i, (layer, diff_id) in enumerate(zip(layers, diff_ids, strict=True)):
        mt = layer.get("mediaType", "")
        if mt not in LAYER_TYPES:
            raise UserError(f"{where}: layer {i} has media type {mt!r} (expected one of {', '.join(LAYER_TYPES)})")
        what = f"{where}: layer {i + 1}/{len(layers)} {layer['digest']}"
        hexd = parse_sha256(layer["digest"], what)
        if cache.get(hexd, what) is None:
            stream = seed.blob(layer["digest"])
            if stream is None:
                raise UserError(f"{what} is not in the seed")
            hasher = DiffIdHasher(LAYER_TYPES[mt][1])
            with stream:
                if console is not None:
                    console.print(
                        f"adding base layer {i + 1}/{len(layers)} {layer['digest']} ({layer.get('size', 0):,} bytes)",
                        soft_wrap=True,
                    )
                _stream_into_cache(cache, stream, hexd, what, hasher, int(layer.get("size", 0)), diff_id)
        resolved.append(
            {"digest": layer["digest"], "mediaType": mt, "size": int(layer.get("size", 0)), "diff_id": diff_id}
        )
    for _, data in blobs + [(config_digest, config_bytes)]:
        cache.add_bytes(data)
    block["config_digest"] = config_digest
    block["layers"] = resolved
    return block


# ---------------------------------------------------------------------------------------------------------
# build side


@dataclass
class BaseImage:
    """A verified base read from the cache: ``manifest_digest`` (the image manifest, after an index),
    ``config`` (parsed), and ``layers`` as dicts {"digest", "mediaType" (as written by us, OCI), "size",
    "diff_id", "path"}."""

    manifest_digest: str
    config: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)


def _missing(kind: str, digest: str, base: dict[str, Any], lock_name: str) -> UserError:
    return UserError(
        f"missing base image {kind} {digest} of {base['reference']} (builds do not contact a registry; "
        f"this base has not been seeded into the cache); " + SEED_HINT.format(ref=base["reference"], lock=lock_name)
    )


def load_base(cache: Cache, base: dict[str, Any], platform: dict[str, str], lock_name: str) -> BaseImage:
    """Read and verify the lock's ``oci`` ``base`` from ``cache``: manifest (index → the lock ``platform``'s
    manifest), config and every layer blob, each re-hashed in full; the lock's resolved fields
    (``platform_manifest``, ``config_digest``, ``layers``), when present, must agree.

    Raises :class:`UserError` with one line naming the missing or corrupt blob, its digest and how to seed
    the cache (``lock_name`` is put into that command).
    """
    ref = base["reference"]
    os_name, arch = platform.get("os", "linux"), platform.get("architecture", "amd64")

    def blob(digest: str, kind: str) -> Path:
        path = cache.get(parse_sha256(digest, f"base {kind} digest"), f"base image {kind} {digest} of {ref}")
        if path is None:
            raise _missing(kind, digest, base, lock_name)
        return path

    digest = base["digest"]
    doc = _parse_json(blob(digest, "manifest").read_bytes(), f"base manifest {digest}")
    if _media_type(doc) in INDEX_TYPES:
        digest = select_platform(doc, os_name, arch, f"base {ref}")["digest"]
        doc = _parse_json(blob(digest, f"{os_name}/{arch} manifest").read_bytes(), f"base manifest {digest}")
    if base.get("platform_manifest") not in (None, digest):
        raise UserError(f"base.platform_manifest: lock has {base['platform_manifest']}, the index names {digest}")
    if _media_type(doc) not in MANIFEST_TYPES:
        raise UserError(f"base manifest {digest}: media type {_media_type(doc)!r} (expected an image manifest)")
    config_digest = doc["config"]["digest"]
    if base.get("config_digest") not in (None, config_digest):
        raise UserError(f"base.config_digest: lock has {base['config_digest']}, the manifest names {config_digest}")
    config = _parse_json(blob(config_digest, "config").read_bytes(), f"base config {config_digest}")
    if (config.get("os"), config.get("architecture")) != (os_name, arch):
        raise UserError(
            f"base {ref}: the image is {config.get('os')}/{config.get('architecture')}, the lock's platform "
            f"{os_name}/{arch}"
        )
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    descs = doc.get("layers") or []
    if len(diff_ids) != len(descs):
        raise UserError(
            f"base manifest {digest}: {len(descs)} layers but its config has {len(diff_ids)} rootfs.diff_ids"
        )
    want = [
        {"digest": d["digest"], "mediaType": d.get("mediaType", ""), "size": int(d.get("size", 0)), "diff_id": i}
        for d, i in zip(descs, diff_ids, strict=True)
    ]
    if "layers" in base and base["layers"] != want:
        first = next(
            # lengths may differ (strict=False): the first difference is then at the shorter one's end
            (n for n, (a, b) in enumerate(zip(base["layers"], want, strict=False)) if a != b),
            min(len(want), len(base["layers"])),
        )
        raise UserError(
            f"base.layers[{first}]: the lock does not match the cached manifest {digest} "
            "(re-resolve the base block with `trainer cache add-image ... --json`)"
        )
    layers = []
    for n, item in enumerate(want):
        if item["mediaType"] not in LAYER_TYPES:
            raise UserError(f"base manifest {digest}: layer {n} has media type {item['mediaType']!r}")
        path = blob(item["digest"], f"layer {n + 1}/{len(want)}")
        if path.stat().st_size != item["size"]:
            raise UserError(
                f"base image layer {item['digest']}: {path.stat().st_size} bytes, the manifest says {item['size']}"
            )
        layers.append({**item, "mediaType": LAYER_TYPES[item["mediaType"]][0], "path": path})
    return BaseImage(digest, config, layers)
