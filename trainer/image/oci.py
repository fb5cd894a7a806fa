"""OCI image layouts: writing them atomically and deterministically, and reading layouts and archives back.

Written (OCI image-spec v1.1: image-layout.md, manifest.md, config.md)::

    DIR/oci-layout            {"imageLayoutVersion": "1.0.0"}
    DIR/index.json            the image manifest, annotated org.opencontainers.image.ref.name = "latest", then
                              its OCI 1.1 referrers (SBOMs, provenance) with their artifactType, unnamed
    DIR/blobs/sha256/<hex>    the manifest, the config and every layer (uncompressed tar: digest = diff_id),
                              the referrers' manifests and documents

JSON blobs are compact with sorted keys, so equal content gives equal digests. The layout is written into a
temporary sibling directory and renamed onto ``DIR`` (the old ``DIR`` is moved aside first and removed
after), so ``kill -9`` leaves either the old layout, the new one, or none, never a mixture. ``--archive``
writes an oci-archive: the layout as a tar made by :mod:`trainer.image.layer` (sorted, fixed headers).

Read: an OCI layout directory, an oci-archive (tar holding ``oci-layout``) or a docker-archive (tar holding
``manifest.json``, as ``skopeo copy ... docker-archive:`` writes); layers may be gzip-compressed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from trainer import inputs
from trainer.errors import UserError
from trainer.image.layer import DIR, FILE, Entry, write_layer
from trainer.image.tarread import member_name, member_stream, open_layer
from trainer.publish import atomic_file, fsync_dir, swap_dir

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'  # the oci-layout file (image-spec image-layout.md)
REF_NAME = "org.opencontainers.image.ref.name"


def find_tag(layout: Path, digest: str, what: str = "launcher.image") -> str:
    """The tag naming manifest ``digest`` in ``layout``'s index, after checking the manifest blob's sha256.

    Raises :class:`UserError` (one line, naming ``what``) when the blob is missing, does not hash to ``digest``,
    or is untagged.
    """
    hex_ = digest.split(":", 1)[1]
    blob = layout / "blobs" / "sha256" / hex_
    try:
        data = blob.read_bytes()
    except OSError:
        raise UserError(f"{what} {digest}: no such manifest blob in {layout}") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != hex_:
        raise UserError(f"{blob}: sha256 {actual} != {hex_} (the layout is corrupt)")
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, json.JSONDecodeError) as ex:
        raise UserError(f"{layout / 'index.json'}: not readable JSON ({ex})") from None
    for manifest in index.get("manifests", []):
        name = (manifest.get("annotations") or {}).get(REF_NAME)
        if manifest.get("digest") == digest and name:
            return name
    raise UserError(f"{what} {digest}: not named in {layout / 'index.json'} (no {REF_NAME} for it)")


def compact_json(obj: Any) -> bytes:
    """Compact JSON with sorted keys: the bytes of every JSON blob this module writes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest_of(data: bytes) -> str:
    """The OCI digest of ``data``: ``"sha256:" + hex`` (OCI image-spec descriptor.md, "Digests")."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def rfc3339(epoch: int) -> str:
    """``epoch`` seconds as "YYYY-MM-DDTHH:MM:SSZ" (UTC)."""
    return datetime.fromtimestamp(int(epoch), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Layer:
    """A layer blob: ``digest`` (= diff_id for our uncompressed layers), ``size`` bytes, ``path`` of the
    blob on disk, the ``name`` of its group and a ``comment`` for the history."""

    digest: str
    size: int
    path: Path
    name: str
    comment: str = ""
    media_type: str = MT_LAYER
    diff_id: str = ""


OCI_CONFIG_KEYS = (
    "User",
    "ExposedPorts",
    "Env",
    "Entrypoint",
    "Cmd",
    "Volumes",
    "WorkingDir",
    "Labels",
    "StopSignal",
    "ArgsEscaped",
    "Healthcheck",
    "Shell",
    "OnBuild",
)


def based_config(
    base: dict[str, Any],
    base_layer_count: int,
    layers: list[Layer],
    epoch: int,
    env: dict[str, str],
    entrypoint: list[str],
    cmd: list[str],
    labels: dict[str, str],
    working_dir: str,
    default_path: str,
) -> dict[str, Any]:
    """The config of our ``layers`` on top of the ``base`` image config (config.md); a base without a config of
    its own (scratch, a Debian rootfs: ``base_layer_count`` 0) is given as ``{"architecture", "os"}`` alone.

    ``rootfs.diff_ids``: the base's followed by ours; ``history``: the base's entries (synthesized, one per
    layer, when the base's non-empty entries do not match its ``base_layer_count`` layers) followed by one
    per layer of ours. ``config``: the base's OCI fields (``OCI_CONFIG_KEYS``, empty ones dropped) with
    ``Env`` = the base's Env updated by ``env`` (ours win; ``PATH`` stays the base's unless ``env`` sets it,
    ``default_path`` when neither has one), ``Entrypoint`` ours when given (then the base's ``Cmd`` is
    dropped, as a Dockerfile ENTRYPOINT does, unless ``cmd`` is given), ``Cmd`` ours when given,
    ``WorkingDir`` ours when given, ``Labels`` the base's updated by ``labels``. ``architecture``, ``os``
    and ``variant`` are the base's; ``created`` is ``epoch``.
    """
    created = rfc3339(epoch)
    inner = {
        k: v for k, v in (base.get("config") or {}).items() if k in OCI_CONFIG_KEYS and v not in (None, "", [], {})
    }
    merged: dict[str, str] = {}
    for item in inner.get("Env") or []:
        key, _, value = item.partition("=")
        merged[key] = value
    merged.setdefault("PATH", default_path)
    merged.update(env)
    inner["Env"] = [f"{k}={merged[k]}" for k in sorted(merged)]
    if entrypoint:
        inner["Entrypoint"] = list(entrypoint)
        inner.pop("Cmd", None)
    if cmd:
        inner["Cmd"] = list(cmd)
    if working_dir:
        inner["WorkingDir"] = working_dir
    inner["Labels"] = dict(sorted({**(inner.get("Labels") or {}), **labels}.items()))
    history = [h for h in base.get("history") or [] if isinstance(h, dict)]
    if sum(1 for h in history if not h.get("empty_layer")) != base_layer_count:
        history = [{"created_by": f"base layer {i + 1}/{base_layer_count}"} for i in range(base_layer_count)]
    config: dict[str, Any] = {"architecture": base.get("architecture"), "os": base.get("os")}
    for key in ("variant", "os.version", "os.features"):
        if base.get(key):
            config[key] = base[key]
    config.update(
        {
            "created": created,
            "config": dict(sorted(inner.items())),
            "rootfs": {
                "type": "layers",
                "diff_ids": list((base.get("rootfs") or {}).get("diff_ids") or [])
                + [layer.diff_id or layer.digest for layer in layers],
            },
            "history": history
            + [
                {"created": created, "created_by": f"recipe-bundle layer {layer.name}", "comment": layer.comment}
                for layer in layers
            ],
        }
    )
    return config


def image_manifest(config_bytes: bytes, layers: list[Layer], annotations: dict[str, str]) -> dict[str, Any]:
    """The image manifest (manifest.md) for ``config_bytes`` and ``layers``."""
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": digest_of(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in layers],
    }
    if annotations:
        manifest["annotations"] = dict(sorted(annotations.items()))
    return manifest


def write_layout(
    out: Path,
    config: dict[str, Any],
    layers: list[Layer],
    annotations: dict[str, str],
    place_blob: Callable[[Layer, Path], None],
    referrers: Callable[[dict[str, Any]], list[tuple[dict[str, Any], bytes, list[bytes]]]] | None = None,
) -> str:
    """Write the OCI layout of ``config`` and ``layers`` to ``out`` atomically; return the manifest digest.

    ``place_blob(layer, dest)`` puts the layer's bytes at ``dest`` (a hard link or copy from the cache).
    ``referrers(image_descriptor)`` returns the OCI 1.1 referrers to add (:func:`trainer.image.referrers.referrer`:
    index descriptor, manifest bytes, blobs); they are listed in index.json after the image.
    """
    config_bytes = compact_json(config)
    manifest_bytes = compact_json(image_manifest(config_bytes, layers, annotations))
    manifest_digest = digest_of(manifest_bytes)
    image_descriptor = {
        "mediaType": MT_MANIFEST,
        "digest": manifest_digest,
        "size": len(manifest_bytes),
        "annotations": {REF_NAME: "latest"},
    }
    attached = referrers(image_descriptor) if referrers is not None else []
    index = {
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [image_descriptor] + [descriptor for descriptor, _, _ in attached],
    }
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        blobs = tmp / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        for data in (config_bytes, manifest_bytes, *(b for _, m, extra in attached for b in (m, *extra))):
            (blobs / digest_of(data)[7:]).write_bytes(data)
        for layer in layers:
            dest = blobs / layer.digest[7:]
            if not dest.exists():
                place_blob(layer, dest)
        (tmp / "oci-layout").write_bytes(OCI_LAYOUT)
        (tmp / "index.json").write_bytes(compact_json(index))
        for path in (tmp, tmp / "blobs", blobs):
            os.chmod(path, 0o755)
        fsync_dir(blobs)
        fsync_dir(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest_digest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_siblings(out: Path) -> list[Path]:
    """Temporary siblings of ``out`` (``.OUT.tmp-<pid>-*``, ``.OUT.old-<pid>-*``) whose writing process is gone:
    what a killed ``image build`` left next to its output."""
    found = []
    for sibling in out.parent.glob(f".{out.name}.*"):
        kind, _, rest = sibling.name[len(out.name) + 2 :].partition("-")
        pid = rest.partition("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not _pid_alive(int(pid)):
            found.append(sibling)
    return sorted(found)


def remove_stale_siblings(out: Path) -> list[Path]:
    """Remove :func:`stale_siblings` of ``out``; return them."""
    removed = stale_siblings(out)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(
            missing_ok=True
        )
    return removed


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete ``tmp`` onto ``out`` (:func:`trainer.publish.swap_dir`) unless ``out`` is something
    other than an image layout."""
    if out.is_symlink() or out.is_file():
        raise UserError(f"{out}: exists and is not a directory (refusing to replace it with an image layout)")
    if out.exists() and not (out / "oci-layout").exists() and any(out.iterdir()):
        raise UserError(f"{out}: a non-empty directory that is not an OCI layout (refusing to replace it)")
    swap_dir(tmp, out)


def write_archive(layout: Path, archive: Path, epoch: int) -> str:
    """Write ``layout`` (an OCI layout directory) as an oci-archive tar at ``archive``, atomically and
    deterministically (entries sorted, mtime = ``epoch``); return the archive's sha256 digest."""
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(layout):
        rel_dir = os.path.relpath(dirpath, layout)
        for name in dirnames:
            entries.append(Entry(name if rel_dir == "." else f"{rel_dir}/{name}", DIR))
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            entries.append(Entry(rel, FILE, source=Path(dirpath) / name))
    archive = Path(os.path.abspath(archive))
    archive.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(archive)
    with atomic_file(archive, 0o644, umask_applies=False, prefix=f".{archive.name}.tmp-{os.getpid()}-") as handle:
        info = write_layer(entries, handle, epoch)
    return info.diff_id


# ---------------------------------------------------------------------------------------------------------
# reading


@dataclass
class LayerRef:
    """A layer of an image being read: its ``diff_id`` (from the config), blob ``digest`` and ``size``,
    ``media_type`` and ``history`` (created_by of the matching non-empty history entry)."""

    diff_id: str
    digest: str
    size: int
    media_type: str
    history: str
    open: Callable[[], BinaryIO] = field(repr=False)


@dataclass
class ImageRef:
    """An image read from disk. ``kind``: "oci-layout", "oci-archive" or "docker-archive";
    ``manifest_digest`` is None for a docker-archive (it has no OCI manifest)."""

    path: Path
    kind: str
    manifest_digest: str | None
    config_digest: str
    config: dict[str, Any]
    layers: list[LayerRef]
    index: dict[str, Any] | None = None  # an OCI layout's index.json (it also lists referrers)
    # digest -> bytes, sha256-checked (OCI only; anything but a "sha256:<hex>" string is refused)
    blob: Callable[[object], bytes] | None = field(default=None, repr=False)

    def files(self, layer: LayerRef) -> dict[str, dict[str, Any]]:
        """path -> {type, size, sha256, mode, target} for every member of ``layer`` (decompressed)."""
        out: dict[str, dict[str, Any]] = {}
        with layer.open() as raw:
            with open_layer(raw) as tar:
                for member in tar:
                    name = member_name(member.name)
                    item: dict[str, Any] = {"mode": oct(member.mode & 0o7777)}
                    if member.isreg():
                        digest = hashlib.sha256()
                        handle = member_stream(tar, member)
                        while chunk := handle.read(1 << 20):
                            digest.update(chunk)
                        item.update(type="file", size=member.size, sha256=digest.hexdigest())
                    elif member.isdir():
                        item.update(type="dir")
                    elif member.issym() or member.islnk():
                        item.update(type="symlink" if member.issym() else "hardlink", target=member.linkname)
                    else:
                        item.update(type="other")
                    out[name] = item
        return out

    def read_file(self, path: str) -> bytes | None:
        """The content of ``path`` in the image's merged filesystem (the top-most layer that has it)."""
        path = path.strip("/")
        for layer in reversed(self.layers):
            with layer.open() as raw:
                with open_layer(raw) as tar:
                    for member in tar:
                        if member_name(member.name) == path and member.isreg():
                            return inputs.read_member(tar, member, f"{self.path}: {path}", "file read from an image")
        return None


def _json(data: bytes, what: str) -> Any:
    return inputs.parse_json(inputs.decode(data, what, "JSON document"), what)  # bounded nesting, one line


def _history(config: dict[str, Any]) -> list[str]:
    return [h.get("created_by", "") for h in config.get("history", []) if not h.get("empty_layer")]


def open_image(path: Path) -> ImageRef:
    """Read the image at ``path`` (layout directory, oci-archive or docker-archive).

    Every blob is checked against its digest (manifest and config when read, every layer streamed once by
    :func:`verify_layers`), so ``image digest``/``diff``/``check`` never vouch for bytes they did not hash.
    Raises :class:`UserError` naming the file for anything else.
    """
    image = _open_image(Path(path))
    verify_layers(image)
    return image


def _open_image(path: Path) -> ImageRef:
    if path.is_dir():
        if not (path / "oci-layout").is_file():
            raise UserError(f"{path}: not an OCI image layout (no oci-layout file)")

        def reader(name: str) -> bytes | None:
            try:
                return inputs.read_bytes(path / name, "document of an image layout")  # a FIFO refused, 64 MiB at most
            except FileNotFoundError:
                return None

        def opener(name: str) -> Callable[[], BinaryIO]:
            return lambda: inputs.open_regular(path / name, "layer blob", None)  # a FIFO refused without blocking

        return _from_oci(path, "oci-layout", reader, opener)
    if not path.is_file():
        raise UserError(f"{path}: no such image (expected an OCI layout directory, an oci-archive or a docker-archive)")
    try:
        tar = tarfile.open(path, mode="r:")
        names = {member_name(m.name): m for m in tar.getmembers()}
    except tarfile.TarError as ex:
        raise UserError(f"{path}: not a tar archive ({ex})") from None

    def archive_reader(name: str) -> bytes | None:
        member = names.get(name)
        return (
            inputs.read_member(tar, member, f"{path}: {name}", "document of an image archive")
            if member is not None and member.isreg()
            else None
        )

    def archive_opener(name: str) -> Callable[[], BinaryIO]:
        def open_member() -> BinaryIO:
            member = names[name]
            handle = open(path, "rb")
            handle.seek(member.offset_data)
            # a bounded view: a layer is streamed, never held in memory
            return _Slice(handle, member.size)  # type: ignore[return-value]  # a RawIOBase file, not typing's IO

        return open_member

    if "oci-layout" in names:
        return _from_oci(path, "oci-archive", archive_reader, archive_opener)
    if "manifest.json" in names:
        return _from_docker(path, archive_reader, archive_opener)
    raise UserError(f"{path}: a tar without oci-layout or manifest.json (not an oci-archive or docker-archive)")


class _Slice(io.RawIOBase):
    """``size`` bytes of ``handle`` from its current offset, as a seekable read-only file (closes ``handle``)."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle, self.start, self.size, self.pos = handle, handle.tell(), size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(
            0, min(self.size, offset if whence == 0 else (self.pos + offset if whence == 1 else self.size + offset))
        )
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        self.handle.seek(self.start + self.pos)
        data = self.handle.read(want)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        self.handle.close()
        super().close()


def verify_layers(image: ImageRef) -> None:
    """Re-hash every layer blob of ``image`` (streamed) against its descriptor: digest and size for an OCI image,
    the config's diff_id for a docker-archive's uncompressed layers. Raises :class:`UserError` naming the layer."""
    for i, layer in enumerate(image.layers):
        want = layer.digest or layer.diff_id
        digest, size = hashlib.sha256(), 0
        with layer.open() as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        actual = f"sha256:{digest.hexdigest()}"
        if actual != want:
            raise UserError(f"{image.path}: layer {i} blob has {actual}, its descriptor says {want} (corrupt)")
        if layer.digest and size != layer.size:
            raise UserError(f"{image.path}: layer {i} blob is {size:,} bytes, its descriptor says {layer.size:,}")


def _checked_blob(reader, name: str, digest: str, where: Path) -> bytes:
    data = reader(name)
    if data is None:
        raise UserError(f"{where}: blob {digest} missing")
    if digest_of(data) != digest:
        raise UserError(f"{where}: blob {digest} has sha256 {digest_of(data)} (corrupt)")
    return data


def _from_oci(path: Path, kind: str, reader, opener) -> ImageRef:
    index_bytes = reader("index.json")
    if index_bytes is None:
        raise UserError(f"{path}: OCI layout without index.json")
    index = _json(index_bytes, f"{path}: index.json")
    manifests = index.get("manifests") or []
    if not manifests:
        raise UserError(f"{path}: index.json lists no manifests")
    images = [d for d in manifests if isinstance(d, dict) and not d.get("artifactType")]  # referrers come after
    desc = (images or manifests)[0]
    digest = desc["digest"]
    manifest = _json(_checked_blob(reader, f"blobs/sha256/{digest[7:]}", digest, path), f"{path}: manifest")
    cdigest = manifest["config"]["digest"]
    config = _json(_checked_blob(reader, f"blobs/sha256/{cdigest[7:]}", cdigest, path), f"{path}: config")
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    if len(diff_ids) != len(manifest.get("layers", [])):
        raise UserError(
            f"{path}: manifest has {len(manifest.get('layers', []))} layers but config {len(diff_ids)} diff_ids"
        )
    history = _history(config)
    layers = [
        LayerRef(
            diff_ids[i],
            d["digest"],
            d["size"],
            d.get("mediaType", MT_LAYER),
            history[i] if i < len(history) else "",
            opener(f"blobs/sha256/{d['digest'][7:]}"),
        )
        for i, d in enumerate(manifest.get("layers", []))
    ]

    def blob(d: object) -> bytes:
        if not isinstance(d, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", d):
            raise UserError(f"{path}: {d!r} is not a sha256 digest")
        return _checked_blob(reader, f"blobs/sha256/{d[7:]}", d, path)

    return ImageRef(path, kind, digest, cdigest, config, layers, index, blob)


def _from_docker(path: Path, reader, opener) -> ImageRef:
    manifest = _json(reader("manifest.json") or b"", f"{path}: manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise UserError(f"{path}: manifest.json lists no images")
    entry = manifest[0]
    config_bytes = reader(entry["Config"])
    if config_bytes is None:
        raise UserError(f"{path}: config {entry['Config']} missing")
    config = _json(config_bytes, f"{path}: config")
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    history = _history(config)
    layers = []
    for i, name in enumerate(entry.get("Layers", [])):
        try:
            with opener(name)() as handle:
                data_size = handle.seek(0, 2)
        except KeyError:
            raise UserError(f"{path}: layer {name} missing") from None
        layers.append(
            LayerRef(
                diff_ids[i] if i < len(diff_ids) else "",
                "",
                data_size,
                MT_LAYER,
                history[i] if i < len(history) else "",
                opener(name),
            )
        )
    return ImageRef(path, "docker-archive", None, digest_of(config_bytes), config, layers)
