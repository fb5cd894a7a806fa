"""Errors a user can cause, reported as one line without a traceback."""

from __future__ import annotations


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
