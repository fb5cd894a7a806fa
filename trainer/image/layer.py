"""Deterministic OCI layers: a list of entries in, the same uncompressed tar bytes out, on any machine.

A layer is a POSIX tar (GNU format, so long names use ``././@LongLink`` records and no pax headers with
times or xattrs are written). Every header field that could vary between machines is fixed:

- entries sorted by path components (parents before children), every parent directory present;
- ``mtime`` = the lock's ``epoch`` (seconds since 1970, SOURCE_DATE_EPOCH style) for every entry;
- ``uid``/``gid`` 0, ``uname``/``gname`` empty, no device numbers, no xattrs, no hard links;
- modes normalized: files 0644 or 0755 (when any execute bit was set), directories 0755, symlinks 0777;
- only regular files, directories and symlinks (no devices, FIFOs or sockets).

Layers are stored uncompressed, so the layer's digest equals its ``diff_id`` (OCI image-spec,
config.md "rootfs.diff_ids": the sha256 of the uncompressed tar). The same idea as nix2container's tar
writer and nixpkgs' ``stream_layered_image.py``; the tar encoding itself is Python's :mod:`tarfile`.

Paths are refused (:class:`~trainer.errors.UserError`) when they contain ``..``, empty or NUL components,
or appear twice; symlink targets are refused when they are absolute (unless the caller allows that, as a
Debian rootfs needs) or when they resolve outside the layer's root.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, BinaryIO

from trainer.errors import UserError
from trainer.image.gittree import MAX_LINK_HOPS, SymlinkError, resolve_in_tree

FILE, DIR, SYMLINK = "file", "dir", "symlink"
TYPES = (FILE, DIR, SYMLINK)
CHUNK = 1 << 20  # bytes per read when streaming a file into a layer


@dataclass(frozen=True)
class Entry:
    """One filesystem entry of a layer.

    ``path``: POSIX path inside the image, relative or absolute ("usr/bin/x" and "/usr/bin/x" are the same).
    ``type``: "file", "dir" or "symlink". A file's content is exactly one of: ``data`` (bytes), the file at
    ``source`` (read when the layer is written; ``size`` is then taken from it), or ``opener`` (a callable
    returning a fresh binary stream, e.g. a wheel's zip member, read once when the layer is written) with its
    ``length`` in bytes. With ``sha256`` (hex) the streamed content is checked while it is written and a
    mismatch raises :class:`UserError` naming ``label``. ``executable`` picks mode 0755 over 0644; ``mode``
    (permission bits incl. setuid/setgid/sticky, e.g. 0o1777 for a Debian ``/tmp``) overrides the
    normalization when given (used for Debian packages, whose modes come from the pinned .deb).
    ``target``: a symlink's target.
    """

    path: str
    type: str = FILE
    data: bytes | None = None
    source: Path | None = None
    executable: bool = False
    target: str = ""
    mode_bits: int | None = None
    opener: Callable[[], IO[bytes]] | None = field(default=None, compare=False)
    length: int = 0
    sha256: str | None = None
    label: str = ""

    @property
    def mode(self) -> int:
        """The permission bits written to the tar header (normalized unless ``mode_bits`` is set)."""
        if self.mode_bits is not None:
            return self.mode_bits & 0o7777
        if self.type == DIR:
            return 0o755
        if self.type == SYMLINK:
            return 0o777
        return 0o755 if self.executable else 0o644

    def size(self) -> int:
        """Content size in bytes (0 for directories and symlinks)."""
        if self.type != FILE:
            return 0
        if self.data is not None:
            return len(self.data)
        if self.opener is not None:
            return self.length
        return self.source.stat().st_size if self.source is not None else 0

    def content_id(self) -> tuple[str, Any]:
        """What identifies this file's content without reading a stream: used to tell duplicates apart."""
        if self.data is not None:
            return ("sha256", hashlib.sha256(self.data).hexdigest())
        if self.sha256 is not None:
            return ("sha256", self.sha256)
        if self.source is not None:
            return ("source", str(self.source))
        return ("opener", id(self.opener))


@dataclass
class LayerInfo:
    """What writing a layer produced: ``diff_id`` ("sha256:<hex>" of the tar bytes), ``size`` (bytes),
    ``entries`` (tar members written, implicit parent directories included)."""

    diff_id: str
    size: int
    entries: int

    @property
    def hex(self) -> str:
        """``diff_id`` without its ``sha256:`` prefix (64 hex digits)."""
        return self.diff_id.split(":", 1)[1]


def normalize_path(path: str) -> str:
    """``path`` as a clean relative POSIX path ("./usr//bin/" -> "usr/bin").

    Raises :class:`UserError` for an empty path, a ``..`` component or a NUL byte.
    """
    if "\0" in path:
        raise UserError(f"layer entry {path!r}: NUL byte in path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts:
        raise UserError(f"layer entry {path!r}: empty path (the root itself is not an entry)")
    if ".." in parts:
        raise UserError(f"layer entry {path!r}: '..' in path (entries must stay inside the image root)")
    return "/".join(parts)


def check_symlink(path: str, target: str, allow_absolute: bool = False) -> None:
    """Refuse a symlink at ``path`` (normalized) whose ``target`` is absolute (unless ``allow_absolute``) or
    whose relative target resolves outside the root. Raises :class:`UserError`."""
    if not target or "\0" in target:
        raise UserError(f"layer entry {path!r}: empty or NUL symlink target")
    if target.startswith("/"):
        if not allow_absolute:
            raise UserError(f"layer entry {path!r}: absolute symlink target {target!r} refused")
        return
    # walk the target from the link's directory, counting depth below the root
    depth = len([p for p in posixpath.dirname(path).split("/") if p])
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise UserError(f"layer entry {path!r}: symlink target {target!r} escapes the image root")
        elif part not in ("", "."):
            depth += 1


def check_tree_symlinks(links: dict[str, str], allow_absolute: bool = False) -> None:
    """Resolve every symlink of a layer through all the others (:func:`trainer.image.gittree.resolve_in_tree`)
    before any is accepted. Raises :class:`UserError` naming the link for a chain that climbs above the root
    (``top/up -> ../../..`` plus ``top/esc -> up/../../../../etc/shadow``), an absolute target where the layer
    allows none, or a loop."""
    for path in sorted(links):
        try:
            resolve_in_tree(path, links, allow_absolute)
        except SymlinkError as err:
            what = {
                "outside": "escapes the image root (resolved through the tree's other links)",
                "absolute": f"resolves through {err.through or path!r}, an absolute symlink",
                "loop": f"more than {MAX_LINK_HOPS} symlinks in a chain (a loop?)",
            }[err.kind]
            raise UserError(f"layer entry {path!r}: symlink target {err.target!r} {what}") from None


def _sort_key(path: str) -> tuple[bytes, ...]:
    return tuple(p.encode("utf-8", "surrogateescape") for p in path.split("/"))


def plan_entries(entries: Iterable[Entry], allow_absolute_symlinks: bool = False) -> list[Entry]:
    """Validate and order ``entries``: normalized paths, implicit parent directories added, sorted.

    Raises :class:`UserError` on a bad path or symlink, an unknown type, a duplicate path, or a path
    under a non-directory.
    """
    by_path: dict[str, Entry] = {}
    for entry in entries:
        if entry.type not in TYPES:
            raise UserError(
                f"layer entry {entry.path!r}: type {entry.type!r} refused (expected one of {', '.join(TYPES)})"
            )
        path = normalize_path(entry.path)
        if entry.type == SYMLINK:
            check_symlink(path, entry.target, allow_absolute_symlinks)
        if entry.type == FILE and sum(x is not None for x in (entry.data, entry.source, entry.opener)) != 1:
            raise UserError(f"layer entry {path!r}: a file needs exactly one of data, source or opener")
        if path in by_path:
            if entry.type == DIR and by_path[path].type == DIR:
                continue
            raise UserError(f"layer entry {path!r}: path appears twice")
        by_path[path] = replace(entry, path=path)
    for path in list(by_path):
        parent = posixpath.dirname(path)
        while parent:
            existing = by_path.get(parent)
            if existing is None:
                by_path[parent] = Entry(parent, DIR)
            elif existing.type != DIR:
                raise UserError(f"layer entry {path!r}: parent {parent!r} is a {existing.type}, not a directory")
            else:
                break
            parent = posixpath.dirname(parent)
    # each link was checked alone above; now every link is resolved through all the others before any is accepted
    check_tree_symlinks(
        {p: e.target for p, e in by_path.items() if e.type == SYMLINK and e.target is not None}, allow_absolute_symlinks
    )
    return [by_path[p] for p in sorted(by_path, key=_sort_key)]


class HashingWriter(io.RawIOBase):
    """A write-only stream that sha256-hashes and counts what passes through to ``sink`` (or nowhere)."""

    def __init__(self, sink: BinaryIO | None = None, on_write: Callable[[int], None] | None = None) -> None:
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.on_write = on_write

    def writable(self) -> bool:
        """Always True (a write-only stream)."""
        return True

    def write(self, data) -> int:
        """Hash ``data`` (any bytes-like object), pass it to the sink, count it; returns its length in bytes."""
        view = memoryview(data)
        self.sha256.update(view)
        if self.sink is not None:
            self.sink.write(view)
        self.size += len(view)
        if self.on_write is not None:
            self.on_write(len(view))
        return len(view)

    def tell(self) -> int:
        """Bytes written so far (the stream position; ``tarfile`` reads it)."""
        return self.size


class PipelinedHashingWriter(HashingWriter):
    """A :class:`HashingWriter` whose hashing and writing run in a second thread, so that producing the bytes
    (inflating a wheel's zip members) and hashing/writing them overlap on two cores (zlib, hashlib and file
    writes release the GIL). Call :meth:`close` (or use it as a context manager) before reading ``sha256``;
    an error in the thread is raised there."""

    def __init__(
        self, sink: BinaryIO | None = None, on_write: Callable[[int], None] | None = None, depth: int = 64
    ) -> None:
        import queue
        import threading

        super().__init__(sink, on_write)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="layer-hash-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self._error is not None:
                continue
            try:
                self.sha256.update(data)
                if self.sink is not None:
                    self.sink.write(data)
            except BaseException as ex:  # surfaced in close()
                self._error = ex

    def write(self, data) -> int:
        """Queue a copy of ``data`` for the hashing thread (blocks while the queue is full); count it and return
        its length in bytes. A sink error surfaces in :meth:`close`, not here.
        """
        chunk = data if isinstance(data, bytes) else bytes(data)
        self._queue.put(chunk)
        self.size += len(chunk)
        if self.on_write is not None:
            self.on_write(len(chunk))
        return len(chunk)

    def close(self) -> None:
        """Wait for the hashing thread to drain the queue, close the stream, then re-raise any error the thread
        hit (hashing or writing to the sink). After it, ``sha256`` and ``size`` are final.
        """
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        super().close()
        if self._error is not None:
            raise self._error


def tarinfo(entry: Entry, epoch: int) -> tarfile.TarInfo:
    """The fixed tar header of a planned ``entry`` (see the module docstring for every field)."""
    info = tarfile.TarInfo(entry.path)
    info.mtime = int(epoch)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    info.devmajor = info.devminor = 0
    if entry.type == DIR:
        info.type = tarfile.DIRTYPE
    elif entry.type == SYMLINK:
        info.type = tarfile.SYMTYPE
        info.linkname = entry.target
    else:
        info.type = tarfile.REGTYPE
        info.size = entry.size()
    return info


def write_layer(
    entries: Iterable[Entry],
    out: BinaryIO | None,
    epoch: int,
    allow_absolute_symlinks: bool = False,
    on_write: Callable[[int], None] | None = None,
    pipelined: bool = False,
) -> LayerInfo:
    """Write the layer of ``entries`` to ``out`` (a binary stream, or None to only compute the digest).

    ``epoch``: the mtime of every entry, integer seconds since 1970-01-01 UTC (the lock's ``epoch``).
    ``on_write(n)`` is called with each chunk's byte count (progress bars). ``pipelined``: hash and write in
    a second thread (:class:`PipelinedHashingWriter`; for big layers). Memory: one chunk per file plus the
    entries' own ``data``; contents from ``source`` and ``opener`` are streamed.
    Returns :class:`LayerInfo`; raises :class:`UserError` for refused entries (before any byte is written)
    or when a source file changes size while it is read.
    """
    if int(epoch) < 0:
        raise UserError(f"layer epoch {epoch}: expected seconds since 1970 (>= 0)")
    planned = plan_entries(entries, allow_absolute_symlinks)
    writer = PipelinedHashingWriter(out, on_write) if pipelined else HashingWriter(out, on_write)
    try:
        _write_tar(planned, writer, epoch)
    finally:
        writer.close()
    return LayerInfo(f"sha256:{writer.sha256.hexdigest()}", writer.size, len(planned))


def _write_tar(planned: list[Entry], writer: HashingWriter, epoch: int) -> None:
    with tarfile.TarFile(
        fileobj=writer, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8", copybufsize=CHUNK
    ) as tar:
        for entry in planned:
            info = tarinfo(entry, epoch)
            if entry.type != FILE:
                tar.addfile(info)
            elif entry.data is not None:
                tar.addfile(info, io.BytesIO(entry.data))
            elif entry.opener is not None:
                try:
                    with entry.opener() as handle:
                        reader = _ExactReader(handle, info.size, entry.path, entry.sha256, entry.label)
                        tar.addfile(info, reader)
                        reader.finish()
                except (zipfile.BadZipFile, zlib.error, EOFError) as ex:
                    raise UserError(f"{entry.label or 'layer entry'}: {entry.path} is corrupt ({ex})") from None
            elif entry.source is not None:
                with open(entry.source, "rb") as handle:
                    tar.addfile(info, _ExactReader(handle, info.size, entry.path))
            else:
                raise ValueError(f"layer entry {entry.path}: a file without content")  # refused above (UserError)


class _ExactReader:
    """Reads exactly ``size`` bytes from ``handle``; a file that shrank or grew is an error. With ``sha256``
    (hex) the bytes are hashed as they pass and :meth:`finish` compares."""

    def __init__(self, handle: IO[bytes], size: int, path: str, sha256: str | None = None, label: str = "") -> None:
        self.handle, self.left, self.path = handle, size, path
        self.expected, self.label = sha256, label
        self.digest = hashlib.sha256() if sha256 is not None else None

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that remain of ``size`` when ``n`` is None or negative), hashed when a sha256
        is expected. Raises :class:`UserError` when the source ends early (shrank) or has bytes past ``size`` (grew).
        """
        want = self.left if n is None or n < 0 else min(n, self.left)
        data = self.handle.read(want)
        self.left -= len(data)
        if len(data) < want:
            raise UserError(f"layer entry {self.path!r}: source file shrank while it was read")
        if self.left == 0 and self.handle.read(1):
            raise UserError(f"layer entry {self.path!r}: source file grew while it was read")
        if self.digest is not None:
            self.digest.update(data)
        return data

    def finish(self) -> None:
        """Raise :class:`UserError` when the streamed bytes do not hash to the expected sha256."""
        if self.digest is not None and self.digest.hexdigest() != self.expected:
            raise UserError(
                f"{self.label or 'layer entry'}: {self.path} has sha256 {self.digest.hexdigest()}, "
                f"expected {self.expected} (refused)"
            )


def entries_from_tree(root: Path, prefix: str, allow_absolute_symlinks: bool = False) -> list[Entry]:
    """Entries for every file, directory and symlink under the directory ``root``, placed under ``prefix``.

    Ownership, times and permission bits other than "executable" are dropped. Raises :class:`UserError`
    for anything that is not a file, directory or symlink.
    """
    out: list[Entry] = [Entry(prefix, DIR)] if normalize_path(prefix) else []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            path = f"{prefix}/{rel}"
            st = os.lstat(full)
            if os.path.islink(full):
                out.append(Entry(path, SYMLINK, target=os.readlink(full)))
            elif os.path.isdir(full):
                out.append(Entry(path, DIR))
            elif os.path.isfile(full):
                out.append(Entry(path, FILE, source=Path(full), executable=bool(st.st_mode & 0o111)))
            else:
                raise UserError(f"{full}: not a regular file, directory or symlink (refused in a layer)")
    return out
