"""Installing wheels into layer entries with PyPA ``installer`` (no .pyc compilation, nothing touches the host).

:class:`LayerDestination` is an ``installer`` destination that turns every file it is given into a layer
:class:`~trainer.image.layer.Entry` at its path in the image, without reading it: a file of the wheel becomes
a lazy entry that opens the zip member when the layer is written (size from the zip, sha256 from the
wheel's RECORD, checked while the bytes stream into the layer), so a 500 MB torch wheel is inflated exactly
once and never held in memory. Generated files (console scripts, rewritten shebangs, RECORD, INSTALLER)
are small and kept in memory. Paths: ``purelib``/``platlib`` under the lock's ``site_packages``, ``scripts``
under ``PREFIX/bin`` (shebang = the lock's interpreter), ``data`` under ``PREFIX``, ``headers`` under
``PREFIX/include/pythonX.Y/<dist>`` (the posix_prefix scheme of sysconfig). ``installer`` writes RECORD
(with ``INSTALLER`` = "recipe-bundle"); no bytecode is compiled, so the layer depends on the wheel only.

Before installing, every zip member is checked: absolute names, ``..`` components, backslashes and
symlink entries are refused; every member must be listed in RECORD with a sha256 and size
(``installer``'s ``validate_record`` without contents), and the contents are checked against RECORD while
the layer is written (a mismatch aborts the layer: nothing is cached or written to the output).
"""

from __future__ import annotations

import base64
import io
import posixpath
import stat
import zipfile
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import BinaryIO

from installer import install
from installer.destinations import WheelDestination
from installer.records import Hash, RecordEntry, parse_record_file
from installer.scripts import Script
from installer.sources import WheelFile
from installer.utils import construct_record_file, copyfileobj_with_hashing, fix_shebang

from trainer.errors import UserError
from trainer.image.layer import FILE, Entry

SPOOL_BYTES = 4 << 20  # files larger than this are spooled to disk instead of held in memory


def check_wheel_members(path: Path, label: str) -> None:
    """Refuse a wheel zip whose members could land outside the install root. Raises :class:`UserError`."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError) as ex:
        raise UserError(f"{label}: not a readable wheel ({ex})") from None
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or ".." in parts or (len(name) > 1 and name[1] == ":"):
            raise UserError(f"{label}: zip member {name!r} has an absolute or '..' path (refused)")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise UserError(f"{label}: zip member {name!r} is a symlink (wheels may not contain links; refused)")


class LayerDestination(WheelDestination):
    """An ``installer`` destination collecting files as layer entries.

    ``schemes``: scheme name -> absolute directory in the image; ``interpreter``: the scripts' shebang;
    ``spool``: a directory for large files. After :func:`install_wheels`, :attr:`entries` maps image path ->
    (Entry, wheel label).
    """

    def __init__(self, schemes: dict[str, str], interpreter: str, spool: Path) -> None:
        self.schemes = schemes
        self.interpreter = interpreter
        self.spool = spool
        self.entries: dict[str, tuple[Entry, str]] = {}
        self.current = ""
        self.zipfile: zipfile.ZipFile | None = None
        self.record: dict[str, tuple[str, int]] = {}  # zip member -> (sha256 hex, size) from the wheel's RECORD
        self._count = 0

    def use_wheel(self, zf: zipfile.ZipFile, label: str) -> None:
        """Start installing the wheel open as ``zf``: read its RECORD's sha256 and sizes."""
        self.zipfile, self.current, self.record = zf, label, {}
        names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        if len(names) != 1:
            raise UserError(f"{label}: expected one *.dist-info/RECORD, found {len(names)}")
        for path, hash_str, size in parse_record_file(zf.read(names[0]).decode("utf-8").splitlines()):
            algorithm, _, value = (hash_str or "").partition("=")
            if algorithm == "sha256" and value and size:
                digest = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
                self.record[path] = (digest, int(size))

    def _image_path(self, scheme: str, path: str) -> str:
        full = posixpath.normpath(posixpath.join(self.schemes[scheme], path))
        if not full.startswith(self.schemes[scheme].rstrip("/") + "/"):
            raise UserError(f"{self.current}: {path!r} would be installed outside {self.schemes[scheme]} (refused)")
        return full

    def _add(self, image_path: str, entry: Entry) -> None:
        previous = self.entries.get(image_path)
        if previous is not None and previous[0].content_id() != entry.content_id():
            raise UserError(f"{self.current}: {image_path} is also installed, with different content, by {previous[1]}")
        self.entries[image_path] = (entry, self.current)

    def _store(self, image_path: str, stream: BinaryIO, executable: bool, record_path: str) -> RecordEntry:
        """Keep a generated (small) file: read it, hash it; large ones are spooled to disk."""
        buffer = io.BytesIO()
        digest, size = copyfileobj_with_hashing(stream, buffer, "sha256")
        data = buffer.getvalue()
        if size > SPOOL_BYTES:
            self._count += 1
            spooled = self.spool / f"{self._count:08d}"
            spooled.write_bytes(data)
            entry = Entry(image_path, FILE, source=spooled, executable=executable, sha256=_hex_of_record_hash(digest))
        else:
            entry = Entry(image_path, FILE, data=data, executable=executable)
        self._add(image_path, entry)
        return RecordEntry(record_path, Hash("sha256", digest), size)

    def _lazy(self, image_path: str, stream: BinaryIO, executable: bool, record_path: str) -> RecordEntry | None:
        """A lazy entry for a wheel member (not read now); None when RECORD gives no sha256 for it."""
        member = getattr(stream, "name", None)
        known = self.record.get(member) if member else None
        if known is None or self.zipfile is None or member is None:
            return None
        info = self.zipfile.getinfo(member)
        digest, size = known
        if info.file_size != size:
            raise UserError(f"{self.current}: {member} is {info.file_size} bytes, RECORD says {size} (refused)")
        entry = Entry(
            image_path,
            FILE,
            opener=partial(self.zipfile.open, member),
            length=size,
            sha256=digest,
            label=self.current,
            executable=executable,
        )
        self._add(image_path, entry)
        b64 = base64.urlsafe_b64encode(bytes.fromhex(digest)).rstrip(b"=").decode()
        return RecordEntry(record_path, Hash("sha256", b64), size)

    def write_file(self, scheme, path, stream, is_executable):  # installer API
        """``installer`` hook: add file ``path`` of ``scheme`` as a layer entry and return its RECORD entry.

        Scripts are read now, their shebang rewritten to the lock's interpreter; other wheel members become lazy
        entries (read when the layer is written) when RECORD gives their sha256, else they are read now. What is
        read now is kept in memory, or spooled to disk above :data:`SPOOL_BYTES` bytes. Raises :class:`UserError`
        for a path outside the scheme's directory, a size that disagrees with RECORD, or a path already installed
        with other content.
        """
        path = str(path)
        if scheme == "scripts":
            with fix_shebang(stream, self.interpreter) as fixed:
                return self._store(self._image_path(scheme, path), fixed, is_executable, path)
        image_path = self._image_path(scheme, path)
        return self._lazy(image_path, stream, is_executable, path) or self._store(
            image_path, stream, is_executable, path
        )

    def write_script(self, name, module, attr, section):  # installer API
        """``installer`` hook: add the console/GUI script ``name`` (calling ``module:attr``; ``section``: its
        entry-point group), generated for the lock's interpreter, under ``scripts`` as an executable entry.
        Returns its RECORD entry; raises :class:`UserError` as :meth:`write_file`.
        """
        script_name, data = Script(name, module, attr, section).generate(self.interpreter, "posix")
        return self._store(self._image_path("scripts", script_name), io.BytesIO(data), True, script_name)

    def finalize_installation(self, scheme, record_file_path, records):  # installer API
        """``installer`` hook: write the wheel's RECORD at ``record_file_path`` under ``scheme`` from ``records``
        ((scheme, RecordEntry) pairs; paths in other schemes made relative to ``scheme``'s directory).
        """
        base = self.schemes[scheme]

        def prefix(file_scheme: str):
            if file_scheme == scheme:
                return None
            return posixpath.relpath(self.schemes[file_scheme], base) + "/"

        with construct_record_file(list(records), prefix) as stream:
            self._store(self._image_path(scheme, record_file_path), stream, False, record_file_path)


def schemes_for(python: dict[str, str], dist: str) -> dict[str, str]:
    """The install scheme (sysconfig posix_prefix) of the lock's ``python`` block, for distribution ``dist``."""
    prefix = python["prefix"].rstrip("/")
    version = ".".join(python["version"].split(".")[:2])
    return {
        "purelib": python["site_packages"],
        "platlib": python["site_packages"],
        "scripts": f"{prefix}/bin",
        "data": prefix,
        "headers": f"{prefix}/include/python{version}/{dist}",
    }


def _hex_of_record_hash(b64: str) -> str:
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def install_wheels(
    wheels: Iterable[tuple[Path, str, str]], python: dict[str, str], spool: Path, handles: list[zipfile.ZipFile]
) -> list[Entry]:
    """Install ``wheels`` ((file, wheel file name, label) each, in order) for the lock's ``python`` block;
    return the layer entries. The file may have any name (a cache blob); the wheel file name gives the
    distribution and version. The wheels' zip files are opened and appended to ``handles``: most entries
    read from them when the layer is written, so the caller closes them afterwards. Raises
    :class:`UserError` naming the wheel for a refused or invalid wheel (contents that do not match RECORD
    are refused when the layer is written)."""
    destination = LayerDestination({}, python["interpreter"], spool)
    for path, filename, label in wheels:
        check_wheel_members(path, label)
        try:
            zf = zipfile.ZipFile(path)
            handles.append(zf)
            zf.filename = filename
            source = WheelFile(zf)
            destination.schemes = schemes_for(python, source.distribution)
            source.validate_record(validate_contents=False)
            destination.use_wheel(zf, label)
            install(source, destination, {"INSTALLER": b"recipe-bundle\n"})
        except UserError:
            raise
        except Exception as ex:  # installer raises ValueError/InvalidWheelSource/KeyError subclasses
            message = str(ex).splitlines()[0] if str(ex) else type(ex).__name__
            raise UserError(f"{label}: invalid wheel ({message})") from None
    return [entry for entry, _ in destination.entries.values()]
