"""The bundle's log: every line ``train`` prints, and every decision it takes, in Hydra's job log (``train.log``).

``train`` prints its summary and its one-line errors itself (stdout and stderr stay what a user reads and a
script parses), and logs them too, with what it decided on the way (a composition from the cache or from Hydra,
a check passed, each launcher step), through the ``trainer`` logger (Python's ``logging``). Hydra configures
logging when a job starts (``hydra.job_logging``, ``conf/train.yaml``): records go to
``${hydra.runtime.output_dir}/train.log`` with a time stamp, and debug records (``hydra.verbose=true``, or
``hydra.verbose=[trainer]``) also to stdout, as a Hydra app shows them. Records made before that (while the
command line is prepared and checked, before any run directory exists) are held (:func:`hold`) and written into
the job's log once it is open (:func:`release`). Every record is redacted before any handler writes it
(:class:`Redacting`, with ``train``'s redactor: :func:`redact_with`). The file handler is a
``WatchedFileHandler``: a sweep that rewrites ``train.log`` is followed, not written past.

Both the held records and the redactor last one ``train`` command line (:func:`session`): when it ends, records
never released are dropped and the redactor is forgotten, so that a second run in the same process (a test, a
notebook) neither logs the first one's records nor scrubs with its secrets.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("trainer")

_HELD: list[logging.handlers.MemoryHandler] = []


def info(text: str) -> None:
    """Log ``text`` (what was just printed, or a step of the run) at INFO, one record per line."""
    for line in text.splitlines() or [""]:
        log.info(line)


def hold() -> None:
    """Keep the ``trainer`` logger's records (INFO and more; DEBUG too, kept for ``hydra.verbose``) in memory until
    :func:`release`: no handler exists before Hydra configures the job's logging."""
    if _HELD:
        return
    # a log that cannot be written (a full disk) is not the run's error: logging stays silent about it, and the
    # error that matters is the one line train prints
    logging.raiseExceptions = False
    handler = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # held only: not also written by handlers an earlier run left (its train.log)
    _HELD.append(handler)


def release() -> None:
    """Once Hydra configured the job's logging: hand the records held since :func:`hold` to the handlers the
    ``trainer`` logger now reaches (the job's ``train.log``), those below the level now in force left out, and
    let the logger follow Hydra's configuration (``hydra.verbose``) from then on."""
    if not _HELD:
        return
    handler = _HELD.pop()
    log.removeHandler(handler)
    log.setLevel(logging.NOTSET)
    log.propagate = True
    level = log.getEffectiveLevel()
    for record in handler.buffer:
        if record.levelno >= level:
            log.handle(record)
    handler.buffer.clear()


def drop() -> None:
    """Forget the records held since :func:`hold` and never released (a command line refused before any job's log
    was open: there is no log for them), and stop holding."""
    while _HELD:
        handler = _HELD.pop()
        log.removeHandler(handler)
        handler.buffer.clear()
    log.setLevel(logging.NOTSET)
    log.propagate = True


# The redactor every record passes through before any handler writes it (train's, for the time of its command line:
# :func:`session`). Hydra's logging configuration makes the filter (:class:`Redacting`) by name, without arguments,
# so the filter finds the redactor here.
_REDACTOR: list[Any] = []


def redact_with(redactor: Any) -> None:
    """Pass every record a handler of the job's logging writes through ``redactor``
    (:class:`trainer.redact.Redactor`, which ``train`` teaches each job's secrets as it goes: :class:`Redacting`);
    None: no longer."""
    _REDACTOR[:] = [] if redactor is None else [redactor]


@contextlib.contextmanager
def session(redactor: Any) -> Iterator[None]:
    """One ``train`` command line: records held until its job's log is open (:func:`hold`, :func:`release`), and
    every record redacted by ``redactor`` (:func:`redact_with`). When the block ends, however it ends, what was
    held and not released is dropped (:func:`drop`), the redactor is forgotten, and the handlers Hydra's job
    logging added to the root logger meanwhile (the job's ``train.log``, sealed with its run) are closed and
    removed: nothing logged later in this process is written into a finished run."""
    root = logging.getLogger()
    before = list(root.handlers)
    drop()  # what an earlier command line in this process left, were it not ended by this
    hold()
    redact_with(redactor)
    try:
        yield
    finally:
        drop()
        redact_with(None)
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
            try:
                handler.close()
            except (OSError, ValueError):  # a full disk: as logging.shutdown at exit, the log's last bytes are lost
                pass


class Redacting(logging.Filter):
    """A handler's filter (``hydra.job_logging``): the record's message, its arguments merged in, scrubbed by the
    redactor of :func:`redact_with`, so that no handler (``train.log``, a file the user names, the console) ever
    writes a secret, also while the run is still going or when it is killed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _REDACTOR:
            record.msg, record.args = _REDACTOR[0].scrub(record.getMessage()), ()
        return True


class VerboseOnly(logging.Filter):
    """A console handler's filter: passes the DEBUG records of loggers made verbose (``hydra.verbose``), nothing
    else (what ``train`` says at INFO and above it prints itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno <= logging.DEBUG
