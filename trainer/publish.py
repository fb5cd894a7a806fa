"""Atomic publishing: a file or a directory appears complete under its name, or not at all.

Every output of the bundle is written here: one file through :func:`atomic_file` (a temporary sibling, fsync,
``os.replace``; :func:`atomic_write` for bytes in memory), a directory built under a temporary sibling
through :func:`swap_dir` (an image layout: the old one is moved aside, the new one renamed in, the old one
removed) or :func:`publish_files` (a rows directory: a new one is one rename; into an existing one the file
that marks it complete goes first and comes back last). A failure leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from trainer.redact import redactor_for


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys, two-space indent and a final newline (stable bytes for hashing)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``; other threads may be writing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # no /proc: the classic read, not thread-safe
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path`` (so that a rename in it is durable); a directory that cannot be opened is
    skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _named(err: OSError, path: Path) -> OSError:
    """``err`` as raised by an operation of :func:`atomic_file` on the temporary sibling of ``path``: an
    ``OSError`` of the same errno (so of the same type) with ``filename`` ``path``; one already named so (by an
    inner :func:`atomic_file`) or without an errno is returned as it is."""
    if err.errno is None or getattr(err, "_atomic_named", False):
        return err
    named = OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))
    # an atomic_file nested in another names the inner file; an exception instance takes any attribute
    named._atomic_named = True  # type: ignore[attr-defined]
    return named


class _Handle(io.BufferedWriter):
    """The handle :func:`atomic_file` yields: a buffered writer of the temporary file whose ``write`` and
    ``flush`` (and so ``writelines`` and ``close``) raise their ``OSError`` named after the target
    (:func:`_named`): the only errors of the caller's code that are the target's."""

    target: Path

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as err:
            raise _named(err, self.target) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as err:
            raise _named(err, self.target) from None


@contextlib.contextmanager
def atomic_file(
    path: Path, mode: int = 0o666, umask_applies: bool = True, prefix: str | None = None
) -> Iterator[BinaryIO]:
    """A binary handle on a temporary sibling of ``path`` (name ``prefix`` + random, default ``.NAME.``); on a
    clean exit it is flushed, fsynced, given ``mode`` (less the process umask unless ``umask_applies`` is false)
    and renamed onto ``path``; on an exception it is removed and ``path`` is left as it was.

    An ``OSError`` of the write itself (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``ENAMETOOLONG``, ...: raised by making
    the temporary file, which has no name the user knows, by its ``fchmod``, by a write to or flush of the handle,
    which name none, by the ``fsync`` or the rename) is raised with ``filename`` set to ``path``, so that its one
    line (:func:`trainer.errors.os_error_line`) names the file that could not be written; its type (by errno) is
    kept. Any other error raised by the caller's code in the ``with`` body (reading its input, writing another
    file) is raised unchanged: it is not the target's. Making the parent directory raises as ``mkdir`` does (its
    ``filename`` is the directory)."""
    path = Path(path)
    prefix = prefix or f".{path.name}."
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    except OSError as err:
        raise _named(err, path) from None
    try:
        mask = umask() if umask_applies else 0
        try:
            os.fchmod(fd, mode & ~mask)
            raw = io.FileIO(fd, "wb", closefd=True)
        except OSError as err:
            os.close(fd)
            raise _named(err, path) from None
        handle = _Handle(raw)
        handle.target = path
        with handle:
            yield handle
            handle.flush()
            try:
                os.fsync(handle.fileno())
            except OSError as err:
                raise _named(err, path) from None
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise _named(err, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes, mode: int = 0o666, umask: bool = True, verbatim: bool = False) -> str:
    """Write ``data`` to ``path`` through :func:`atomic_file`; return the sha256 (hex) of the bytes written.

    ``mode`` is applied less the process umask (as ``open()`` would) unless ``umask`` is false. Under a run
    directory guarded by :func:`trainer.redact.guarding` the bytes are scrubbed of secrets first (the hash is of
    what was written), unless ``verbatim`` (a copy of content verified by digest, which must stay byte-exact).
    """
    redactor = None if verbatim else redactor_for(Path(path))
    if redactor is not None:
        data = redactor.scrub_bytes(data)
    with atomic_file(path, mode, umask) as handle:
        handle.write(data)
    return hashlib.sha256(data).hexdigest()


def temp_dir(out: Path, prefix: str | None = None, mode: int | None = None) -> Path:
    """A new empty temporary sibling of ``out`` (name ``prefix`` + random, default ``.NAME.``) to build a
    directory in; ``mode`` (less the umask) replaces mkdtemp's 0700 when given."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{out.name}.", dir=out.parent))
    if mode is not None:
        tmp.chmod(mode & ~umask())
    return tmp


def swap_dir(tmp: Path, out: Path) -> None:
    """Rename the complete directory ``tmp`` onto ``out``: an existing ``out`` is moved aside first (to
    ``.OUT.old-<pid>-*``), then removed. Callers check that ``out`` may be replaced."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        os.rmdir(old)
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def publish_files(tmp: Path, out: Path, names: Sequence[str], marker: str) -> None:
    """Move the finished files ``names`` from ``tmp`` to ``out``: one rename if ``out`` is new (``tmp`` is then
    made again, empty, for the caller's cleanup); otherwise ``marker`` (the file whose presence says the
    directory is complete) is removed first, the other files replaced, and ``marker`` replaced last. Other
    files of ``out`` stay."""
    try:
        os.rename(tmp, out)
        tmp.mkdir()
        return
    except OSError:
        pass
    (out / marker).unlink(missing_ok=True)
    for name in [n for n in names if n != marker] + [marker]:
        os.replace(tmp / name, out / name)
