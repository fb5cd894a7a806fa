"""An image as a squashfs file for pyxis/enroot (``srun --container-image=/path/IMAGE.sqsh``), made from the OCI layout.

pyxis takes ``--container-image`` as a registry reference or as the path of a squashfs file, which enroot
unpacks (``enroot create``) on each node. :func:`make_squashfs` makes that file from one manifest of an OCI
image layout, so a cluster without a registry runs the same image by digest:

1. the manifest blob must hash to ``digest`` and be named in the layout's ``index.json``
   (:func:`trainer.image.oci.find_tag`); ``umoci unpack`` then checks every layer blob against its digest
   while it unpacks the root file system into a temporary directory;
2. two files are written: :data:`STAMP` (``/etc/recipe-bundle/image.json``: ``{"digest", "squashfs_of"}``), so
   a process in the container can say which manifest its root file system was made from (the version probe
   reports it: :mod:`trainer.probe`), and ``/etc/environment``, the config's ``Env`` one ``NAME=value`` a line,
   which is where enroot takes a container's environment from (its own ``enroot import`` writes the same file
   from an image config: enroot ``src/docker.sh``, ``docker::configure``);
3. ``mksquashfs`` writes it with every owner root, every time and the file system's own time set to the image's
   ``created`` time (the lock's epoch), without extended attributes, ``-reproducible`` (squashfs-tools 4.5's
   default, stated): the same image gives the same bytes;
4. the file and its record ``IMAGE.sqsh.json`` (:data:`RECORD_SUFFIX`: ``{"digest", "sha256", "bytes",
   "tag", "layout"}``) are written beside the destination under temporary names and renamed into place, the
   record last: a reader that finds a record finds the complete file it describes.

:func:`checked_squashfs` is what a launcher runs before use: the file must hash to its record's ``sha256`` and
the record must name the digest the run was asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.oci import find_tag

STAMP = "etc/recipe-bundle/image.json"
RECORD_SUFFIX = ".json"
COMPRESSION = ("-comp", "zstd", "-Xcompression-level", "3")  # fast to make and to unpack on every node
CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """The sha256 (64 hex) of the file at ``path``, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def record_path(squashfs: Path) -> Path:
    """Where the record of ``squashfs`` lives: ``IMAGE.sqsh.json`` beside it."""
    return squashfs.with_name(squashfs.name + RECORD_SUFFIX)


def _config(layout: Path, manifest_hex: str) -> tuple[int, list[str]]:
    """The image config's ``created`` time (seconds since 1970: the lock's epoch for the bundle's images; 0 when
    it has none) and its ``Env`` list. Raises :class:`UserError` for a config that is missing or not its digest."""
    from datetime import datetime

    blobs = layout / "blobs" / "sha256"
    try:
        manifest = json.loads((blobs / manifest_hex).read_bytes())
        config_hex = manifest["config"]["digest"].split(":", 1)[1]
        data = (blobs / config_hex).read_bytes()
        if hashlib.sha256(data).hexdigest() != config_hex:
            raise ValueError(f"config blob {config_hex[:12]} does not hash to its digest")
        config = json.loads(data)
        created = config.get("created")
        epoch = int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()) if created else 0
        env = [str(item) for item in (config.get("config") or {}).get("Env") or []]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as ex:
        raise UserError(f"{layout}: the image's config cannot be read ({ex})") from None
    return epoch, env


def make_squashfs(layout: Path, digest: str, out: Path, processors: int | None = None) -> dict[str, Any]:
    """Write image ``digest`` of the OCI layout ``layout`` as the squashfs file ``out`` and its record.

    Returns the record: ``{"digest", "sha256" (64 hex of the file), "bytes", "tag", "layout"}``. Raises
    :class:`UserError` (one line; nothing is left at ``out``) for a manifest that is missing, corrupt or
    untagged, a layer umoci refuses, a missing ``umoci``/``mksquashfs``, or a failed write."""
    layout, out = Path(layout), Path(out)
    for tool in ("umoci", "mksquashfs"):
        if shutil.which(tool) is None:
            raise UserError(
                f"{tool} not found (Debian: apt-get install {'umoci' if tool == 'umoci' else 'squashfs-tools'})"
            )
    tag = find_tag(layout, digest, "image")
    epoch, env = _config(layout, digest.split(":", 1)[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        bundle = work / "bundle"
        unpack = subprocess.run(
            [
                "umoci",
                "unpack",
                *(["--rootless"] if os.geteuid() != 0 else []),
                "--image",
                f"{layout}:{tag}",
                str(bundle),
            ],
            capture_output=True,
            text=True,
            timeout=3600,
            umask=0o022,  # directories umoci makes that no layer names get 0755 whatever the caller's umask
        )
        if unpack.returncode != 0:
            lines = [line for line in unpack.stderr.splitlines() if line.strip()]
            raise UserError(
                f"umoci unpack {layout}:{tag} failed: {lines[-1] if lines else f'exit {unpack.returncode}'}"
            )
        rootfs = bundle / "rootfs"
        stamp = rootfs / STAMP
        stamp.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(stamp.parent, 0o755)  # modes stated, not the caller's umask: the same image gives the same bytes
        stamp.write_text(json.dumps({"digest": digest, "squashfs_of": tag}, sort_keys=True) + "\n")
        os.chmod(stamp, 0o644)
        environment = rootfs / "etc" / "environment"
        if environment.is_symlink():
            environment.unlink()  # a link in an image must not aim the write elsewhere
        environment.write_text("".join(f"{line}\n" for line in env))
        os.chmod(environment, 0o644)
        image = work / "image.sqsh"
        argv = [
            "mksquashfs",
            str(rootfs),
            str(image),
            "-noappend",
            "-no-progress",
            "-quiet",
            "-reproducible",
            "-all-root",
            "-no-xattrs",
            "-mkfs-time",
            str(epoch),
            "-all-time",
            str(epoch),
            *COMPRESSION,
        ]
        if processors:
            argv += ["-processors", str(processors)]
        made = subprocess.run(argv, capture_output=True, text=True, timeout=3600, umask=0o022)
        if made.returncode != 0:
            lines = [line for line in (made.stderr or made.stdout).splitlines() if line.strip()]
            raise UserError(f"mksquashfs failed: {lines[-1] if lines else f'exit {made.returncode}'}")
        record = {
            "digest": digest,
            "sha256": sha256_file(image),
            "bytes": image.stat().st_size,
            "tag": tag,
            "layout": str(layout.resolve()),
        }
        (work / "record.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.chmod(image, 0o644)
        os.replace(image, out)
        os.replace(work / "record.json", record_path(out))
        return record
    except OSError as ex:
        raise UserError(f"{out}: cannot write the squashfs ({ex})") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def checked_squashfs(path: Path, digest: str, field: str = "launcher.image") -> dict[str, Any]:
    """The record of the squashfs file ``path`` after checking it: the record must exist and name ``digest``,
    and the file must hash to the record's ``sha256``. Raises :class:`UserError` naming ``field`` otherwise."""
    path = Path(path)
    try:
        record = json.loads(record_path(path).read_text())
    except (OSError, ValueError) as ex:
        raise UserError(
            f"{field} {path}: no readable record {record_path(path).name} beside it ({ex}); make the file with "
            "`trainer image squashfs LAYOUT --digest DIGEST --out FILE`"
        ) from None
    if not isinstance(record, dict) or record.get("digest") != digest:
        named = record.get("digest") if isinstance(record, dict) else None
        raise UserError(f"{field} {path}: its record says it was made from {named}, the run asks for {digest}")
    try:
        actual = sha256_file(path)
    except OSError as ex:
        raise UserError(f"{field} {path}: cannot read it ({ex})") from None
    if actual != record.get("sha256"):
        raise UserError(f"{field} {path}: sha256 {actual}, its record says {record.get('sha256')} (changed since made)")
    return record
