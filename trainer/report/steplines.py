"""Which lines of a training log are step lines: Megatron's ``iteration N/M |`` and miles' ``step N: {...}``
dicts (ANSI colour codes aside). :mod:`trainer.report.logs` reads the steps from them; a reader of
``metrics.jsonl`` (:func:`trainer.report.metrics.read_metrics`) uses :func:`step_line_kind` to tell a raw log it
was given by mistake."""

from __future__ import annotations

import re

MEGATRON_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
MILES_START = re.compile(r"\b(step|perf) (\d+): \{(.*)$")  # a miles dict line, closed or not
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Ray colours its dedup marker (colorama)


def step_line_kind(line: str) -> str | None:
    """``"Megatron iteration"`` or ``"miles step"`` when ``line`` is a training step line of a log (complete or
    not), else None: how a reader of metrics.jsonl tells a raw log it was given by mistake."""
    line = ANSI.sub("", line)
    if MEGATRON_ITERATION.search(line):
        return "Megatron iteration"
    match = MILES_START.search(line)
    if match and match.group(1) == "step" and miles_partial(match.group(3)):
        return "miles step"
    return None


def miles_partial(rest: str) -> bool:
    """True when ``rest`` (after ``step K: {``) can be the start of a miles metrics dict (``'train/...``)."""
    return any(rest.startswith(p) or p.startswith(rest) for p in ("'train/", '"train/', "'perf/", '"perf/'))
