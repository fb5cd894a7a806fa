"""Reading a job's log without reading all of it: a real run's ``logs/job.log`` and ``slurm-JOB.out`` grow with every
step (gigabytes over a long run), while what a failure's line needs is at one end of them: the cause at the end
(:func:`tail`), the ranks' placement at the start (:func:`placement`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO

from trainer.errors import UserError
from trainer.inputs import open_regular

# bytes of a log's end: Ray's job status message carries at most 20,000 characters of the job's last output, which
# UTF-8 (a progress bar's "█" is 3 bytes) may make 80,000 bytes
TAIL_BYTES = 128 * 1024
PLACEMENT_BYTES = 4 * 1024 * 1024  # how far into a log its placement lines are looked for (they follow preflight)
RANK_PLACED_RE = re.compile(r"^rank (\d+): node (\S+) ")  # trainer.launch.ray_workers' placement lines
RENDEZVOUS_PREFIX = "rendezvous: "  # the line ray_workers prints after its placement lines
LINE_BYTES = 4096  # a line is read this far at most (a log may hold megabytes without a line break)


def _open(path: Path) -> BinaryIO | None:
    """``path`` opened for reading when it is a regular file reached without a symbolic link
    (:func:`trainer.inputs.open_regular`: a FIFO or device is refused without blocking), else None."""
    if Path(path).is_symlink():
        return None
    try:
        return open_regular(path, "job log", None)
    except (OSError, UserError):
        return None


def tail(path: Path, max_bytes: int = TAIL_BYTES) -> str:
    """The whole lines within the last ``max_bytes`` bytes of the file ``path`` as text (undecodable bytes
    replaced): all of a shorter file; "" when no line starts within them, or the file is missing, a link, not a
    regular file or unreadable."""
    handle = _open(path)
    if handle is None:
        return ""
    try:
        with handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(0, size - max_bytes)
            # one byte before the window: a line starting exactly at the window's start is kept whole
            data = os.pread(handle.fileno(), max_bytes + (start > 0), start - (start > 0))
    except OSError:
        return ""
    if start > 0:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return data.decode(errors="replace")


def placement(path: Path) -> dict[int, str]:
    """``{rank: node name}`` from the placement lines ``rank N: node NAME (ADDRESS), ...`` that
    :mod:`trainer.launch.ray_workers` prints once, before training (a Slurm attempt's ``logs/job.log`` is its own:
    the job script writes it anew). Reads line by line (:data:`LINE_BYTES` of each at most) and stops at the
    ``rendezvous:`` line that follows them, or after :data:`PLACEMENT_BYTES` (a payload other than the CPU
    worker's places no ranks this way). {} when the log is missing, a link, not a regular file or names no rank."""
    handle = _open(path)
    if handle is None:
        return {}
    placed: dict[int, str] = {}
    try:
        with handle:
            at_start, read = True, 0
            while read < PLACEMENT_BYTES and (raw := handle.readline(LINE_BYTES)):
                read += len(raw)
                line, starts, at_start = raw.decode(errors="replace"), at_start, raw.endswith(b"\n")
                if not starts:  # the rest of a line longer than LINE_BYTES
                    continue
                found = RANK_PLACED_RE.match(line)
                if found:
                    placed[int(found.group(1))] = found.group(2)
                elif placed and line.startswith(RENDEZVOUS_PREFIX):
                    break
    except OSError:
        return placed
    return placed
