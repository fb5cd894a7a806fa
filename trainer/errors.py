"""Errors a user can cause, reported as one line without a traceback; and the one line of an error no user caused
(:func:`internal_error_line`: a bug, exit :data:`EX_SOFTWARE`)."""

from __future__ import annotations

import errno
import os
import traceback


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


EX_SOFTWARE = 70
"""The exit code of an internal error (``sysexits.h``'s ``EX_SOFTWARE``): an exception no reader or check turned
into a :class:`UserError` is a bug in the bundle, not bad input (2)."""
DEBUG_VARIABLE = "TRAINER_DEBUG"
"""The environment variable that, set (``TRAINER_DEBUG=1``), makes an internal error print its traceback too."""


def debugging() -> bool:
    """Whether :data:`DEBUG_VARIABLE` is set to a non-empty value: an internal error then shows its traceback."""
    return bool(os.environ.get(DEBUG_VARIABLE))


def internal_error_line(prog: str, err: BaseException) -> str:
    """The one line of an unexpected exception ``err`` in the command ``prog`` (``trainer data``, ``train``):
    ``PROG: internal error: TYPE: MESSAGE (a bug: please report it; TRAINER_DEBUG=1 shows the traceback)``, the
    message on one line (white space runs folded) and cut at 300 characters. Callers pass it through their
    redactor (:mod:`trainer.redact`) before printing it, as every error line."""
    message = " ".join(str(err).split())
    message = message if len(message) <= 300 else message[:299] + "…"
    what = f"{type(err).__name__}: {message}" if message else type(err).__name__
    return f"{prog}: internal error: {what} (a bug: please report it; {DEBUG_VARIABLE}=1 shows the traceback)"


def internal_error_report(prog: str, err: BaseException) -> str:
    """What an entry point prints on stderr for the unexpected exception ``err`` (being handled): its
    :func:`internal_error_line`, after its traceback when :func:`debugging`; newline-terminated, not yet redacted."""
    trace = "".join(traceback.format_exception(err)) if debugging() else ""
    return trace + internal_error_line(prog, err) + "\n"
