"""Errors a user can cause, reported as one line without a traceback."""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """Bad input: a config field, an override or a file. ``str(err)`` is the whole report.

    Entry points print ``str(err)`` on one line to stderr and exit with :attr:`exit_code`
    (2: the input was refused before anything was written).
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class CheckError(UserError):
    """A composed config that fails a pre-launch check; the message names the field and the arithmetic."""


# The errors of a place rather than of a program (a full disk, a quota, a read-only mount, a name longer than the
# file system takes, no permission): each is reported as one line naming the file (:func:`os_error_line`).
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # writing stopped: the disk, the quota, the mount
PLACE_ERRNOS = (
    *STORAGE_ERRNOS,
    errno.ENAMETOOLONG,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOENT,
    errno.EEXIST,
    errno.ELOOP,
)


def os_error_line(err: OSError, where: str = "") -> str:
    """``err`` as one line: ``FILE: no space left on device`` (the file the error names, else ``where``; the
    system's message with a lower-case first letter). ``FILE`` is the file the write or open was for (a temporary
    sibling is named by its target: :func:`trainer.publish.atomic_file`)."""
    name = err.filename if err.filename is not None else where
    text = err.strerror or str(err) or type(err).__name__
    text = text[:1].lower() + text[1:]
    return " ".join((f"{os.fsdecode(name)}: {text}" if name else text).split())


def place_error(err: BaseException) -> UserError | None:
    """A :class:`UserError` of one line (:func:`os_error_line`) for an ``OSError`` whose errno is one of
    :data:`PLACE_ERRNOS` (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``ENAMETOOLONG``, ``EACCES``, ...), else None (a
    program's error, left to its own handler)."""
    if isinstance(err, OSError) and err.errno in PLACE_ERRNOS:
        return UserError(os_error_line(err))
    return None
