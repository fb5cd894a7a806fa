"""Reading tar archives: member names, layer streams, and a tar's members as layer entries.

Every reader of a tar in the bundle (source archives, a .deb's control and data archives, image layers, base
image archives) names members the same way: :func:`member_parts` drops empty and ``.`` components, so
``./usr//bin/x``, ``/usr/bin/x`` and ``usr/bin/x`` are one path. :func:`tar_entries` turns members into
:class:`~trainer.image.layer.Entry` objects for a new layer, the one place that decides what a directory, a
symlink, a hard link (a copy of its target's content) and a special file (refused) become.
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO, BinaryIO

from trainer.errors import UserError
from trainer.image.layer import DIR, FILE, SYMLINK, Entry


def member_parts(name: str) -> list[str]:
    """The components of a tar member's ``name`` without empty and ``.`` ones ("./usr//bin" -> ["usr", "bin"]);
    ``..`` components are kept (callers refuse them)."""
    return [p for p in name.split("/") if p not in ("", ".")]


def member_name(name: str) -> str:
    """A member's name the way members are compared: no leading ``./`` or ``/``, no empty parts."""
    return "/".join(member_parts(name))


def member_stream(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    """The content of ``member`` of ``tar`` as a stream (:meth:`tarfile.TarFile.extractfile`). Raises
    :class:`UserError` for a member that has none (not a regular file or a hard link to one)."""
    handle = tar.extractfile(member)
    if handle is None:
        raise UserError(f"archive member {member.name!r}: not a regular file")
    return handle


def open_layer(raw: IO[bytes]) -> tarfile.TarFile:
    """A streaming tar reader over a layer blob, gzip-compressed (sniffed by its magic bytes) or plain;
    ``raw`` must be seekable to its start."""
    head = raw.read(2)
    raw.seek(0)
    stream: gzip.GzipFile | IO[bytes] = gzip.GzipFile(fileobj=raw) if head == b"\x1f\x8b" else raw
    return tarfile.open(fileobj=stream, mode="r|")


def members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar`` in order; a broken archive or an undecodable name is one :class:`UserError`."""
    while True:
        try:
            member = tar.next()
        except (tarfile.TarError, EOFError, zlib.error, OSError) as ex:
            raise UserError(f"archive: corrupt or truncated ({ex})") from None
        if member is None:
            return
        yield member


def tar_entries(
    items: Iterable[tarfile.TarInfo],
    where: str,
    path_of: Callable[[list[str]], str | None],
    file_entry: Callable[[tarfile.TarInfo, str, dict], Entry],
    keep_modes: bool = False,
    key_of: Callable[[list[str]], str] = "/".join,
) -> list[Entry]:
    """The members ``items`` as layer entries, in archive order.

    ``where`` starts every error ("archive", "foo.deb: archive"); ``path_of(parts)`` gives a member's path in
    the layer (None: skip it); ``file_entry(member, path, mode)`` reads a regular file (size limits and
    spooling are the caller's; ``mode`` holds the Entry's mode fields); ``keep_modes`` keeps every member's
    permission bits (``mode_bits``, a .deb's) instead of the layer's normalized ones (``executable`` from any
    execute bit; directories 0755); ``key_of(parts)`` names a file for hard links (a link's ``linkname`` is looked up
    the same way, so a hard link becomes a copy of an earlier file's content with its own mode).

    Raises :class:`UserError` for a ``..`` component, a hard link to no earlier file, and a device, FIFO or
    other special file.
    """
    out: list[Entry] = []
    files: dict[str, Entry] = {}
    for member in items:
        parts = member_parts(member.name)
        if ".." in parts:
            raise UserError(f"{where} member {member.name!r}: '..' in path")
        path = path_of(parts)
        if path is None:
            continue
        bits = member.mode & 0o7777
        mode = {"mode_bits": bits} if keep_modes else {"executable": bool(bits & 0o111)}
        if member.isdir():
            entry = Entry(path, DIR, **(mode if keep_modes else {}))
        elif member.issym():
            entry = Entry(path, SYMLINK, target=member.linkname)
        elif member.islnk():
            target = files.get(key_of(member_parts(member.linkname)))
            if target is None:
                raise UserError(f"{where} member {member.name!r}: hard link to unknown {member.linkname!r}")
            entry = Entry(path, FILE, data=target.data, source=target.source, **mode)
        elif member.isreg():
            entry = file_entry(member, path, mode)
            files[key_of(parts)] = entry
        else:
            raise UserError(f"{where} member {member.name!r}: device, FIFO or other special file refused")
        out.append(entry)
    return out


MAX_MEMBER_BYTES = 1 << 30  # one file of a source archive (read into memory: the largest source file is ~10 MB)
MAX_ARCHIVE_BYTES = 4 << 30  # all files of one source archive, uncompressed


def entries_from_tar(
    stream: BinaryIO, prefix: str, strip_components: int = 0, allow_absolute_symlinks: bool = False
) -> list[Entry]:
    """Entries of a tar archive (any compression :mod:`tarfile` reads), re-rooted under ``prefix``.

    ``strip_components`` leading path components are removed (like ``tar --strip-components``). Hard links
    become copies of their target's content; pax/global headers are dropped. Raises :class:`UserError` for
    device files, FIFOs, ``..`` paths, and links that escape the root.
    """
    total = [0]
    try:
        tar = tarfile.open(fileobj=stream, mode="r:*", encoding="utf-8", errors="surrogateescape")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as ex:
        raise UserError(f"archive: not a tar archive this reader accepts ({ex})") from None

    def path_of(parts: list[str]) -> str | None:
        if len(parts) <= strip_components:
            return None
        rel = "/".join(parts[strip_components:])
        return f"{prefix}/{rel}" if prefix.strip("/") else rel

    def sized(items: Iterable[tarfile.TarInfo]) -> Iterator[tarfile.TarInfo]:
        for member in items:
            if member.isreg():
                total[0] += member.size
                if member.size > MAX_MEMBER_BYTES or total[0] > MAX_ARCHIVE_BYTES:
                    raise UserError(
                        f"archive member {member.name!r}: {member.size:,} bytes ({total[0]:,} so far), more "
                        f"than {MAX_MEMBER_BYTES:,} per file or {MAX_ARCHIVE_BYTES:,} per source archive"
                    )
            yield member

    def file_entry(member: tarfile.TarInfo, path: str, mode: dict) -> Entry:
        try:
            data = member_stream(tar, member).read()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as ex:
            raise UserError(f"archive: corrupt or truncated in member {member.name!r} ({ex})") from None
        return Entry(path, FILE, data=data, **mode)

    with tar:
        return tar_entries(sized(members(tar)), "archive", path_of, file_entry)
