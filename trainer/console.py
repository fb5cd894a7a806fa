"""The rich console of the bundle's tables on stdout: a terminal's width on a terminal; piped or redirected, as
wide as a table needs, so that no cell is cut to ``…`` or wrapped at rich's default of 80 columns (a log or a
``grep`` reads whole values: commits, argument names, paths)."""

from __future__ import annotations

import sys

# Piped, the width rich lays tables out in: wide enough for any row the bundle prints, and unpadded (tables
# that do not expand take only the width they need).
PIPE_WIDTH = 10_000


def table_console(stderr: bool = False):
    """A ``rich.console.Console`` for tables on stdout (``stderr``: on stderr): the terminal's width when that
    stream is a terminal, else :data:`PIPE_WIDTH` columns."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=PIPE_WIDTH)
